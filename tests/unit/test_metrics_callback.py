"""metrics.jsonl gets one row per log step (rank 0 only); loss.png is drawn at each evaluation and at the end, with
both curves (README, `gemmaforge train`: "`loss.png` is redrawn at each eval")."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from gemmaforge.train.callbacks import MetricsCallback


def test_each_log_is_a_row_and_each_evaluation_redraws_the_plot(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    metrics, plot = tmp_path / "metrics.jsonl", tmp_path / "loss.png"
    callback = MetricsCallback(metrics, plot)

    def log(step: int, rank0: bool = True, **logs: float) -> None:
        monkeypatch.setenv("RANK", "0" if rank0 else "1")  # the writer of the run directory is rank 0
        callback.on_log(None, SimpleNamespace(global_step=step), None, logs=logs)

    log(1, loss=4.0, learning_rate=1e-3)
    log(2, loss=3.5)
    assert not plot.exists()  # train losses alone do not redraw it
    log(2, eval_loss=3.6)
    first = plot.read_bytes()
    assert first.startswith(b"\x89PNG")
    log(3, loss=3.0)
    log(4, loss=2.8, rank0=False)  # another rank's log: neither a row nor a plot
    log(4, eval_loss=3.1)
    assert plot.read_bytes() != first  # redrawn with the second evaluation
    log(5, train_runtime=9.0)  # the end-of-training summary is not a metrics row
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [(r["step"], r.get("loss"), r.get("eval_loss")) for r in rows] == \
        [(1, 4.0, None), (2, 3.5, None), (2, None, 3.6), (3, 3.0, None), (4, None, 3.1)]
    assert rows[0]["learning_rate"] == 1e-3
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no temporary file left
