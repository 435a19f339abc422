"""Read instruction datasets into the canonical messages form.

A record becomes `{"messages": [{"role": ..., "content": ...}, ...]}` with roles system, user and
assistant. Errors name the file and the JSONL line or JSON record index.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from gemmaforge.errors import UserError
from gemmaforge.templates import Message

ALPACA_REQUIRED = ("instruction", "output")


def read_records(path: Path) -> Iterator[tuple[str, dict[str, Any]]]:
    """Yield (location, record) from a JSON array or JSONL file; location is 'FILE line N' or
    'FILE record N' for error messages."""
    if not path.is_file():
        raise UserError(f"{path}: data file not found")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        line = path.read_bytes()[: exc.start].count(b"\n") + 1
        raise UserError(f"{path} line {line}: not UTF-8 text ({exc.reason})") from None
    if not text.strip():
        raise UserError(f"{path}: file is empty; expected a JSON array or JSON Lines of records")
    if text.lstrip().startswith("["):
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise UserError(f"{path} line {exc.lineno} column {exc.colno}: malformed JSON ({exc.msg})") from None
        for i, record in enumerate(data):
            yield f"{path} record {i}", record
        return
    for lineno, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise UserError(f"{path} line {lineno}: malformed JSON ({exc.msg}); expected one JSON object per line") from None
        yield f"{path} line {lineno}", record


def alpaca_to_messages(record: Any, where: str, system: str | None = None) -> list[Message]:
    """instruction (+ input on its own paragraph) -> user, output -> assistant, optional system."""
    if not isinstance(record, dict):
        raise UserError(f"{where}: expected a JSON object with instruction/input/output, got {type(record).__name__}")
    for key in ALPACA_REQUIRED:
        if not isinstance(record.get(key), str):
            raise UserError(f"{where}: field '{key}' is missing or not a string (alpaca records need instruction, output)")
    extra_input = record.get("input") or ""
    if not isinstance(extra_input, str):
        raise UserError(f"{where}: field 'input' must be a string")
    user = record["instruction"].strip()
    if extra_input.strip():
        user = f"{user}\n\n{extra_input.strip()}"
    if not user or not record["output"].strip():
        raise UserError(f"{where}: empty instruction or output")
    system_text = record.get("system") or system
    messages: list[Message] = [{"role": "system", "content": system_text.strip()}] if system_text else []
    messages += [{"role": "user", "content": user}, {"role": "assistant", "content": record["output"].strip()}]
    return messages


def detect_format(record: Any, where: str) -> str:
    if isinstance(record, dict) and "instruction" in record and "output" in record:
        return "alpaca"
    keys = ", ".join(sorted(record)) if isinstance(record, dict) else type(record).__name__
    raise UserError(f"{where}: cannot detect the dataset format (keys: {keys}); expected alpaca instruction/input/output")
