"""Split GGUF output the way llama.cpp reads it (the `gguf-split` layout).

`model-f16.gguf` split three ways becomes `model-f16-00001-of-00003.gguf` ... `-00003-of-00003.gguf`:
every shard carries `split.no`, `split.count` and `split.tensors.count`, the first one all the metadata,
and llama.cpp loads the set when given the first shard. Shards are written into a hidden folder beside
the destination and moved into place first-shard-last, so a reader never finds a first shard whose
siblings are still being written.
"""

from __future__ import annotations

import os
import shutil
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

from gemmaforge.config import NO_SPLIT, Split
from gemmaforge.gguf_names import gguf_parts, shards_of

if TYPE_CHECKING:
    import gguf


@contextmanager
def staged_output(out_path: Path) -> Iterator[Path]:
    """A path inside a hidden folder beside `out_path` to write to (whole or as shards). When the body
    completes, whatever was written there replaces the earlier export of that name, whole or split;
    when it fails, nothing under `out_path`'s names changes. Not mkstemp: its 0600 mode would hide the
    file from an `ollama` user."""
    staging = out_path.with_name(f".{out_path.name}.{uuid.uuid4().hex[:12]}.tmp")
    staging.mkdir(parents=True)
    try:
        yield staging / out_path.name
        written = sorted(staging.iterdir())
        stale = ([out_path] if out_path.exists() else []) + shards_of(out_path)
        for src in reversed(written):  # the first shard last: llama.cpp opens the set through it
            os.replace(src, out_path.parent / src.name)
        for old in stale:
            if old.name not in {p.name for p in written}:
                old.unlink(missing_ok=True)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


@contextmanager
def gguf_file(out_path: Path, arch: str, split: Split = NO_SPLIT) -> Iterator[gguf.GGUFWriter]:
    """A GGUFWriter whose file (or shards, with `split`) replace `out_path` only when the body completes,
    and are removed when it fails (see staged_output)."""
    from gemmaforge.export.gguf_writer import GGUFWriter

    with staged_output(out_path) as staged:
        writer = GGUFWriter(staged, arch, split_max_size=split.max_bytes, split_max_tensors=split.max_tensors)
        try:
            yield writer
        finally:
            writer.close()


def split_gguf_file(source: Path, out_path: Path, split: Split) -> list[Path]:
    """Rewrite the single GGUF `source` as shards of `out_path` (for files made by llama.cpp's quantizer),
    copying every key and tensor byte for byte. Returns the parts written."""
    import gguf
    import numpy as np

    from gemmaforge.gguf_file import read_gguf

    reader = read_gguf(source)
    arch = reader.value(gguf.Keys.General.ARCHITECTURE)
    with gguf_file(out_path, arch, split) as writer:
        for key, field in reader.fields.items():
            if key != gguf.Keys.General.ARCHITECTURE:  # the writer adds that one itself
                writer.add_key_value(key, field.value, field.type, field.item_type)
        for t in reader.tensors:  # reader shapes are GGUF order (columns first); the writer takes numpy order
            shape = tuple(int(d) for d in reversed(t.shape))
            writer.add_tensor_info(t.name, shape, np.dtype(np.float32), t.n_bytes, raw_dtype=t.tensor_type)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        for t in reader.tensors:
            writer.write_tensor_data(np.asarray(t.data))
    return gguf_parts(out_path)
