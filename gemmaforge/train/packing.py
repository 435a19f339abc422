"""Packing: several examples per row of cutoff_len tokens, none attending to another.

Each example keeps its own position ids (0, 1, 2, ... restarting at every example), the batch has no attention
mask, and the collator hands every row's example lengths along (train/segments.py): the packed attention
(train/packed_attention.py) attends within each example, so a packed row computes exactly what the examples
would compute alone, without the padding a batch of unequal lengths carries.
"""

from __future__ import annotations

from typing import Any

import torch

from gemmaforge.chat.conversation import IGNORE_INDEX
from gemmaforge.train.collate import with_counts
from gemmaforge.train.segments import PackedSegments

Example = dict[str, list[int]]


def pack_examples(examples: list[Example], cutoff_len: int) -> list[Example]:
    """First-fit decreasing into rows of at most cutoff_len tokens (examples are already truncated to
    it). Each row holds input_ids, labels, position_ids, the examples' lengths and how many examples it packs."""
    order = sorted(range(len(examples)), key=lambda i: len(examples[i]["input_ids"]), reverse=True)
    rows: list[Example] = []
    free: list[int] = []  # room left in each row
    for i in order:
        n = len(examples[i]["input_ids"])
        row = next((r for r, room in enumerate(free) if room >= n), None)
        if row is None:
            rows.append({"input_ids": [], "labels": [], "position_ids": [], "lengths": [], "examples": [0]})
            free.append(cutoff_len)
            row = len(rows) - 1
        rows[row]["input_ids"] += examples[i]["input_ids"]
        rows[row]["labels"] += examples[i]["labels"]
        rows[row]["position_ids"] += list(range(n))
        rows[row]["lengths"].append(n)
        rows[row]["examples"][0] += 1
        free[row] -= n
    return rows


class PackedCollator:
    """Right-pads packed rows to the longest; padding gets position ids of its own segment (0, 1, ...)
    so it forms a separate block that no real token attends to, and labels IGNORE_INDEX. The batch carries its
    segments, measured here on the host."""

    def __init__(self, pad_token_id: int):
        self.pad_token_id = pad_token_id

    def __call__(self, batch: list[Example]) -> dict[str, Any]:
        width = max(len(row["input_ids"]) for row in batch)
        input_ids = torch.full((len(batch), width), self.pad_token_id, dtype=torch.long)  # (B, T)
        labels = torch.full((len(batch), width), IGNORE_INDEX, dtype=torch.long)
        position_ids = torch.arange(width).repeat(len(batch), 1)
        for b, row in enumerate(batch):
            n = len(row["input_ids"])
            input_ids[b, :n] = torch.tensor(row["input_ids"])
            labels[b, :n] = torch.tensor(row["labels"])
            position_ids[b, :n] = torch.tensor(row["position_ids"])
            position_ids[b, n:] = torch.arange(width - n)
        segments = PackedSegments.of_rows([row["lengths"] for row in batch], width)
        examples = sum(row["examples"][0] for row in batch)  # for samples/s: a row packs several
        return with_counts({"input_ids": input_ids, "labels": labels, "position_ids": position_ids,
                            "segments": segments}, examples, self.pad_token_id)
