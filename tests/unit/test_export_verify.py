"""`export verify`'s gate: the command fails when the f16 file's top-1 agreement with the merged model is below
99%, whatever the other files score. llama.cpp's side (read_back, compare) is replaced by the agreement to test;
the merged model's side runs for real on a tiny Gemma 3."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from gemmaforge.errors import StageError
from gemmaforge.export import verify
from gemmaforge.families import FAMILIES
from gemmaforge.runs import RunDir


def run_with_exports(root: Path, merged: Path, quants: tuple[str, ...]) -> RunDir:
    """A run directory with a merged model, one val conversation and (empty) GGUF files of `quants`."""
    run = RunDir(root)
    shutil.copytree(merged, run.merged_dir)
    run.data_dir.mkdir(parents=True)
    messages = [{"role": "user", "content": "What is a flat white?"},
                {"role": "assistant", "content": "Espresso with steamed milk."}]
    (run.data_dir / "val.jsonl").write_text(json.dumps({"messages": messages}) + "\n", encoding="utf-8")
    run.gguf_dir.mkdir()
    for quant in quants:
        run.gguf_path(quant).write_bytes(b"")
    return run


@pytest.mark.parametrize(("f16_agreement", "passes"), [(0.99, True), (0.989, False)])
def test_verify_fails_when_f16_agrees_on_fewer_than_99_percent_of_positions(
        tiny_gemma3_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, f16_agreement: float,
        passes: bool) -> None:
    """0.99 passes and 0.989 raises StageError naming the f16 file; q4_0 at 50% never fails the command."""
    agreement = {"model-f16.gguf": f16_agreement, "model-q4_0.gguf": 0.5}

    def compare(path: Path, sequences: list[list[int]], reference: list[Any]) -> dict[str, float]:
        assert len(sequences) == len(reference) == 1 and reference[0].shape[0] == len(sequences[0])
        return {"top1_agreement": agreement[path.name], "mean_kl": 0.0}

    monkeypatch.setattr(verify, "read_back", lambda parts: {})
    monkeypatch.setattr(verify, "compare", compare)
    run = run_with_exports(tmp_path / "run", tiny_gemma3_dir, ("f16", "q4_0"))
    if passes:
        report = verify.verify_run(run, FAMILIES["gemma3"])
        assert report["files"]["f16"]["top1_agreement"] == 0.99
    else:
        with pytest.raises(StageError, match=r"model-f16\.gguf: top-1 agreement with the merged model is 98\.90%, "
                                             r"below 99%"):
            verify.verify_run(run, FAMILIES["gemma3"])
    written = json.loads((run.gguf_dir / "verify.json").read_text())  # the report is written either way
    assert written["files"]["q4_0"]["top1_agreement"] == 0.5
