"""Reading GGUF files: every key and every tensor's place, without copying the tensors.

The gguf package's GGUFReader makes a numpy view for each part of each value, which for a Gemma vocabulary
(262,144 token strings, and Gemma 4's 500,000 merges) takes 20-35 s per file; reading the same header with
struct here takes well under a second, and the tensors are views of one memory map as there.
The format: https://github.com/ggml-org/ggml/blob/master/docs/gguf.md (little-endian files, versions 2 and 3).
"""

from __future__ import annotations

import contextlib
import mmap
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf.constants import GGML_QUANT_SIZES, GGUF_DEFAULT_ALIGNMENT, GGUF_MAGIC, GGMLQuantizationType, GGUFValueType
from gguf.quants import quant_shape_to_byte_shape

_SCALARS: dict[GGUFValueType, str] = {
    GGUFValueType.UINT8: "B", GGUFValueType.INT8: "b", GGUFValueType.UINT16: "H", GGUFValueType.INT16: "h",
    GGUFValueType.UINT32: "I", GGUFValueType.INT32: "i", GGUFValueType.FLOAT32: "f", GGUFValueType.BOOL: "?",
    GGUFValueType.UINT64: "Q", GGUFValueType.INT64: "q", GGUFValueType.FLOAT64: "d",
}
# tensor types stored as plain numbers; the rest (quantized, bf16) are returned as their bytes
_PLAIN: dict[GGMLQuantizationType, type[np.generic]] = {
    GGMLQuantizationType.F32: np.float32, GGMLQuantizationType.F16: np.float16, GGMLQuantizationType.F64: np.float64,
    GGMLQuantizationType.I8: np.int8, GGMLQuantizationType.I16: np.int16, GGMLQuantizationType.I32: np.int32,
    GGMLQuantizationType.I64: np.int64,
}


class GGUFFormatError(ValueError):
    """The file is not a GGUF file this reader understands; the message names the file and the offset."""


@dataclass(frozen=True)
class Field:
    """One key's decoded value (a Python scalar, str or list) and its GGUF types (`item_type` for arrays)."""

    value: Any
    type: GGUFValueType
    item_type: GGUFValueType | None = None


@dataclass(frozen=True)
class Tensor:
    """One tensor: `shape` in GGUF order (columns first), `data` a read-only view shaped in numpy order, in bytes
    for the quantized types and bf16 (as the gguf package gives it)."""

    name: str
    tensor_type: GGMLQuantizationType
    shape: tuple[int, ...]
    n_elements: int
    n_bytes: int
    data_offset: int
    data: np.ndarray


@dataclass(frozen=True)
class GGUFFile:
    path: Path
    version: int
    fields: dict[str, Field]
    tensors: list[Tensor]
    alignment: int
    data_offset: int

    def value(self, key: str) -> Any:
        return self.fields[key].value


class _Cursor:
    def __init__(self, path: Path, buffer: mmap.mmap) -> None:
        self.path, self.buffer, self.offset = path, buffer, 0

    def unpack(self, fmt: str) -> Any:
        size = struct.calcsize("<" + fmt)
        if self.offset + size > len(self.buffer):
            raise GGUFFormatError(f"{self.path}: truncated at byte {self.offset}")
        (value,) = struct.unpack_from("<" + fmt, self.buffer, self.offset)
        self.offset += size
        return value

    def string(self) -> str:
        length = self.unpack("Q")
        start = self.offset
        self.offset += length
        if self.offset > len(self.buffer):
            raise GGUFFormatError(f"{self.path}: a string at byte {start} runs past the end of the file")
        try:
            return self.buffer[start:self.offset].decode("utf-8")
        except UnicodeDecodeError as e:
            raise GGUFFormatError(f"{self.path}: the string at byte {start} is not UTF-8 ({e.reason})") from None

    def value_type(self) -> GGUFValueType:
        at, raw = self.offset, self.unpack("I")
        try:
            return GGUFValueType(raw)
        except ValueError:
            raise GGUFFormatError(f"{self.path}: unknown value type {raw} at byte {at}") from None

    def value(self, kind: GGUFValueType) -> Any:
        if kind == GGUFValueType.STRING:
            return self.string()
        if kind in _SCALARS:
            return self.unpack(_SCALARS[kind])
        raise GGUFFormatError(f"{self.path}: nested arrays are not GGUF metadata (byte {self.offset})")

    def array(self) -> tuple[list[Any], GGUFValueType]:
        item_type, count = self.value_type(), self.unpack("Q")
        if item_type in _SCALARS:  # numbers in one go: np.frombuffer, then Python values
            dtype = np.dtype("<" + _SCALARS[item_type])
            end = self.offset + dtype.itemsize * count
            if end > len(self.buffer):
                raise GGUFFormatError(f"{self.path}: an array at byte {self.offset} runs past the end of the file")
            values = np.frombuffer(self.buffer, dtype, count, self.offset).tolist()
            self.offset = end
            return values, item_type
        return [self.value(item_type) for _ in range(count)], item_type


def read_gguf(path: Path | str) -> GGUFFile:
    """Every key and tensor of the GGUF file at `path` (one shard of a split file is a GGUF file of its own)."""
    path = Path(path)
    with open(path, "rb") as f:
        if path.stat().st_size == 0:
            raise GGUFFormatError(f"{path}: empty file")
        buffer = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    cursor = _Cursor(path, buffer)
    if len(buffer) < 24 or cursor.unpack("I") != GGUF_MAGIC:
        raise GGUFFormatError(f"{path}: not a GGUF file (no GGUF magic at byte 0)")
    version = cursor.unpack("I")
    if version not in (2, 3):
        raise GGUFFormatError(f"{path}: GGUF version {version} (this reader reads 2 and 3, little-endian)")
    tensor_count, kv_count = cursor.unpack("Q"), cursor.unpack("Q")
    fields: dict[str, Field] = {}
    for _ in range(kv_count):
        at, key, kind = cursor.offset, cursor.string(), cursor.value_type()
        if key in fields:
            raise GGUFFormatError(f"{path}: key {key!r} appears twice (again at byte {at})")
        if kind == GGUFValueType.ARRAY:
            values, item_type = cursor.array()
            fields[key] = Field(values, kind, item_type)
        else:
            fields[key] = Field(cursor.value(kind), kind)
    infos = [_tensor_info(cursor) for _ in range(tensor_count)]
    alignment = fields["general.alignment"].value if "general.alignment" in fields else GGUF_DEFAULT_ALIGNMENT
    if alignment <= 0 or alignment & (alignment - 1):
        raise GGUFFormatError(f"{path}: general.alignment is {alignment}, not a power of two")
    data_offset = -(-cursor.offset // alignment) * alignment
    tensors, names = [], set()
    for name, shape, tensor_type, offset in infos:
        if name in names:
            raise GGUFFormatError(f"{path}: tensor {name!r} appears twice")
        names.add(name)
        tensors.append(_tensor(path, buffer, name, shape, tensor_type, data_offset + offset))
    return GGUFFile(path, version, fields, tensors, alignment, data_offset)


def _tensor_info(cursor: _Cursor) -> tuple[str, tuple[int, ...], GGMLQuantizationType, int]:
    name, n_dims = cursor.string(), cursor.unpack("I")
    shape = tuple(cursor.unpack("Q") for _ in range(n_dims))
    at, raw = cursor.offset, cursor.unpack("I")
    try:
        tensor_type = GGMLQuantizationType(raw)
    except ValueError:
        raise GGUFFormatError(f"{cursor.path}: tensor {name!r} has unknown type {raw} (byte {at})") from None
    return name, shape, tensor_type, cursor.unpack("Q")


def _tensor(path: Path, buffer: mmap.mmap, name: str, shape: tuple[int, ...], tensor_type: GGMLQuantizationType,
            offset: int) -> Tensor:
    n_elements = int(np.prod(shape, dtype=np.int64))
    block, size = GGML_QUANT_SIZES[tensor_type]
    n_bytes = n_elements * size // block
    if offset + n_bytes > len(buffer):
        raise GGUFFormatError(f"{path}: tensor {name!r} ({n_bytes} bytes at byte {offset}) runs past the end "
                              f"of the file ({len(buffer)} bytes)")
    numpy_shape = tuple(reversed(shape))
    if tensor_type in _PLAIN:
        data = np.frombuffer(buffer, _PLAIN[tensor_type], n_elements, offset).reshape(numpy_shape)
    else:
        data = np.frombuffer(buffer, np.uint8, n_bytes, offset).reshape(
            quant_shape_to_byte_shape(numpy_shape, tensor_type))
    return Tensor(name, tensor_type, shape, n_elements, n_bytes, offset, data)


@dataclass(frozen=True)
class _ReaderField:
    """A key as the gguf package's GGUFReader exposes it to transformers: `parts[i]` for each i in `data`, each
    read by transformers' _gguf_parse_value with `types` (a string as its UTF-8 bytes, a number as a one-item
    sequence)."""

    parts: list[Any]
    data: range
    types: list[int]


class TransformersReader:
    """What transformers' GGUF loader (load_gguf_checkpoint) reads of a gguf.GGUFReader, read by read_gguf: `fields`
    and `tensors` (name, data, tensor_type). The gguf package's reader makes a numpy view for every part of every
    value (20-35 s for a Gemma vocabulary); this one is made in a fraction of a second."""

    def __init__(self, path: Path | str, *_args: Any, **_kwargs: Any) -> None:
        gguf = read_gguf(path)
        self.fields = {key: _reader_field(f) for key, f in gguf.fields.items()}
        self.tensors = gguf.tensors


def _reader_field(f: Field) -> _ReaderField:
    if f.type != GGUFValueType.ARRAY:
        return _ReaderField([f.value.encode() if f.type == GGUFValueType.STRING else [f.value]], range(1),
                            [int(f.type)])
    assert f.item_type is not None  # an array always has one
    parts = [v.encode() for v in f.value] if f.item_type == GGUFValueType.STRING else [[v] for v in f.value]
    return _ReaderField(parts, range(len(parts)), [int(GGUFValueType.ARRAY), int(f.item_type)])


@contextlib.contextmanager
def fast_transformers_reading() -> Iterator[None]:
    """transformers' GGUF loading (from_pretrained(..., gguf_file=...), for models and tokenizers) reads through
    TransformersReader while this lasts: it imports gguf.GGUFReader when it loads, so the package's name is what
    is swapped, and put back after."""
    import gguf

    original = gguf.GGUFReader
    gguf.GGUFReader = TransformersReader  # type: ignore[misc,assignment]
    try:
        yield
    finally:
        gguf.GGUFReader = original  # type: ignore[misc]
