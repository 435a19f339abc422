"""The Launch tab's form, generated from the config schema (config.RunConfig): one field per key, its default and
description from the schema, checked by the same validation as the command line, each problem given to the
field it is about."""

from __future__ import annotations

import types
import typing
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ValidationError

from gemmaforge.config import RunConfig, load_config, validation_problems
from gemmaforge.ui.overview import flatten

Kind = Literal["bool", "number", "integer", "choice", "choices", "text", "yaml"]


@dataclass(frozen=True)
class FormField:
    key: str  # dotted: train.learning_rate
    kind: Kind
    default: Any  # as the field shows it
    optional: bool  # empty means None
    choices: tuple[str, ...] = ()
    description: str = ""


def _parts(annotation: Any) -> tuple[list[Any], bool]:
    """A union's members without None, and whether None is one of them."""
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        members = list(typing.get_args(annotation))
        return [m for m in members if m is not type(None)], type(None) in members
    return [annotation], False


def _kind(annotation: Any) -> tuple[Kind, tuple[str, ...], bool]:
    members, optional = _parts(annotation)
    if len(members) == 1:
        (member,) = members
        origin, args = typing.get_origin(member), typing.get_args(member)
        if member is bool:  # an optional one has three states: a choice, empty for null (auto)
            return ("choice", ("True", "False"), True) if optional else ("bool", (), False)
        if member is int:
            return "integer", (), optional
        if member is float:
            return "number", (), optional
        if member is str:
            return "text", (), optional
        if origin is Literal:
            return "choice", tuple(map(str, args)), optional
        if origin is list and typing.get_origin(args[0]) is Literal:
            return "choices", tuple(map(str, typing.get_args(args[0]))), optional
    return "yaml", (), optional  # lists, mappings, unions of those: written as YAML (`[q_proj, v_proj]`)


def form_fields(model: type[BaseModel] = RunConfig, prefix: str = "") -> list[FormField]:
    fields = []
    for name, info in model.model_fields.items():
        key = f"{prefix}{name}"
        if isinstance(info.annotation, type) and issubclass(info.annotation, BaseModel):
            fields += form_fields(info.annotation, f"{key}.")
            continue
        kind, choices, optional = _kind(info.annotation)
        default = None if info.is_required() else info.get_default(call_default_factory=True)
        field = FormField(key, kind, None, optional, choices, info.description or "")
        fields.append(replace(field, default=shown(field, default)))
    return fields


def as_text(field: FormField) -> bool:
    """Whether the field is a text input: an optional number is one too (a number input cannot be empty)."""
    return field.kind in ("text", "yaml") or (field.optional and field.kind in ("integer", "number"))


def shown(field: FormField, value: Any) -> Any:
    """A config value as its input holds it."""
    if field.kind == "choices":
        return list(value or [])
    if value is None:
        return "" if as_text(field) or field.kind == "choice" else value
    if field.kind == "yaml" and not isinstance(value, str):  # a plain string stays as it is (all-linear)
        return yaml.safe_dump(value, default_flow_style=True, allow_unicode=True).strip()
    return str(value) if as_text(field) or field.kind == "choice" else value


def taken(field: FormField, value: Any) -> Any:
    """A field's value as the config takes it: empty is None (or the empty list) and YAML is read."""
    if field.kind == "bool":
        return bool(value)
    if field.kind == "choices":
        return list(value or [])
    if value is None or (isinstance(value, str) and not value.strip()):
        return None
    if field.kind in ("integer", "number") and isinstance(value, str):
        try:  # as Python writes numbers (1e-05 too, which YAML 1.1 reads as a string)
            value = int(value) if field.kind == "integer" else float(value)
        except ValueError:
            return value.strip()  # the config's validation names it
    if field.kind == "integer" and isinstance(value, float) and value.is_integer():
        return int(value)
    if field.kind == "yaml":
        try:
            return yaml.safe_load(value)
        except yaml.YAMLError as exc:
            raise FieldError(field.key, f"not valid YAML ({getattr(exc, 'problem', exc)})") from None
    return value


class FieldError(Exception):
    def __init__(self, key: str, problem: str):
        super().__init__(f"{key}: {problem}")
        self.key, self.problem = key, problem


def nested(flat: dict[str, Any]) -> dict[str, Any]:
    tree: dict[str, Any] = {}
    for key, value in flat.items():
        node = tree
        *sections, last = key.split(".")
        for section in sections:
            node = node.setdefault(section, {})
        node[last] = value
    return tree


def check(fields: list[FormField], values: list[Any]) -> tuple[RunConfig | None, dict[str, str]]:
    """The config the form holds, or the problems by key (a key the form has no field for, such as a whole
    section, is reported under that key as well)."""
    flat, problems = {}, {}
    for field, value in zip(fields, values):
        try:
            value = taken(field, value)
        except FieldError as exc:
            problems[exc.key] = exc.problem
            continue
        if value is not None or not field.optional:
            flat[field.key] = value
    if problems:
        return None, problems
    try:
        return RunConfig.model_validate(nested({k: v for k, v in flat.items() if v is not None})), {}
    except ValidationError as exc:
        found: dict[str, str] = {}
        for key, problem in validation_problems(exc):
            found[key] = f"{found[key]}; {problem}" if key in found else problem
        return None, found


def values_from_file(fields: list[FormField], path: str) -> list[Any]:
    """Each field's value in a config file (or a run's run.yaml), defaults for the keys it leaves out; a file that
    `gemmaforge run` would refuse raises its UserError."""
    config = load_config(Path(path.strip()))
    flat = flatten(config.model_dump(mode="json"))
    return [shown(field, flat.get(field.key)) for field in fields]


def field_of(fields: list[FormField], key: str) -> FormField | None:
    """The field a problem's key names: itself, or the field that holds it (a list's item: export.gguf.0)."""
    while key:
        found = next((f for f in fields if f.key == key), None)
        if found is not None:
            return found
        key = key.rpartition(".")[0]
    return None

