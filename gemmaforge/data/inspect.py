"""`gemmaforge data inspect`: show exactly what the model will see: the rendered text, the tokens
that carry loss (never an image's), each image's slot with its token count, and the token lengths against
cutoff_len."""

from __future__ import annotations

import json
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table
from rich.text import Text

from gemmaforge.chat.conversation import IGNORE_INDEX, Message, supervised_labels
from gemmaforge.data.formats import Schema, detect_schema, to_messages
from gemmaforge.data.media_files import ImageFinder, SoundFinder
from gemmaforge.data.prepare import describe_lengths
from gemmaforge.data.sources import data_files, iter_records
from gemmaforge.families import Family
from gemmaforge.senses import NO_SENSES, Senses
from gemmaforge.train.collate import encode_with_media


@dataclass(frozen=True)
class Encoded:
    """One conversation as training tokenizes it (untruncated)."""

    where: str
    text: str
    ids: list[int]
    labels: list[int]
    offsets: list[tuple[int, int]]
    images: list[Path]
    audios: list[Path]


def encoded_conversations(path: Path, schema: Schema | None, system: str | None, tokenizer: Any, family: Family, *,
                          train_on_prompt: bool, mask_history: bool, senses: Senses) -> Iterator[Encoded]:
    """Each record rendered and tokenized as training does, its images and clips (found and checked) in their
    slots."""
    options = {"train_on_prompt": train_on_prompt, "mask_history": mask_history}
    with tempfile.TemporaryDirectory() as store:  # embedded media are decoded there, never into the dataset
        images, sounds = ImageFinder(Path(store)), SoundFinder(Path(store), senses.audio)
        for file in data_files(path):
            file_schema = schema
            for where, record in iter_records(file):
                if file_schema is None:
                    file_schema = detect_schema(record, where)
                messages = to_messages(record, file_schema, where, system)
                family.chat.check_features(messages, where)
                pictures = [image.path for image in images.in_record(
                    record, messages, file_schema, where, file.parent, (senses.vision, senses.no_vision),
                    family.chat.image)]
                clips = [clip.path for clip in sounds.in_record(
                    record, messages, file_schema, where, file.parent, (senses.audio, senses.no_audio),
                    family.chat.audio)]
                if not pictures and not clips:
                    yield Encoded(where, *encode(messages, tokenizer, family, **options), [], [])
                    continue
                yield Encoded(where, *encode_with_media(messages, pictures, clips, senses, tokenizer, family,
                                                        **options), pictures, clips)


def encode(
    messages: list[Message], tokenizer: Any, family: Family, *, train_on_prompt: bool, mask_history: bool
) -> tuple[str, list[int], list[int], list[tuple[int, int]]]:
    """(text, ids, labels, offsets) of one conversation, untruncated."""
    rendered = family.chat.render(messages, train_on_prompt=train_on_prompt, mask_history=mask_history)
    enc = tokenizer(rendered.text, add_special_tokens=False, return_offsets_mapping=True)
    ids, offsets = enc["input_ids"], [tuple(o) for o in enc["offset_mapping"]]
    return rendered.text, ids, supervised_labels(ids, offsets, rendered.supervised), offsets


def inspect_file(
    path: Path,
    tokenizer: Any,
    family: Family,
    *,
    schema: Schema | None,
    system: str | None,
    cutoff_len: int,
    train_on_prompt: bool,
    mask_history: bool,
    limit: int | None,
    as_json: bool,
    senses: Senses = NO_SENSES,
) -> None:
    """JSON mode: one {"text", "input_ids", "labels"} object per conversation on stdout (truncated to
    cutoff_len, as training sees it; with "images" and "audios" when it has some). Text mode: `limit` samples
    highlighted, then a length summary."""
    out = Console(file=sys.stdout, soft_wrap=True, highlight=False)
    lengths, supervised, over = [], [], 0
    slots = media_slots(tokenizer)
    encoded = encoded_conversations(path, schema, system, tokenizer, family, train_on_prompt=train_on_prompt,
                                    mask_history=mask_history, senses=senses)
    for i, e in enumerate(encoded):
        if as_json:
            if limit is not None and i >= limit:
                break
            seen = e.text if len(e.ids) <= cutoff_len else e.text[: e.offsets[cutoff_len - 1][1]]
            row: dict[str, Any] = {"text": seen, "input_ids": e.ids[:cutoff_len], "labels": e.labels[:cutoff_len]}
            if e.images:
                row["images"] = [str(p) for p in e.images]
            if e.audios:
                row["audios"] = [str(p) for p in e.audios]
            sys.stdout.write(json.dumps(row, ensure_ascii=False) + "\n")
            continue
        lengths.append(len(e.ids))
        supervised.append(sum(label != IGNORE_INDEX for label in e.labels[:cutoff_len]))
        over += len(e.ids) > cutoff_len
        if i < (3 if limit is None else limit):
            out.rule(f"conversation {i + 1}: {len(e.ids)} tokens, {supervised[-1]} supervised"
                     + (f", {len(e.images)} image(s)" if e.images else "")
                     + (f", {len(e.audios)} clip(s)" if e.audios else ""))
            out.print(_highlight(e.text, e.labels, e.offsets, cutoff_len, slots))
    if not as_json:
        out.print(_summary_table(lengths, supervised, over, cutoff_len))
        out.print("[dim]dim: prompt (no loss)[/]  [bold green]green: supervised[/]  "
                  "[red strike]red: cut by cutoff_len[/]  [magenta]magenta: an image's tokens[/]  "
                  "[cyan]cyan: a clip's tokens[/]")


def media_slots(tokenizer: Any) -> dict[str, str]:
    """The tokenizer's media soft tokens, each with the kind of span it makes ("image", "audio")."""
    return {token: kind for kind in ("image", "audio") if (token := getattr(tokenizer, f"{kind}_token", None))}


def token_spans(text: str, labels: list[int], offsets: list[tuple[int, int]], cutoff_len: int,
                slots: dict[str, str] | None = None) -> list[tuple[str, str]]:
    """The rendered text in pieces as training sees it: 'prompt' (no loss), 'supervised', 'image' or 'audio' (a
    medium's soft tokens, `slots` naming them: media_slots), 'cut' (past cutoff_len); neighbours of one kind
    joined."""
    slots = slots or {}
    spans: list[tuple[str, str]] = []
    cursor = 0

    def add(piece: str, kind: str) -> None:
        if spans and spans[-1][1] == kind:
            spans[-1] = (spans[-1][0] + piece, kind)
        elif piece:
            spans.append((piece, kind))

    for index, (label, (start, end)) in enumerate(zip(labels, offsets)):
        end = max(end, start)
        piece = text[cursor:end]
        if index >= cutoff_len:
            kind = "cut"
        elif piece in slots:
            kind = slots[piece]
        else:
            kind = "supervised" if label != IGNORE_INDEX else "prompt"
        add(piece, kind)
        cursor = end  # a token's piece includes any text between it and the previous token
    add(text[cursor:], "prompt")
    return spans


_STYLES = {"prompt": "dim", "supervised": "bold green", "cut": "red strike", "image": "magenta", "audio": "cyan"}


def _highlight(text: str, labels: list[int], offsets: list[tuple[int, int]], cutoff_len: int,
               slots: dict[str, str]) -> Text:
    """The rendering, styled by kind; a medium's soft tokens shown as one slot with their count."""
    styled = Text()
    for piece, kind in token_spans(text, labels, offsets, cutoff_len, slots):
        token = next((t for t, k in slots.items() if k == kind), None)
        if token:
            piece = f"[{piece.count(token)} x {token}]"
        styled.append(piece, style=_STYLES[kind])
    return styled


def _summary_table(lengths: list[int], supervised: list[int], over: int, cutoff_len: int) -> Table:
    table = Table(title=f"{len(lengths)} conversations", show_header=True)
    table.add_column("tokens")
    for key in ("min", "mean", "p50", "p95", "max", "total"):
        table.add_column(key, justify="right")
    for name, values in (("per conversation", lengths), ("supervised", supervised)):
        stats = describe_lengths(values)
        table.add_row(name, *(str(stats.get(k, "-")) for k in ("min", "mean", "p50", "p95", "max", "total")))
    table.caption = f"over cutoff_len={cutoff_len}: {over}"
    return table
