"""LLaMA-Factory data folders: `dataset_info.json` entries load unchanged.

An entry names a local `file_name` (file or folder), a `formatting` (alpaca, sharegpt, openai) and
optional `columns` / `tags` mappings (`images` and `audios` columns: paths relative to the folder, as LLaMA-Factory's
media_dir); `num_samples` takes a seeded random subset. Hub and script entries cannot be read offline, and video
entries are not what gemmaforge trains: both are errors that say so.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from gemmaforge.config import FORMATTINGS
from gemmaforge.data.formats import Schema, default_schema, schema_with
from gemmaforge.errors import UserError

DATASET_INFO = "dataset_info.json"
_KNOWN_KEYS = {
    "file_name", "formatting", "columns", "tags", "num_samples", "ranking", "subset", "split", "folder",
    "hf_hub_url", "ms_hub_url", "om_hub_url", "script_url", "cloud_file_name", "revision", "file_sha1",
}


@dataclass(frozen=True)
class SourceSpec:
    """One dataset file (or folder of files) with its schema; schema None means detect it."""

    path: Path
    schema: Schema | None
    label: str
    num_samples: int | None = None
    media_dir: Path | None = None  # where relative image paths start (LLaMA-Factory: the dataset folder)

    @property
    def media(self) -> Path:
        return self.media_dir or (self.path if self.path.is_dir() else self.path.parent)


def is_dataset_dir(path: Path) -> bool:
    return path.is_dir() and (path / DATASET_INFO).is_file()


def dataset_info_sources(folder: Path, names: list[str]) -> list[SourceSpec]:
    info_path = folder / DATASET_INFO
    info = _read_info(info_path)
    if not names:
        raise UserError(
            f"{info_path}: name the dataset(s) to use with data.dataset (or --dataset); defined here: "
            + ", ".join(info)
        )
    return [_entry(info_path, name, info) for name in names]


def _read_info(info_path: Path) -> dict[str, Any]:
    try:
        info = json.loads(info_path.read_text(encoding="utf-8-sig"))
    except UnicodeDecodeError as exc:
        raise UserError(f"{info_path}: not UTF-8 text ({exc.reason})") from None
    except json.JSONDecodeError as exc:
        raise UserError(f"{info_path} line {exc.lineno} column {exc.colno}: malformed JSON ({exc.msg})") from None
    if not isinstance(info, dict) or not all(isinstance(v, dict) for v in info.values()):
        raise UserError(f"{info_path}: expected an object mapping dataset names to their settings")
    return info


def _entry(info_path: Path, name: str, info: dict[str, Any]) -> SourceSpec:
    where = f"{info_path}: dataset '{name}'"
    if name not in info:
        raise UserError(f"{info_path}: no dataset named '{name}'; defined here: {', '.join(info)}")
    entry = info[name]
    unknown = set(entry) - _KNOWN_KEYS
    if unknown:
        raise UserError(f"{where}: unknown keys {', '.join(sorted(unknown))}")
    if "file_name" not in entry:
        remote = next((k for k in ("hf_hub_url", "ms_hub_url", "om_hub_url", "script_url") if k in entry), None)
        if remote:
            raise UserError(
                f"{where}: {remote} datasets are not downloaded by gemmaforge; download the data once and point "
                "file_name at the local file"
            )
        raise UserError(f"{where}: missing file_name")
    formatting = entry.get("formatting", "alpaca")
    if formatting not in FORMATTINGS:
        raise UserError(f"{where}: formatting '{formatting}' is not supported; "
                        f"expected one of: {', '.join(FORMATTINGS)}")
    columns, tags = entry.get("columns"), entry.get("tags")
    for key, value in (("columns", columns), ("tags", tags)):
        if value is not None and not isinstance(value, dict):
            raise UserError(f"{where}: {key} must be an object")
    # LLaMA-Factory reads `system`, `history` and `tools` columns only when mapped.
    base = replace(default_schema(formatting), system=None, history=None, tools=None, images=None)
    schema = schema_with(base, columns, tags if formatting != "alpaca" else None, where)
    if entry.get("ranking"):  # preference pairs: the answers' columns, by LLaMA-Factory's names unless mapped
        schema = replace(schema, chosen=schema.chosen or "chosen", rejected=schema.rejected or "rejected")
    elif schema.chosen or schema.rejected:
        raise UserError(f"{where}: columns chosen/rejected without \"ranking\": true; a preference dataset says so")
    num_samples = entry.get("num_samples")
    if num_samples is not None and (not isinstance(num_samples, int) or num_samples < 1):
        raise UserError(f"{where}: num_samples must be a positive integer")
    path = info_path.parent / entry["file_name"]
    if not path.exists():
        raise UserError(f"{where}: file_name '{entry['file_name']}' not found in {info_path.parent}")
    return SourceSpec(path, schema, f"{info_path.parent.name}/{name}", num_samples, info_path.parent)
