"""The data stage: read, convert to messages, split, and write data/{train,val}.jsonl + stats.json."""

from __future__ import annotations

import hashlib
import json
import random
from pathlib import Path
from typing import Any

from gemmaforge.config import DataConfig
from gemmaforge.console import console
from gemmaforge.data.readers import alpaca_to_messages, detect_format, read_records
from gemmaforge.errors import UserError
from gemmaforge.runs import atomic_write_text
from gemmaforge.templates import Message


def load_conversations(config: DataConfig) -> tuple[list[list[Message]], str]:
    """All records of the dataset as message lists, and the format used."""
    path = Path(config.path)
    conversations: list[list[Message]] = []
    fmt = config.format
    for where, record in read_records(path):
        if fmt == "auto":
            fmt = detect_format(record, where)
            console.print(f"[bold]gemmaforge[/]: {path}: detected format '{fmt}'")
        conversations.append(alpaca_to_messages(record, where, system=config.system))
    if not conversations:
        raise UserError(f"{path}: no records; expected a JSON array or JSON Lines of records")
    return conversations, fmt


def split(items: list[Any], val_size: float, seed: int) -> tuple[list[Any], list[Any]]:
    """Seeded shuffle, then the last `val_size` (ratio < 1, or count >= 1) go to validation."""
    n_val = int(val_size) if val_size >= 1 else int(round(len(items) * val_size))
    if n_val >= len(items):
        raise UserError(f"data.val_size={val_size} leaves no training examples out of {len(items)}")
    order = list(range(len(items)))
    random.Random(seed).shuffle(order)
    shuffled = [items[i] for i in order]
    return shuffled[: len(items) - n_val], shuffled[len(items) - n_val :]


def prepare_data(config: DataConfig, seed: int, out_dir: Path) -> dict[str, Any]:
    """Write train.jsonl, val.jsonl and stats.json into out_dir; return the stats (with hashes)."""
    conversations, fmt = load_conversations(config)
    train, val = split(conversations, config.val_size, seed)
    texts = {name: _jsonl(rows) for name, rows in (("train", train), ("val", val))}
    stats = {
        "source": str(config.path),
        "source_sha256": hashlib.sha256(Path(config.path).read_bytes()).hexdigest(),
        "format": fmt,
        "records": len(conversations),
        "train": len(train),
        "val": len(val),
        "train_sha256": hashlib.sha256(texts["train"].encode()).hexdigest(),
        "val_sha256": hashlib.sha256(texts["val"].encode()).hexdigest(),
    }
    # stats.json last: its presence marks a complete data stage.
    for name, text in texts.items():
        atomic_write_text(out_dir / f"{name}.jsonl", text)
    atomic_write_text(out_dir / "stats.json", json.dumps(stats, indent=2, ensure_ascii=False) + "\n")
    return stats


def read_prepared(path: Path) -> list[list[Message]]:
    return [json.loads(line)["messages"] for line in path.read_text(encoding="utf-8").splitlines() if line]


def _jsonl(conversations: list[list[Message]]) -> str:
    return "".join(json.dumps({"messages": m}, ensure_ascii=False) + "\n" for m in conversations)
