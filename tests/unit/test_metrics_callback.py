"""metrics.jsonl gets one row per log step (rank 0 only); loss.png is drawn once training is over, never by a log
(docs/training.md: "`loss.png` is drawn after training")."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from gemmaforge.train.callbacks import MetricsCallback, plot_losses


def test_each_log_is_a_row_and_no_log_draws_the_plot(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import matplotlib.pyplot as plt

    metrics, plot = tmp_path / "metrics.jsonl", tmp_path / "loss.png"
    callback, other_rank = MetricsCallback(metrics, writes=True), MetricsCallback(metrics, writes=False)
    drawn = []
    monkeypatch.setattr(plt, "subplots", lambda *a, **k: drawn.append(a) or pytest.fail("a log drew the plot"))

    def log(step: int, rank0: bool = True, **logs: float) -> None:
        (callback if rank0 else other_rank).on_log(None, SimpleNamespace(global_step=step), None, logs=logs)

    log(1, loss=4.0, learning_rate=1e-3)
    log(2, loss=3.5)
    log(2, eval_loss=3.6)
    log(3, loss=3.0)
    log(4, loss=2.8, rank0=False)  # another rank's log: not a row
    log(4, eval_loss=3.1)
    log(5, train_runtime=9.0)  # the end-of-training summary is not a metrics row
    callback.on_train_end(None, SimpleNamespace(global_step=5), None)
    assert not plot.exists() and not drawn
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [(r["step"], r.get("loss"), r.get("eval_loss")) for r in rows] == \
        [(1, 4.0, None), (2, 3.5, None), (2, None, 3.6), (3, 3.0, None), (4, None, 3.1)]
    assert rows[0]["learning_rate"] == 1e-3


def test_the_plot_has_both_curves(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import matplotlib.pyplot as plt

    metrics, plot = tmp_path / "metrics.jsonl", tmp_path / "loss.png"
    metrics.write_text("".join(json.dumps(row) + "\n" for row in (
        {"step": 1, "loss": 4.0}, {"step": 2, "loss": 3.5}, {"step": 2, "eval_loss": 3.6}, {"step": 4, "loss": 2.8},
        {"step": 4, "eval_loss": 3.1})))
    figures = []
    close = plt.close
    monkeypatch.setattr(plt, "close", lambda fig=None: figures.append(fig) or close(fig))  # seen as it is closed
    plot_losses(metrics, plot)
    assert plot.read_bytes().startswith(b"\x89PNG")
    lines = {line.get_label(): line.get_xydata().tolist() for line in figures[0].axes[0].get_lines()}
    assert lines == {"loss": [[1, 4.0], [2, 3.5], [4, 2.8]], "eval loss": [[2, 3.6], [4, 3.1]]}
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no temporary file left
