"""Runs as their directories show them: what the dashboard's tables and curves are made of.

Everything is read from files the stages write atomically, except metrics.jsonl, which the trainer appends
to: its reader takes whole lines only and keeps its place, so a page refreshing every few seconds reads only
what was added (a 10,000-row file is parsed once).
"""

from __future__ import annotations

import json
import os
import socket
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from gemmaforge.runs import RunDir
from gemmaforge.units import decimal_size

# in the order run_all runs them; the others (export_adapter, export_vllm, export_verify) follow when present
STAGES = ("data", "train", "eval", "merge", "export_gguf", "export_ollama")
MAX_POINTS = 2000  # per curve drawn: a longer series is thinned evenly, its last point kept


def find_runs(runs_dir: Path) -> list[Path]:
    """The run directories in runs_dir (itself when it is one), the most recently changed first."""
    if (runs_dir / "run.yaml").is_file():
        return [runs_dir]
    found = [p.parent for p in runs_dir.glob("*/run.yaml")]
    return sorted(found, key=lambda p: _changed(p), reverse=True)


def _changed(root: Path) -> float:
    return max((p.stat().st_mtime for p in (root / "manifest.json", root / "metrics.jsonl", root / "run.yaml")
                if p.exists()), default=0.0)


class MetricsTail:
    """metrics.jsonl read as it grows. A shorter or replaced file (a resumed run rewrites it up to its
    checkpoint) is read again from the start; a last line without its newline waits for the next read."""

    def __init__(self, path: Path):
        self.path = path
        self.rows: list[dict[str, Any]] = []
        self._offset = 0
        self._inode: int | None = None

    def read(self) -> list[dict[str, Any]]:
        try:
            stat = self.path.stat()
        except FileNotFoundError:
            self.rows, self._offset, self._inode = [], 0, None
            return self.rows
        if stat.st_ino != self._inode or stat.st_size < self._offset:
            self.rows, self._offset, self._inode = [], 0, stat.st_ino
        if stat.st_size > self._offset:
            with self.path.open("rb") as f:
                f.seek(self._offset)
                chunk = f.read(stat.st_size - self._offset)
            complete = chunk[: chunk.rfind(b"\n") + 1]
            self._offset += len(complete)
            for line in complete.splitlines():
                try:
                    row = json.loads(line)
                except ValueError:
                    continue  # a line no stage writes; the curves show the others
                if isinstance(row, dict):
                    self.rows.append(row)
        return self.rows


def points(rows: list[dict[str, Any]], key: str) -> list[tuple[int, float]]:
    """(step, value) of the rows that have the key, at most MAX_POINTS of them."""
    found = [(row["step"], row[key]) for row in rows if isinstance(row.get(key), (int, float)) and "step" in row]
    if len(found) <= MAX_POINTS:
        return found
    stride = len(found) / MAX_POINTS
    return [found[int(i * stride)] for i in range(MAX_POINTS - 1)] + [found[-1]]


def _alive(pid: Any) -> bool:
    if not isinstance(pid, int):
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def stage_status(record: dict[str, Any]) -> str:
    """A stage's status; 'running' whose process (on this host) has gone without saying so is 'interrupted'."""
    status = str(record.get("status", "?"))
    if status == "running" and record.get("host") == socket.gethostname() and not _alive(record.get("pid")):
        return "interrupted"
    return status


def running_pid(manifest: dict[str, Any]) -> int | None:
    """The live process (on this host) that records the run's stages, if any: a running stage's, or the pipeline's
    between two stages. This is what 'stop' signals."""
    for record in manifest.get("stages", {}).values():
        if record.get("host") == socket.gethostname() and _alive(record.get("pid")):
            return record.get("pid")
    return None


@dataclass
class RunSummary:
    name: str
    root: Path
    model: str
    data: str
    status: str
    stages: dict[str, str] = field(default_factory=dict)
    runtime_s: float | None = None
    samples_per_second: float | None = None
    peak_memory_bytes: int | None = None
    best_eval_loss: float | None = None
    pass_rate: tuple[float | None, float | None] = (None, None)  # base, tuned
    error: str | None = None


def overall_status(stages: dict[str, str], live: bool = False) -> str:
    """One word for the run; `live`: its process still runs (between two stages, every recorded one is done)."""
    if live or "running" in stages.values():
        return "running"
    for status in ("failed", "interrupted", "stopped"):
        if status in stages.values():
            return status
    return "done" if stages else "new"


def read_json(path: Path) -> dict[str, Any] | None:
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return value if isinstance(value, dict) else None


def summarize(root: Path, runs_dir: Path, metrics: MetricsTail | None = None) -> RunSummary:
    name = str(root.relative_to(runs_dir)) if root != runs_dir else root.name
    try:
        config = yaml.safe_load((root / "run.yaml").read_text(encoding="utf-8")) or {}
    except (OSError, yaml.YAMLError) as exc:
        return RunSummary(name, root, "?", "?", "unreadable", error=f"run.yaml: {exc}")
    model = str((config.get("model") or {}).get("name_or_path", "?"))
    data = str((config.get("data") or {}).get("path", "?"))
    manifest = read_json(root / "manifest.json") or {}
    records = manifest.get("stages", {})
    stages = {name: stage_status(record) for name, record in records.items()}
    runtimes = [r["runtime_s"] for r in records.values() if isinstance(r.get("runtime_s"), (int, float))]
    rows = (metrics or MetricsTail(root / "metrics.jsonl")).read()
    peaks = [r["peak_memory_bytes"] for r in rows if isinstance(r.get("peak_memory_bytes"), int)]
    eval_losses = [r["eval_loss"] for r in rows if isinstance(r.get("eval_loss"), (int, float))]
    results = read_json(root / "eval" / "results.json") or {}
    return RunSummary(
        name, root, model, data, overall_status(stages, running_pid(manifest) is not None), stages,
        runtime_s=round(sum(runtimes), 1) if runtimes else None,
        samples_per_second=records.get("train", {}).get("samples_per_second"),
        peak_memory_bytes=max(peaks) if peaks else None,
        best_eval_loss=min(eval_losses) if eval_losses else None,
        pass_rate=((results.get("base") or {}).get("suite_pass_rate"),
                   (results.get("tuned") or {}).get("suite_pass_rate")),
    )


def flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
    """A nested config as dotted keys (train.learning_rate), the form overrides take on the command line."""
    if not isinstance(tree, dict):
        return {prefix: tree}
    flat: dict[str, Any] = {}
    for key, value in tree.items():
        flat.update(flatten(value, f"{prefix}.{key}" if prefix else str(key)))
    return flat


def config_diff(a: Path, b: Path) -> list[tuple[str, str, str]]:
    """(key, value in a, value in b) for every run.yaml key whose values differ."""
    flat = [flatten(yaml.safe_load((root / "run.yaml").read_text(encoding="utf-8")) or {}) for root in (a, b)]
    keys = sorted(set(flat[0]) | set(flat[1]))
    missing = "(absent)"
    return [(k, json.dumps(flat[0].get(k, missing)), json.dumps(flat[1].get(k, missing))) for k in keys
            if flat[0].get(k, missing) != flat[1].get(k, missing)]


def files_of(root: Path) -> list[tuple[str, str]]:
    """(path in the run, size) of what the stages wrote for deployment: GGUF files, the Modelfile, the adapter."""
    run = RunDir(root)
    found = []
    for folder in (run.gguf_dir, run.ollama_dir, run.adapter_dir):
        if folder.is_dir():
            found += [(str(p.relative_to(root)), decimal_size(p.stat().st_size))
                      for p in sorted(folder.iterdir()) if p.is_file()]
    return found
