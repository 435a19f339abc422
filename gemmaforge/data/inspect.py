"""`gemmaforge data inspect`: show exactly what the model will see: the rendered text, the tokens
that carry loss, and the token lengths against cutoff_len."""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table
from rich.text import Text

from gemmaforge.data.formats import Schema, detect_schema, to_messages
from gemmaforge.data.prepare import describe_lengths
from gemmaforge.data.sources import data_files, iter_records
from gemmaforge.families import Family
from gemmaforge.templates import IGNORE_INDEX, Message, check_features, render_conversation, supervised_labels


def conversations(path: Path, schema: Schema | None, system: str | None) -> Iterator[tuple[str, list[Message]]]:
    for file in data_files(path):
        file_schema = schema
        for where, record in iter_records(file):
            if file_schema is None:
                file_schema = detect_schema(record, where)
            yield where, to_messages(record, file_schema, where, system)


def encode(
    messages: list[Message], tokenizer: Any, family: Family, *, train_on_prompt: bool, mask_history: bool
) -> tuple[str, list[int], list[int], list[tuple[int, int]]]:
    """(text, ids, labels, offsets) of one conversation, untruncated."""
    rendered = render_conversation(messages, family, train_on_prompt=train_on_prompt, mask_history=mask_history)
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
) -> None:
    """JSON mode: one {"text", "input_ids", "labels"} object per conversation on stdout (truncated to
    cutoff_len, as training sees it). Text mode: `limit` samples highlighted, then a length summary."""
    out = Console(file=sys.stdout, soft_wrap=True, highlight=False)
    lengths, supervised, over = [], [], 0
    for i, (where, messages) in enumerate(conversations(path, schema, system)):
        check_features(messages, family, where)
        text, ids, labels, offsets = encode(
            messages, tokenizer, family, train_on_prompt=train_on_prompt, mask_history=mask_history
        )
        if as_json:
            if limit is not None and i >= limit:
                break
            seen = text if len(ids) <= cutoff_len else text[: offsets[cutoff_len - 1][1]]
            row = {"text": seen, "input_ids": ids[:cutoff_len], "labels": labels[:cutoff_len]}
            sys.stdout.write(json.dumps(row, ensure_ascii=False) + "\n")
            continue
        lengths.append(len(ids))
        supervised.append(sum(label != IGNORE_INDEX for label in labels[:cutoff_len]))
        over += len(ids) > cutoff_len
        if i < (3 if limit is None else limit):
            out.rule(f"conversation {i + 1}: {len(ids)} tokens, {supervised[-1]} supervised")
            out.print(_highlight(text, labels, offsets, cutoff_len))
    if not as_json:
        out.print(_summary_table(lengths, supervised, over, cutoff_len))
        out.print("[dim]dim: prompt (no loss)[/]  [bold green]green: supervised[/]  "
                  "[red strike]red: cut by cutoff_len[/]")


def token_spans(text: str, labels: list[int], offsets: list[tuple[int, int]], cutoff_len: int) -> list[tuple[str, str]]:
    """The rendered text in pieces as training sees it: 'prompt' (no loss), 'supervised', 'cut' (past
    cutoff_len); neighbours of one kind joined."""
    spans: list[tuple[str, str]] = []
    cursor = 0

    def add(piece: str, kind: str) -> None:
        if spans and spans[-1][1] == kind:
            spans[-1] = (spans[-1][0] + piece, kind)
        elif piece:
            spans.append((piece, kind))

    for index, (label, (start, end)) in enumerate(zip(labels, offsets)):
        end = max(end, start)
        add(text[cursor:end], "cut" if index >= cutoff_len else ("supervised" if label != IGNORE_INDEX else "prompt"))
        cursor = end  # a token's piece includes any text between it and the previous token
    add(text[cursor:], "prompt")
    return spans


_STYLES = {"prompt": "dim", "supervised": "bold green", "cut": "red strike"}


def _highlight(text: str, labels: list[int], offsets: list[tuple[int, int]], cutoff_len: int) -> Text:
    styled = Text()
    for piece, kind in token_spans(text, labels, offsets, cutoff_len):
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
