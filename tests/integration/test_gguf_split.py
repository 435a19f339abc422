"""Split GGUF exports (llama.cpp's gguf-split layout) load in llama.cpp and compute what the whole file does."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest

from gemmaforge.config import Split
from gemmaforge.errors import UserError
from gemmaforge.export import gguf as gguf_export
from gemmaforge.export.gguf import write_gguf
from gemmaforge.gguf_file import read_gguf
from gemmaforge.gguf_names import exports_in, gguf_parts
from gemmaforge.units import parse_decimal_size

pytestmark = pytest.mark.integration
llama_cpp = pytest.importorskip("llama_cpp")

TOKENS = [2, 105, 2364, 107, 9259, 1217, 236881, 106, 107, 105, 4368, 107]
N_TENSORS = 2 + 2 * 13  # token_embd, output_norm, and 13 per layer in the tiny Gemma 3


def logits(path: Path) -> np.ndarray:
    llm = llama_cpp.Llama(model_path=str(path), n_ctx=64, n_threads=2, logits_all=True, verbose=False)
    llm.eval(TOKENS)
    return np.asarray(llm.scores[: len(TOKENS)])


def split_keys(path: Path) -> tuple[int, int, int]:
    reader = read_gguf(path)
    return tuple(int(reader.fields[k].value) for k in (gguf.Keys.Split.LLM_KV_SPLIT_NO,
                 gguf.Keys.Split.LLM_KV_SPLIT_COUNT, gguf.Keys.Split.LLM_KV_SPLIT_TENSORS_COUNT))


@pytest.mark.parametrize("quant", ["f16", "q4_k_m"])  # written by us directly; split after llama.cpp's quantizer
def test_llama_cpp_loads_the_shards_and_computes_what_the_whole_file_does(tiny_gemma3_dir: Path, tmp_path: Path,
                                                                         quant: str) -> None:
    whole = write_gguf(tiny_gemma3_dir, tmp_path / "whole" / f"model-{quant}.gguf", quant)
    first = write_gguf(tiny_gemma3_dir, tmp_path / "split" / f"model-{quant}.gguf", quant, split=Split(max_tensors=10))

    parts = gguf_parts(tmp_path / "split" / f"model-{quant}.gguf")
    assert [p.name for p in parts] == [f"model-{quant}-0000{i}-of-00003.gguf" for i in (1, 2, 3)]
    assert first == parts[0] and sorted(p.name for p in (tmp_path / "split").iterdir()) == [p.name for p in parts]
    assert [split_keys(p) for p in parts] == [(0, 3, N_TENSORS), (1, 3, N_TENSORS), (2, 3, N_TENSORS)]
    readers = [read_gguf(p) for p in parts]
    assert [len(r.tensors) for r in readers] == [10, 10, 8]
    assert gguf.Keys.Tokenizer.LIST in readers[0].fields and gguf.Keys.Tokenizer.LIST not in readers[1].fields
    tensors = {t.name: np.asarray(t.data) for r in readers for t in r.tensors}  # every tensor byte for byte
    assert all(np.array_equal(tensors[t.name], np.asarray(t.data)) for t in read_gguf(whole).tensors)
    assert np.array_equal(logits(first), logits(whole))


def test_split_by_size_keeps_every_shard_under_the_limit(tiny_gemma3_dir: Path, tmp_path: Path) -> None:
    embedding = 262144 * 64 * 2  # the largest tensor (f16): alone in its shard, as llama.cpp's converter does
    first = write_gguf(tiny_gemma3_dir, tmp_path / "m.gguf", "f16", split=Split(max_bytes=100_000))
    parts = gguf_parts(tmp_path / "m.gguf")
    assert len(parts) >= 3 and first == parts[0]
    data_bytes = [sum(t.n_bytes for t in read_gguf(p).tensors) for p in parts]
    assert all(b <= 100_000 or b == embedding for b in data_bytes)
    assert len(llama_cpp.Llama(model_path=str(first), n_ctx=32, verbose=False).tokenize(b"hi")) > 0


def test_a_model_that_fits_one_shard_stays_one_file(tiny_gemma3_dir: Path, tmp_path: Path) -> None:
    path = write_gguf(tiny_gemma3_dir, tmp_path / "m.gguf", "q8_0", split=Split(max_bytes=parse_decimal_size("2G")))
    assert path == tmp_path / "m.gguf" and [p.name for p in tmp_path.iterdir()] == ["m.gguf"]
    assert gguf.Keys.Split.LLM_KV_SPLIT_COUNT not in read_gguf(path).fields


def test_a_new_export_replaces_the_old_one_whole_or_split(tiny_gemma3_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "model-f16.gguf"
    write_gguf(tiny_gemma3_dir, out, "f16")
    write_gguf(tiny_gemma3_dir, out, "f16", split=Split(max_tensors=20))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model-f16-00001-of-00002.gguf",
                                                          "model-f16-00002-of-00002.gguf"]
    write_gguf(tiny_gemma3_dir, out, "f16", split=Split(max_tensors=10))
    assert len(gguf_parts(out)) == 3 and len(list(tmp_path.iterdir())) == 3  # no shard of the 2-way split left
    write_gguf(tiny_gemma3_dir, out, "f16")
    assert [p.name for p in tmp_path.iterdir()] == ["model-f16.gguf"]
    assert list(exports_in(tmp_path, "model-")) == ["f16"]


def test_a_failed_split_write_leaves_the_earlier_export_alone(tiny_gemma3_dir: Path, tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    out = tmp_path / "model-f16.gguf"
    write_gguf(tiny_gemma3_dir, out, "f16", split=Split(max_tensors=10))
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    original = gguf_export.gguf.GGUFWriter.write_tensor_data
    calls = []

    def fail_in_the_second_shard(self, tensor, *args, **kwargs):
        calls.append(1)
        if len(calls) == 15:
            raise OSError("disk full")
        return original(self, tensor, *args, **kwargs)

    monkeypatch.setattr(gguf_export.gguf.GGUFWriter, "write_tensor_data", fail_in_the_second_shard)
    with pytest.raises(OSError, match="disk full"):
        write_gguf(tiny_gemma3_dir, out, "f16", split=Split(max_tensors=5))
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before  # nothing half-written, nothing lost


def test_an_incomplete_set_of_shards_is_named(tiny_gemma3_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "model-f16.gguf"
    write_gguf(tiny_gemma3_dir, out, "f16", split=Split(max_tensors=10))
    (tmp_path / "model-f16-00002-of-00003.gguf").unlink()
    with pytest.raises(UserError, match="an incomplete or mixed set of shards for model-f16.gguf: "
                       "model-f16-00001-of-00003.gguf, model-f16-00003-of-00003.gguf"):
        gguf_parts(out)


@pytest.mark.parametrize(("text", "size"), [("2G", 2 * 10**9), ("500M", 5 * 10**8), ("1.5k", 1500), ("300", 300),
                                            ("4GB", 4 * 10**9), ("1T", 10**12), ("2t", 2 * 10**12)])
def test_sizes_are_read_as_llama_cpp_reads_them(text: str, size: int) -> None:
    """Decimal units, as llama.cpp's converter reads K, M and G; T (which llama.cpp's tools do not take) continues
    the same decimal series: 10^12, never 2^40."""
    assert parse_decimal_size(text) == size


@pytest.mark.parametrize("text", ["", "0", "-1G", "2X", "G", "lots"])
def test_a_bad_size_is_a_clear_error(text: str) -> None:
    with pytest.raises(UserError, match=f"split size {text!r}: expected a positive size such as 2G, 500M"):
        parse_decimal_size(text)


def test_shards_appear_first_shard_last(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """docs/export.md: a reader that finds the first shard finds the whole set, because the first shard is renamed into
    place last; the earlier whole file of that name goes once the set is there."""
    import os

    from gemmaforge.export import gguf_shards

    out = tmp_path / "model-q8_0.gguf"
    out.write_bytes(b"old whole file")
    renamed: list[str] = []

    def replace(src: Path, dst: Path) -> None:
        renamed.append(Path(dst).name)
        assert out.exists(), "the earlier export stays until the new set is complete"
        os.rename(src, dst)

    monkeypatch.setattr(gguf_shards.os, "replace", replace)
    with gguf_shards.staged_output(out) as staged:
        for n in (1, 2, 3):
            staged.with_name(f"model-q8_0-0000{n}-of-00003.gguf").write_bytes(b"shard")
    assert renamed == [f"model-q8_0-0000{n}-of-00003.gguf" for n in (3, 2, 1)]
    assert sorted(p.name for p in tmp_path.iterdir()) == renamed[::-1]  # the old whole file and staging are gone
