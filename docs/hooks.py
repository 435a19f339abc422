"""MkDocs hooks: the reference pages are written from the code where the code is the source of the fact (the
config models' keys, defaults and help; each verb's argparse help; the LLaMA-Factory keys the translation ignores
and refuses, with its reasons), and benchmarks/README.md with its screenshots
joins the site as it is, so no fact is copied into a page by hand."""

from __future__ import annotations

import argparse
import io
import json
import types
import typing
from contextlib import redirect_stdout
from pathlib import Path
from typing import Any

from mkdocs.structure.files import File, Files
from pydantic import BaseModel
from pydantic_core import PydanticUndefined

ROOT = Path(__file__).parents[1]


def on_files(files: Files, config: Any) -> Files:
    """benchmarks/README.md as the page benchmarks/index.md, the pictures it and the guides show beside it."""
    benchmarks = ROOT / "benchmarks"
    files.append(File.generated(config, "benchmarks/index.md", content=(benchmarks / "README.md").read_text("utf-8")))
    for picture in sorted(benchmarks.rglob("*.png")):
        files.append(File.generated(config, f"benchmarks/{picture.relative_to(benchmarks).as_posix()}",
                                    abs_src_path=str(picture)))
    return files


def on_page_markdown(markdown: str, page: Any, config: Any, files: Files) -> str:
    writers = {"config": config_reference, "cli": cli_reference, "llamafactory-ignored": llamafactory_ignored,
               "llamafactory-refused": llamafactory_refused}
    for name, write in writers.items():
        marker = f"<!-- reference: {name} -->"
        if marker in markdown:
            markdown = markdown.replace(marker, write())
    return markdown


# ---------------------------------------------------------------------------- config keys


def config_reference() -> str:
    """A table per section of RunConfig: each key with its type, default and help, as the pydantic models say."""
    from gemmaforge.config import RunConfig

    out: list[str] = []
    _section(RunConfig, "", out)
    return "\n".join(out)


def _model_of(annotation: Any) -> type[BaseModel] | None:
    for candidate in (annotation, *typing.get_args(annotation)):
        if isinstance(candidate, type) and issubclass(candidate, BaseModel):
            return candidate
    return None


def _section(model: type[BaseModel], prefix: str, out: list[str]) -> None:
    rows, nested = [], []
    for name, info in model.model_fields.items():
        sub = _model_of(info.annotation)
        if sub is not None:
            nested.append((f"{prefix}{name}", sub))
            continue
        rows.append(f"| `{prefix}{name}` | {_type_name(info.annotation)}{_bounds(info)} | {_default(info)} | "
                    f"{_cell(info.description or '')} |")
    if rows:
        out += [f"## `{prefix.rstrip('.') or 'top level'}`", "", (model.__doc__ or "").strip(), "",
                "| key | type | default | meaning |", "|---|---|---|---|", *rows, ""]
    for key, sub in nested:
        _section(sub, f"{key}.", out)


def _type_name(annotation: Any) -> str:
    if typing.get_origin(annotation) is typing.Literal:
        return " \\| ".join(f"`{json.dumps(v)}`" for v in typing.get_args(annotation))
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        return " \\| ".join(_type_name(a) for a in typing.get_args(annotation))
    if annotation is type(None):
        return "null"
    text = annotation.__name__ if isinstance(annotation, type) and not typing.get_args(annotation) else str(annotation)
    return _cell(text.replace("typing.", ""))


def _bounds(info: Any) -> str:
    """The field's numeric bounds (pydantic's ge / gt / le / lt), as ` ≥ 1`."""
    signs = {"ge": "≥", "gt": ">", "le": "≤", "lt": "<"}
    return "".join(f", {sign} {getattr(m, key)}" for m in info.metadata for key, sign in signs.items()
                   if getattr(m, key, None) is not None)


def _default(info: Any) -> str:
    if info.default is PydanticUndefined:
        return "required" if info.default_factory is None else _cell(json.dumps(_plain(info.default_factory())))
    return f"`{json.dumps(_plain(info.default))}`"


def _plain(value: Any) -> Any:
    return value.model_dump() if isinstance(value, BaseModel) else value


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


# ---------------------------------------------------------------------------- command line


def cli_reference() -> str:
    """Every verb's `--help`, as argparse prints it."""
    from gemmaforge.cli import build_parser

    out: list[str] = []
    _helps(build_parser(), [], out)
    return "\n".join(out)


def _helps(parser: argparse.ArgumentParser, path: list[str], out: list[str]) -> None:
    text = io.StringIO()
    with redirect_stdout(text):
        parser.print_help()
    out += [f"## `gemmaforge{''.join(' ' + p for p in path)}`", "", "```text", text.getvalue().rstrip(), "```", ""]
    for action in parser._actions:  # argparse keeps its sub-commands here and nowhere public
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                _helps(sub, [*path, name], out)


# ---------------------------------------------------------------------------- LLaMA-Factory keys


def llamafactory_ignored() -> str:
    """The keys the translation ignores (training configs, `lora_config:`, export YAMLs), with its reasons."""
    from gemmaforge.compat.llamafactory import EXPORT_IGNORED, IGNORED, IGNORED_PREFIXES, PEFT_IGNORED

    rows = [*((f"`{k}`", why) for k, why in sorted(IGNORED.items())),
            *((f"`{p}*`", why) for p, why in sorted(IGNORED_PREFIXES.items())),
            *((f"`lora_config:` `{k}`", why) for k, why in sorted(PEFT_IGNORED.items())),
            *((f"`{k}` (export YAML)", why) for k, why in sorted(EXPORT_IGNORED.items()))]
    return "\n".join(["| key | why it is ignored |", "|---|---|", *(f"| {k} | {_cell(why)} |" for k, why in rows)])


def llamafactory_refused() -> str:
    """The keys refused unless set to the value that means what gemmaforge does, with its reasons."""
    from gemmaforge.compat.llamafactory import EXPORT_REFUSED, REFUSED

    rows = [*((f"`{k}`", ok, why) for k, (ok, why) in sorted(REFUSED.items())),
            *((f"`{k}` (export YAML)", ok, why) for k, (ok, why) in sorted(EXPORT_REFUSED.items()))]
    return "\n".join(["| key | accepted value | what gemmaforge does instead |", "|---|---|---|",
                      *(f"| {k} | {_accepted(ok)} | {_cell(why)} |" for k, ok, why in rows)])


def _accepted(value: Any) -> str:
    from gemmaforge.compat.llamafactory import SAME_AS

    if isinstance(value, str) and value in SAME_AS:
        return f"the value of `{value}`"
    if isinstance(value, tuple | list | set | frozenset):
        return ", ".join(_accepted(v) for v in value)
    return "left out" if value is None else f"`{json.dumps(value)}`"
