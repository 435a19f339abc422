"""A BPE tokenizer's merges as the GGUF file carries them (gemmaforge/export/gguf_vocab.bpe_merges): what the gguf
package's own reader (`SpecialVocab(load_merges=True)`, through which llama.cpp's converter writes Gemma 4) gives."""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import pytest

from gemmaforge.errors import UserError
from gemmaforge.export.gguf_vocab import bpe_merges
from tests.checkpoint_kinds import write_gemma4_tokenizer


def test_gemma4s_merges_are_the_gguf_packages(tmp_path: Path, embedded_model) -> None:
    folder = write_gemma4_tokenizer(tmp_path, embedded_model.path)
    merges = bpe_merges(folder)
    assert len(merges) > 500_000 and merges == gguf.SpecialVocab(folder, load_merges=True).merges


@pytest.mark.parametrize("merges", [["a b", "ab c"], [["a", "b"], [" a", "b c"], ["x", " "]]], ids=["strings", "pairs"])
def test_both_forms_and_spaces_inside_a_part_as_the_gguf_package_writes_them(merges: list, tmp_path: Path) -> None:
    (tmp_path / "tokenizer.json").write_text(json.dumps({"model": {"type": "BPE", "merges": merges}}))
    assert bpe_merges(tmp_path) == gguf.SpecialVocab(tmp_path, load_merges=True).merges


def test_merges_of_another_form_are_refused_naming_the_file(tmp_path: Path) -> None:
    (tmp_path / "tokenizer.json").write_text(json.dumps({"model": {"type": "BPE", "merges": [["a", "b", "c"]]}}))
    with pytest.raises(UserError, match=r"tokenizer\.json: model\.merges holds neither"):
        bpe_merges(tmp_path)
