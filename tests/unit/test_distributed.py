"""Several ranks (docs/several-gpus.md): rank 0 alone prepares the data while the others wait at the barrier, and ranks
that finish with different adapters stop the stage. Both ranks' roles are played in this one process (RANK, WORLD_SIZE
and the collective calls); tests/unit/test_training_engine.py has two real gloo processes."""

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


@pytest.mark.parametrize(("rank", "local_rank", "shared", "writes"), [
    (0, 0, True, True), (1, 0, True, False), (1, 1, True, False),  # one run directory for both nodes: rank 0
    (0, 0, False, True), (1, 0, False, True), (1, 1, False, False),  # one per node: each node's first process
])
def test_who_writes_the_run_directory_follows_what_the_nodes_share(rank: int, local_rank: int, shared: bool,
                                                                   writes: bool, tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """Two nodes, two processes each: the writer follows what RunDir.create probed, held by that RunDir (not by a
    module-level switch that another run in the same process would inherit)."""
    from gemmaforge import runs

    config = load_config(write_config(tmp_path, tmp_path))
    monkeypatch.setattr(runs, "node_count", lambda: 2)
    monkeypatch.setattr(runs.RunDir, "shared_between_nodes", lambda self: shared)
    monkeypatch.setenv("RANK", str(rank))
    monkeypatch.setenv("LOCAL_RANK", str(local_rank))
    run = RunDir.create(config)
    assert (run.per_node, run.writes, run.config_path.is_file()) == (not shared, writes, writes)
    assert RunDir(run.root).writes == (rank == 0)  # opened alone (a later verb): rank 0 writes, as before


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
