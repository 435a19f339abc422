"""Stream records out of dataset files: JSON arrays, JSON Lines, CSV and Parquet.

Each record comes with its location ('FILE line N' for line-based files, 'FILE record N' otherwise) for
error messages. JSON Lines, CSV and Parquet are streamed (memory stays flat for millions of records);
a JSON array is parsed at once, so large datasets belong in JSON Lines.
"""

from __future__ import annotations

import csv
import hashlib
import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from gemmaforge.errors import UserError

JSON_SUFFIXES = (".json", ".jsonl", ".ndjson")
TEXT_SUFFIX = ".txt"  # raw text for continued pretraining: a record per non-empty line, as datasets' text builder
SUFFIXES = (*JSON_SUFFIXES, ".csv", ".parquet", TEXT_SUFFIX)
TEXT_COLUMN = "text"  # the column a .txt file's lines are read into (Hugging Face's and LLaMA-Factory's name)
Progress = Callable[[int], None]  # called with bytes consumed since the last call


def data_files(path: Path) -> list[Path]:
    """`path` itself, or the dataset files of a folder (sorted, one suffix), as LLaMA-Factory reads folders."""
    if path.is_file():
        return [path]
    if path.is_dir():
        files = sorted(p for p in path.iterdir() if p.is_file() and p.suffix.lower() in SUFFIXES)
        if not files:
            raise UserError(f"{path}: folder has no dataset files ({', '.join(SUFFIXES)})")
        if len({p.suffix.lower() for p in files}) > 1:
            raise UserError(f"{path}: folder mixes file types ({', '.join(p.name for p in files)}); use one type")
        return files
    raise UserError(f"{path}: data file not found")


def iter_records(path: Path, progress: Progress | None = None) -> Iterator[tuple[str, Any]]:
    suffix = path.suffix.lower()
    if suffix == TEXT_SUFFIX:
        yield from _text_lines(path, progress)
    elif suffix == ".csv":
        yield from _csv_records(path, progress)
    elif suffix == ".parquet":
        yield from _parquet_records(path, progress)
    elif _starts_with_bracket(path):
        yield from _json_array_records(path, progress)
    else:
        yield from _jsonl_records(path, progress)


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _starts_with_bracket(path: Path) -> bool:
    with path.open("rb") as f:
        head = f.read(4096).lstrip(b"\xef\xbb\xbf \t\r\n")  # a UTF-8 BOM is not content
    return head.startswith(b"[")


def _decode(raw: bytes, where: str) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise UserError(f"{where}: not UTF-8 text ({exc.reason} at byte {exc.start}); "
                        "re-save the file as UTF-8") from None


def _lines(path: Path, progress: Progress | None) -> Iterator[tuple[int, str, str]]:
    """(line number, where, text) of each line that is not blank, decoded as UTF-8 (a byte-order mark dropped)."""
    with path.open("rb") as f:
        for lineno, raw in enumerate(f, start=1):
            if progress:
                progress(len(raw))
            where = f"{path} line {lineno}"
            text = _decode(raw.removeprefix(b"\xef\xbb\xbf") if lineno == 1 else raw, where)
            if text.strip():
                yield lineno, where, text


def _jsonl_records(path: Path, progress: Progress | None) -> Iterator[tuple[str, Any]]:
    seen_any = False
    for lineno, where, text in _lines(path, progress):
        try:
            record = json.loads(text)
        except json.JSONDecodeError as exc:
            if lineno == 1 and text.lstrip().startswith("{") and not text.rstrip().endswith("}"):
                raise UserError(
                    f"{where}: malformed JSON ({exc.msg}); expected one JSON object per line "
                    "(a single pretty-printed JSON object is not a dataset: use a JSON array of records)"
                ) from None
            raise UserError(f"{where}: malformed JSON ({exc.msg}); expected one JSON object per line") from None
        if not isinstance(record, dict):
            raise UserError(f"{where}: expected a JSON object per line, got {type(record).__name__}")
        seen_any = True
        yield where, record
    if not seen_any:
        raise UserError(f"{path}: file is empty; expected a JSON array or JSON Lines of records")


def _text_lines(path: Path, progress: Progress | None) -> Iterator[tuple[str, Any]]:
    seen_any = False
    for _, where, text in _lines(path, progress):
        seen_any = True
        yield where, {TEXT_COLUMN: text.rstrip("\r\n")}
    if not seen_any:
        raise UserError(f"{path}: file is empty; expected a line of text per document")


def _json_array_records(path: Path, progress: Progress | None) -> Iterator[tuple[str, Any]]:
    raw = path.read_bytes()
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        line = raw[: exc.start].count(b"\n") + 1
        raise UserError(f"{path} line {line}: not UTF-8 text ({exc.reason}); re-save the file as UTF-8") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise UserError(f"{path} line {exc.lineno} column {exc.colno}: malformed JSON ({exc.msg})") from None
    if progress:
        progress(len(raw))
    if not data:
        raise UserError(f"{path}: the JSON array is empty; expected records")
    for i, record in enumerate(data):
        yield f"{path} record {i}", record


def _csv_records(path: Path, progress: Progress | None) -> Iterator[tuple[str, Any]]:
    with path.open(encoding="utf-8-sig", newline="") as f:
        reader = csv.DictReader(f)
        try:
            line = 1
            for record in reader:
                where = f"{path} line {line + 1}"
                line = reader.line_num
                if None in record:
                    raise UserError(f"{where}: more cells than the {len(reader.fieldnames or [])} header columns")
                yield where, record
        except UnicodeDecodeError as exc:
            raise UserError(f"{path} after line {reader.line_num}: not UTF-8 text ({exc.reason})") from None
        except csv.Error as exc:
            raise UserError(f"{path} line {reader.line_num}: malformed CSV ({exc})") from None
    if progress:
        progress(path.stat().st_size)
    if reader.line_num <= 1:
        raise UserError(f"{path}: no rows; expected a header line and one record per row")


def _parquet_records(path: Path, progress: Progress | None) -> Iterator[tuple[str, Any]]:
    import pyarrow as pa  # a dependency of `datasets`
    import pyarrow.parquet as pq

    try:
        parquet = pq.ParquetFile(path)
    except (OSError, ValueError, pa.ArrowException) as exc:
        raise UserError(f"{path}: not a readable Parquet file ({exc})") from None
    index = 0
    size, rows = path.stat().st_size, max(parquet.metadata.num_rows, 1)
    for batch in parquet.iter_batches(batch_size=4096):
        for record in batch.to_pylist():
            yield f"{path} record {index}", record
            index += 1
        if progress:
            progress(size * batch.num_rows // rows)
    if index == 0:
        raise UserError(f"{path}: no rows")
