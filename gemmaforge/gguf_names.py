"""Which files make up a GGUF export, by their names: one whole file, or the shards of llama.cpp's `gguf-split`
layout (`model-f16-00001-of-00003.gguf` ...). Writing them is export's (export/gguf_shards.py)."""

from __future__ import annotations

import re
from pathlib import Path

from gemmaforge.errors import UserError

# gguf's SHARD_NAME_FORMAT ("{:s}-{:05d}-of-{:05d}.gguf"), matched and written without importing gguf (and
# numpy) when the config and CLI load: only writing and reading files needs the package.
_SHARD = re.compile(r"^(?P<stem>.+)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$")


def shard_name(path: Path, number: int, count: int) -> Path:
    return path.with_name(f"{path.stem}-{number:05d}-of-{count:05d}.gguf")


def gguf_parts(path: Path) -> list[Path]:
    """The files an export named `path` consists of: [path] when it was written whole, its shards in order
    when it was split, [] when neither exists."""
    if path.is_file():
        return [path]
    shards = shards_of(path)
    if not shards:
        return []
    count = len(shards)
    expected = [shard_name(path, n, count) for n in range(1, count + 1)]
    if shards != expected:
        names = ", ".join(p.name for p in shards)
        raise UserError(f"{path.parent}: an incomplete or mixed set of shards for {path.name}: {names}")
    return shards


def shard_set(path: Path) -> list[Path]:
    """Every file of the export that `path` (a whole file, or the first shard llama.cpp opens) belongs to."""
    m = _SHARD.match(path.name)
    return gguf_parts(path.with_name(f"{m['stem']}.gguf")) if m else [path]


def exports_in(folder: Path, prefix: str) -> dict[str, list[Path]]:
    """Every export in `folder` whose name starts with `prefix` (whole or split), by the rest of its
    name: {"f16": [model-f16.gguf], "q8_0": [model-q8_0-00001-of-00002.gguf, ...]} for prefix "model-"."""
    if not folder.is_dir():
        return {}
    stems = set()
    for p in folder.glob(f"{prefix}*.gguf"):
        m = _SHARD.match(p.name)
        stems.add(m["stem"] if m else p.stem)
    return {stem.removeprefix(prefix): gguf_parts(folder / f"{stem}.gguf") for stem in sorted(stems)}


def shards_of(path: Path) -> list[Path]:
    if not path.parent.is_dir():
        return []
    found = []
    for p in path.parent.iterdir():
        m = _SHARD.match(p.name)
        if m and m["stem"] == path.stem:
            found.append(p)
    return sorted(found)
