"""Tokenized examples and right-padded batches."""

from __future__ import annotations

from typing import Any

import torch

from gemmaforge.families import Family
from gemmaforge.templates import IGNORE_INDEX, Message, check_roles, encode_for_training


def tokenize_conversations(
    conversations: list[list[Message]],
    tokenizer: Any,
    family: Family,
    cutoff_len: int,
    source: str,
    *,
    train_on_prompt: bool = False,
    mask_history: bool = False,
) -> tuple[list[dict[str, list[int]]], int]:
    """Encoded examples, and how many were dropped because truncation left no supervised token."""
    examples, dropped = [], 0
    for i, messages in enumerate(conversations):
        check_roles(messages, f"{source} line {i + 1}", require_answer=True)
        ids, labels = encode_for_training(
            messages, tokenizer, family, cutoff_len, train_on_prompt=train_on_prompt, mask_history=mask_history
        )
        if all(label == IGNORE_INDEX for label in labels):
            dropped += 1
            continue
        examples.append({"input_ids": ids, "labels": labels})
    return examples, dropped


class RightPadCollator:
    """Pad on the right with the tokenizer's own pad id (Gemma's <pad>, never eos: a collator that
    masks every pad-equal label would then hide the end token); padded labels are ignored."""

    def __init__(self, pad_token_id: int):
        self.pad_token_id = pad_token_id

    def __call__(self, batch: list[dict[str, list[int]]]) -> dict[str, torch.Tensor]:
        width = max(len(ex["input_ids"]) for ex in batch)
        input_ids = torch.full((len(batch), width), self.pad_token_id, dtype=torch.long)  # (B, T)
        labels = torch.full((len(batch), width), IGNORE_INDEX, dtype=torch.long)
        attention_mask = torch.zeros((len(batch), width), dtype=torch.long)
        for row, ex in enumerate(batch):
            n = len(ex["input_ids"])
            input_ids[row, :n] = torch.tensor(ex["input_ids"])
            labels[row, :n] = torch.tensor(ex["labels"])
            attention_mask[row, :n] = 1
        return {"input_ids": input_ids, "labels": labels, "attention_mask": attention_mask}
