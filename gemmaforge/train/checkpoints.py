"""Checkpoints that survive SIGKILL: only complete ones are ever resumed from.

The Trainer writes `checkpoint-N/` file by file (adapter, optimizer, scheduler, RNG, trainer state), so
a kill mid-save leaves a folder that looks like a checkpoint. `CompleteMarker` writes a marker file
atomically after the Trainer reports the save finished; resuming considers only marked folders and
deletes unmarked ones, then drops metrics logged after the checkpoint (they will be logged again).
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import Any

from transformers import TrainerCallback

from gemmaforge.runs import atomic_write_text

MARKER = "gemmaforge-complete.json"
_CHECKPOINT = re.compile(r"^checkpoint-(\d+)$")


class CompleteMarker(TrainerCallback):
    def __init__(self, writes: bool):
        self.writes = writes  # this process writes the run directory

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        folder = Path(args.output_dir) / f"checkpoint-{state.global_step}"
        if self.writes and folder.is_dir():
            atomic_write_text(folder / MARKER, json.dumps({"step": state.global_step, "max_steps": state.max_steps}))


def checkpoints(folder: Path) -> list[tuple[int, Path]]:
    found = [(int(m.group(1)), p) for p in folder.iterdir() if (m := _CHECKPOINT.match(p.name)) and p.is_dir()]
    return sorted(found)


def last_complete_checkpoint(folder: Path, delete_incomplete: bool = True) -> Path | None:
    """The newest marked checkpoint; unmarked (half-written) checkpoint folders are deleted (by one
    process only when several share the folder)."""
    if not folder.is_dir():
        return None
    complete = None
    for _step, path in checkpoints(folder):
        if (path / MARKER).is_file():
            complete = path
        elif delete_incomplete:
            shutil.rmtree(path, ignore_errors=True)
    return complete


def complete_steps(folder: Path) -> list[int]:
    """The steps of the marked checkpoints in `folder`."""
    return [step for step, path in checkpoints(folder) if (path / MARKER).is_file()] if folder.is_dir() else []


def keep_metrics_until(metrics_path: Path, step: int) -> None:
    """Drop metrics.jsonl rows after `step`: the resumed run logs those steps again."""
    if not metrics_path.is_file():
        return
    rows = [line for line in metrics_path.read_text(encoding="utf-8").splitlines() if line]
    kept = [line for line in rows if json.loads(line).get("step", 0) <= step]
    atomic_write_text(metrics_path, "".join(line + "\n" for line in kept))
