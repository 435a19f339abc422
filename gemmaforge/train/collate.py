"""Tokenized examples and right-padded batches; an example's images and clips go in as the checkpoint's processor
puts them (vision.py, audio.py), and their pixels and audio features are made per batch."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from gemmaforge.chat.conversation import IGNORE_INDEX, Message, check_roles, supervised_labels
from gemmaforge.errors import UserError
from gemmaforge.families import Family
from gemmaforge.intake import decode_picture, decode_sound, picture_sizes
from gemmaforge.media import merged_token_types
from gemmaforge.senses import NO_SENSES, Senses


def tokenize_conversations(
    conversations: list[list[Message]],
    tokenizer: Any,
    family: Family,
    cutoff_len: int,
    source: str,
    *,
    train_on_prompt: bool = False,
    mask_history: bool = False,
    images: list[list[Path]] | None = None,
    audios: list[list[Path]] | None = None,
    senses: Senses = NO_SENSES,
) -> tuple[list[dict[str, Any]], int]:
    """Encoded examples, and how many were dropped because truncation left no supervised token (or cut into an
    image or a clip). `images`, `audios`: each conversation's media, expanded by `senses` as the checkpoint's
    processor does."""
    examples, dropped = [], 0
    for i, messages in enumerate(conversations):
        check_roles(messages, f"{source} line {i + 1}", require_answer=True)
        pictures, clips = images[i] if images else [], audios[i] if audios else []
        if pictures or clips:
            missing = ("images", senses.vision) if pictures and senses.vision is None else \
                ("sound", senses.audio) if clips and senses.audio is None else None
            if missing:
                raise UserError(f"{source} line {i + 1} has {missing[0]}, and the model reads none")
            _, whole, labels, _ = encode_with_media(messages, pictures, clips, senses, tokenizer, family,
                                                    train_on_prompt=train_on_prompt, mask_history=mask_history)
            ids, labels = whole[:cutoff_len], labels[:cutoff_len]
            media_ids = senses.media_token_ids(tokenizer)
            if sum(t in media_ids for t in ids) != sum(t in media_ids for t in whole):
                ids = []  # the cutoff cuts into a medium: its features would not line up with its tokens
        else:
            ids, labels = family.chat.encode(
                messages, tokenizer, cutoff_len, train_on_prompt=train_on_prompt, mask_history=mask_history
            )
        if not ids or all(label == IGNORE_INDEX for label in labels):
            dropped += 1
            continue
        example: dict[str, Any] = {"input_ids": ids, "labels": labels}
        if pictures:
            example["images"] = [str(p) for p in pictures]
        if clips:
            example["audios"] = [str(p) for p in clips]
        examples.append(example)
    return examples, dropped


def encode_with_media(messages: list[Message], pictures: list[Path], clips: list[Path], senses: Senses,
                      tokenizer: Any, family: Family, **options: bool
                      ) -> tuple[str, list[int], list[int], list[tuple[int, int]]]:
    """(text, ids, labels, offsets) of a conversation with each picture's and clip's tokens in place of its marker,
    as the checkpoint's processor writes them; media tokens are never supervised. Untruncated."""
    rendered = family.chat.render(messages, **options)
    samples = [len(_clip(path, senses)) for path in clips]
    expanded = senses.expand(rendered, picture_sizes(pictures), samples)
    text = expanded.text
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids, offsets = enc["input_ids"], [tuple(o) for o in enc["offset_mapping"]]
    media_ids = senses.media_token_ids(tokenizer)
    labels = [IGNORE_INDEX if token in media_ids else label
              for token, label in zip(ids, supervised_labels(ids, offsets, expanded.supervised))]
    return text, ids, labels, offsets


def _clip(path: Path | str, senses: Senses) -> Any:
    """A prepared clip's samples at the model's audio rate (the intake decodes it as prepare did)."""
    assert senses.audio is not None  # the callers refuse sound for a model without an AudioPrompt
    return decode_sound(Path(path).read_bytes(), str(path), senses.audio.rate, senses.audio.max_seconds)


class MediaBatches:
    """Wraps a collator: a batch whose examples have images gets their pixels (the image processor's inputs, in
    the order of the images' tokens), one with clips their features (the feature extractor's), and the token types
    that mark their tokens."""

    def __init__(self, collator: Any, senses: Senses):
        self.collator, self.senses = collator, senses

    def __call__(self, batch: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        paths = [path for example in batch for path in example.get("images", ())]
        clips = [path for example in batch for path in example.get("audios", ())]
        out = self.collator([{k: v for k, v in example.items() if k not in ("images", "audios")} for example in batch])
        types = []
        if paths:
            assert self.senses.vision is not None  # tokenize_conversations refuses images without it
            out.update(self.senses.vision.pixel_inputs([decode_picture(Path(p).read_bytes(), p) for p in paths]))
            types.append(self.senses.vision.token_types(out["input_ids"]))
        if clips:
            assert self.senses.audio is not None
            out.update(self.senses.audio.features([_clip(p, self.senses) for p in clips]))
            types.append(self.senses.audio.token_types(out["input_ids"]))
        out.update(merged_token_types(*types))
        return out


@dataclass(frozen=True)
class BatchCounts:
    """What the trainer logs about a batch, counted by the collator on the host: read back from the device once
    the batch is there, each count would stop the host until the GPU caught up, at every step."""

    examples: int
    supervised: int  # target tokens
    positions: int
    padding: int


def with_counts(batch: dict[str, Any], examples: int, pad_token_id: int) -> dict[str, Any]:
    """Add the batch's counts and `supervised_positions`: the flat (B x T) index of each position whose next token
    is supervised, so the loss gathers those hidden states without a boolean mask (whose size the device would
    have to report)."""
    labels = batch["labels"]
    keep = labels[:, 1:] != IGNORE_INDEX  # (B, T-1): position t predicts token t+1
    rows, steps = keep.nonzero(as_tuple=True)
    batch["supervised_positions"] = rows * labels.shape[1] + steps
    batch["counts"] = BatchCounts(examples, len(rows), labels.numel(), int((batch["input_ids"] == pad_token_id).sum()))
    return batch


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
        return with_counts({"input_ids": input_ids, "labels": labels, "attention_mask": attention_mask}, len(batch),
                           self.pad_token_id)
