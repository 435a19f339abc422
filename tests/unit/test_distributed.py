"""Several ranks (README, "Several GPUs and machines"): rank 0 alone prepares the data while the others
wait at the barrier, and ranks that finish with different adapters stop the stage. Both ranks' roles are played
in this one process (RANK, WORLD_SIZE and the collective calls); tests/unit/test_training_engine.py has two real
gloo processes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gemmaforge import pipeline
from gemmaforge.cli import main
from gemmaforge.config import load_config
from gemmaforge.data import prepare
from gemmaforge.models import resolve_model
from gemmaforge.recipe import trainer
from gemmaforge.runs import RunDir
from tests.helpers import write_config


def test_rank_0_alone_prepares_the_data(tmp_path: Path, tiny_gemma3_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    events: list[str] = []
    prepare_data = prepare.prepare_data

    def recorded_prepare(*args, **kwargs):
        events.append("prepare")
        return prepare_data(*args, **kwargs)

    monkeypatch.setattr(prepare, "prepare_data", recorded_prepare)
    monkeypatch.setattr(pipeline, "barrier", lambda: events.append("barrier"))
    config = load_config(write_config(tmp_path, tiny_gemma3_dir))
    base = resolve_model(str(tiny_gemma3_dir), tmp_path / "home")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    run = RunDir.create(config)
    pipeline.stage_data(run, config, base)
    assert events == ["barrier"]  # waits for rank 0's files, then reads them
    assert not run.data_dir.exists() and not run.manifest_path.exists() and not run.config_path.exists()
    monkeypatch.setenv("RANK", "0")
    events.clear()
    run = RunDir.create(config)
    pipeline.stage_data(run, config, base)
    assert events == ["prepare", "barrier"]  # the others are released once the files are written
    assert (run.data_dir / "train.jsonl").is_file() and (run.data_dir / "val.jsonl").is_file()
    assert json.loads(run.manifest_path.read_text())["stages"]["data"]["status"] == "done"


@pytest.mark.slow
def test_ranks_with_different_adapters_stop_the_stage(tmp_path: Path, tiny_gemma3_dir: Path,
                                                       monkeypatch: pytest.MonkeyPatch,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    """Another rank's adapter checksum that differs from this one's (as unsynchronised gradients give) fails the
    stage before anything is saved."""
    gathered = []

    def two_ranks(value: object) -> list[object]:
        gathered.append(value)
        return [value, "0123456789abcdef"] if isinstance(value, str) else [value]

    monkeypatch.setattr(trainer, "gather", two_ranks)
    config = write_config(tmp_path, tiny_gemma3_dir, max_steps=1, save_steps=100, eval_strategy="no")
    assert main(["train", str(config)]) == 1
    checksum = gathered[0]
    assert isinstance(checksum, str) and len(checksum) == 16
    assert f"the 2 ranks finished with different adapters (['{checksum}', '0123456789abcdef'])" in \
        " ".join(capsys.readouterr().err.split())
    assert not (tmp_path / "run" / "adapter").exists()
    record = json.loads((tmp_path / "run" / "manifest.json").read_text())["stages"]["train"]
    assert record["status"] == "failed"
