"""What each part of the page shows, as plain values (tables, text, frames): app.py only lays them out, so all of
it is tested without a browser."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pandas as pd

from gemmaforge.config import RunConfig
from gemmaforge.errors import UserError
from gemmaforge.runs import RunDir
from gemmaforge.ui.launch_checks import base_of, refusal
from gemmaforge.ui.launcher import Launcher, log_tail
from gemmaforge.ui.overview import (
    STAGES,
    MetricsTail,
    RunSummary,
    config_diff,
    files_of,
    find_runs,
    points,
    read_json,
    stage_status,
    summarize,
)
from gemmaforge.ui.playground import Playground
from gemmaforge.units import GiB

RUN_COLUMNS = ["run", "status", "model", "data", "stages", "seconds", "samples/s", "peak memory (GiB)",
               "best eval loss", "pass rate base -> tuned"]
# (title, y axis, metrics.jsonl keys drawn, scale applied to the values)
CURVES = (
    ("Loss", "loss", ("loss", "eval_loss"), 1.0),
    ("Learning rate", "learning rate", ("learning_rate",), 1.0),
    ("Supervised tokens/s", "tokens/s", ("supervised_tokens_per_second",), 1.0),
    ("Memory (GiB)", "GiB", ("peak_memory_bytes", "torch_allocated_bytes", "gpu_memory_used_bytes", "rss_bytes"),
     1 / GiB),
    ("GPU utilisation (%) and temperature (C)", "", ("gpu_utilization_pct", "gpu_temperature_c"), 1.0),
    ("Preference rewards (train.method: dpo, kto, rm)", "reward",
     ("rewards/chosen", "rewards/rejected", "rewards/margins", "eval_rewards/margins"), 1.0),
)


def _cell(value: Any, digits: int = 4) -> Any:
    if value is None:
        return "-"
    return round(value, digits) if isinstance(value, float) else value


def summary_row(s: RunSummary) -> list[Any]:
    done = sum(status == "done" for status in s.stages.values())
    return [s.name, s.status if s.error is None else f"{s.status}: {s.error}", s.model, s.data,
            f"{done}/{len(s.stages)}", _cell(s.runtime_s, 1), _cell(s.samples_per_second, 2),
            _cell(s.peak_memory_bytes / GiB if s.peak_memory_bytes is not None else None, 2),
            _cell(s.best_eval_loss), f"{_cell(s.pass_rate[0])} -> {_cell(s.pass_rate[1])}"]


class Dashboard:
    """The dashboard's view of one folder of runs; one per server, shared by every browser tab."""

    def __init__(self, runs_dir: Path, home: Path, launcher: Launcher | None = None):
        self.runs_dir, self.home = runs_dir.resolve(), home
        self.launcher = launcher or Launcher()
        self.playground = Playground(home)
        self._tails: dict[Path, MetricsTail] = {}

    # ------------------------------------------------------------------ runs
    def runs(self) -> list[Path]:
        return find_runs(self.runs_dir)

    def names(self) -> list[str]:
        return [self.name(root) for root in self.runs()]

    def name(self, root: Path) -> str:
        return str(root.relative_to(self.runs_dir)) if root != self.runs_dir else root.name

    def root(self, name: str | None) -> Path | None:
        """The run directory a name from the page stands for; None for no name or one that is not a run here."""
        if not name:
            return None
        for root in self.runs():
            if self.name(root) == name:
                return root
        return None

    def _tail(self, root: Path) -> MetricsTail:
        """The run's metrics.jsonl reader, kept between refreshes so that only new lines are parsed."""
        return self._tails.setdefault(root, MetricsTail(root / "metrics.jsonl"))

    def metrics(self, root: Path) -> list[dict[str, Any]]:
        return self._tail(root).read()

    def table(self) -> pd.DataFrame:
        self.launcher.reap()  # a run started here that has ended must not look alive (an unreaped child)
        rows = [summary_row(summarize(root, self.runs_dir, self._tail(root))) for root in self.runs()]
        return pd.DataFrame(rows, columns=RUN_COLUMNS)

    def stages(self, name: str | None) -> pd.DataFrame:
        columns = ["stage", "status", "seconds", "started"]
        root = self.root(name)
        records = ((read_json(root / "manifest.json") or {}).get("stages") or {}) if root else {}
        order = [*[s for s in STAGES if s in records], *[s for s in records if s not in STAGES]]
        rows = [[s, stage_status(records[s]), _cell(records[s].get("runtime_s"), 1), records[s].get("started", "-")]
                for s in order]
        return pd.DataFrame(rows, columns=columns)

    def config_text(self, name: str | None) -> str:
        root = self.root(name)
        return (root / "run.yaml").read_text(encoding="utf-8") if root else ""

    def system_prompt(self, name: str | None) -> str:
        """The system prompt the run's deployed model is given (what the chat starts with)."""
        root = self.root(name)
        try:
            return (RunDir(root).config().deployed_system or "") if root else ""
        except UserError:  # a run.yaml this version does not read; the run list says so
            return ""

    def console(self, name: str | None) -> str:
        root = self.root(name)
        return log_tail(root) if root else ""

    def files(self, name: str | None) -> pd.DataFrame:
        root = self.root(name)
        return pd.DataFrame(files_of(root) if root else [], columns=["file", "size"])

    def diff(self, a: str | None, b: str | None) -> pd.DataFrame:
        first, second = self.root(a), self.root(b)
        rows = config_diff(first, second) if first and second else []
        return pd.DataFrame(rows, columns=["key", "first run", "second run"])

    # ------------------------------------------------------------------ curves
    def curves(self, names: list[str] | None) -> list[pd.DataFrame]:
        """One long-form frame (step, value, series) per entry of CURVES, each run's series named 'run: key'."""
        roots = [(name, self.root(name)) for name in names or []]
        frames = []
        for _, _, keys, scale in CURVES:
            rows = [(step, value * scale, f"{name}: {key}") for name, root in roots if root
                    for key in keys for step, value in points(self.metrics(root), key)]
            frames.append(pd.DataFrame(rows, columns=["step", "value", "series"]))
        return frames

    # ------------------------------------------------------------------ control
    def launch(self, config: RunConfig) -> str:
        """Start a checked config unless its memory plan says it cannot fit (as the train stage would refuse it,
        but before anything starts); a message for the page either way."""
        try:
            self.launcher.check_free(Path(config.output_dir))
            why = refusal(config, base_of(config, self.home))
            if why is not None:
                return f"**Not started:** {why}"
            root = self.launcher.start(config)
        except UserError as exc:
            return f"**Not started.** {exc}"
        return f"Started `{root}`: it shows under Runs as it goes (console output in {root / 'run.log'})."

    def resume(self, name: str | None) -> str:
        root = self.root(name)
        if root is None:
            return "Choose a run first."
        try:
            self.launcher.resume(root)
        except UserError as exc:
            return f"**Not resumed.** {exc}"
        return f"Resumed `{name}`: training continues from its last complete checkpoint."

    def stop(self, name: str | None) -> str:
        root = self.root(name)
        if root is None:
            return "Choose a run first."
        if not self.launcher.stop(root):
            return f"`{name}` is not running on this machine."
        return f"Stopping `{name}`: its stage records 'stopped' (resume continues from the last checkpoint)."
