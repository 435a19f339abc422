"""Trainer callbacks: metrics.jsonl (one object per log step) and the progress line; the loss.png curve, drawn once
training is over (matplotlib's first drawing on a machine builds its font cache: tens of seconds that must never
stall a training step)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from transformers import TrainerCallback
from transformers.trainer_callback import ProgressCallback

from gemmaforge.system.monitor import MONITOR_KEYS, status_line
from gemmaforge.train.preference import PREFERENCE_METRICS

_KEPT = (
    "loss", "eval_loss", "learning_rate", "grad_norm", "epoch", "supervised_tokens_per_second", "peak_memory_bytes",
    *MONITOR_KEYS,
    *PREFERENCE_METRICS, *(f"eval_{name}" for name in PREFERENCE_METRICS),  # preference runs (train/preference.py)
)


class MetricsCallback(TrainerCallback):
    def __init__(self, metrics_path: Path, writes: bool):
        self.metrics_path = metrics_path
        self.writes = writes  # this process writes the run directory (one per run, or per node when not shared)

    def on_log(self, args: Any, state: Any, control: Any, logs: dict[str, float] | None = None, **kwargs: Any) -> None:
        if not self.writes or not logs:
            return
        if "loss" not in logs and "eval_loss" not in logs:  # e.g. the end-of-training summary
            return
        row = {"step": state.global_step, **{k: logs[k] for k in _KEPT if k in logs}}
        with self.metrics_path.open("a", encoding="utf-8") as f:
            f.write(json.dumps(row) + "\n")


def read_metrics(path: Path) -> list[dict[str, Any]]:
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line]


def plot_losses(metrics_path: Path, plot_path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = read_metrics(metrics_path)
    fig, ax = plt.subplots(figsize=(7, 4))
    for key, style in (("loss", "-"), ("eval_loss", "o-")):
        points = [(r["step"], r[key]) for r in rows if key in r]
        if points:
            ax.plot(*zip(*points), style, label=key.replace("_", " "))
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    tmp = plot_path.with_name(f".{plot_path.name}.tmp.png")
    fig.savefig(tmp, dpi=100)
    plt.close(fig)
    tmp.replace(plot_path)


class TrainingProgress(ProgressCallback):
    """The progress bar with one readable line per log: step, loss, throughput and the device's state."""

    def on_log(self, args: Any, state: Any, control: Any, logs: dict[str, Any] | None = None, **kwargs: Any) -> None:
        if not state.is_world_process_zero or self.training_bar is None or not logs:
            return
        if "loss" not in logs and "eval_loss" not in logs:
            return
        parts = [f"step {state.global_step}/{state.max_steps}"]
        parts += [f"{key.replace('_', ' ')} {logs[key]:.4g}" for key in ("loss", "eval_loss", "grad_norm")
                  if key in logs]
        if "learning_rate" in logs:
            parts.append(f"lr {logs['learning_rate']:.2e}")
        if "supervised_tokens_per_second" in logs:
            parts.append(f"{logs['supervised_tokens_per_second']:,.0f} tok/s")
        device = status_line(logs)
        self.training_bar.write("  ".join(parts + ([device] if device else [])))
