"""The two writers every stage's results go through (runs.py): a failure midway leaves what was there before and no
temporary file behind, so an interrupted stage never leaves a file or folder that looks finished."""

from __future__ import annotations

from pathlib import Path

import pytest

from gemmaforge.runs import atomic_dir, atomic_write_text


def test_a_text_write_that_fails_midway_keeps_the_old_file(tmp_path: Path) -> None:
    path = tmp_path / "manifest.json"
    atomic_write_text(path, "old\n")
    with pytest.raises(UnicodeEncodeError):
        atomic_write_text(path, "new " * 1000 + "\ud800")  # a lone surrogate: fails after the first bytes
    assert path.read_text() == "old\n" and [p.name for p in tmp_path.iterdir()] == ["manifest.json"]
    atomic_write_text(path, "new\n")
    assert path.read_text() == "new\n" and [p.name for p in tmp_path.iterdir()] == ["manifest.json"]


def test_a_folder_filled_halfway_never_replaces_the_finished_one(tmp_path: Path) -> None:
    merged = tmp_path / "merged"
    with atomic_dir(merged) as tmp:
        (tmp / "model.safetensors").write_text("v1")
    with pytest.raises(KeyboardInterrupt), atomic_dir(merged) as tmp:
        (tmp / "model.safetensors").write_text("v2 half")
        assert (merged / "model.safetensors").read_text() == "v1"  # the finished one stays while the new is written
        raise KeyboardInterrupt
    assert [p.name for p in tmp_path.iterdir()] == ["merged"]
    assert [p.name for p in merged.iterdir()] == ["model.safetensors"]
    assert (merged / "model.safetensors").read_text() == "v1"
    with atomic_dir(merged) as tmp:
        (tmp / "config.json").write_text("{}")
    assert [p.name for p in merged.iterdir()] == ["config.json"]  # replaced whole, not merged into
