"""Evaluation suites: cases (a prompt, an optional reference answer, optional checks) and the checks.

A suite file is YAML (`cases: [...]`) or JSON Lines (one case per line):

    cases:
      - prompt: "手冲咖啡的水温应该是多少？"
        system: "你是咖啡师。"           # optional
        reference: "90到96摄氏度。"       # optional
        checks: [{starts_with: "您好"}, {contains: "摄氏度"}, {max_chars: 200}]
      - prompt: "What is on this receipt's total line?"
        image: receipts/0412.jpg        # or images: [a.png, b.png]; relative to the suite; <image> places them
        checks: [{contains: "42.50"}]
      - prompt: "What does the caller ask for?"
        audio: calls/0007.wav           # or audios: [...]; <audio> places them (Gemma 4 E2B/E4B)

Errors name the file, the case and its line, and list the known checks.
"""

from __future__ import annotations

import json
import random
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import yaml

from gemmaforge.chat.conversation import Message
from gemmaforge.data.media_files import ImageFinder, SoundFinder
from gemmaforge.errors import UserError


def _regex(answer: str, pattern: str) -> bool:
    return re.search(pattern, answer) is not None


def _json_valid(answer: str, expected: bool) -> bool:
    try:
        json.loads(answer)
        return expected
    except ValueError:
        return not expected


# name -> (test on the stripped answer, the argument type it takes)
CHECKS: dict[str, tuple[Callable[[str, Any], bool], type]] = {
    "starts_with": (lambda answer, s: answer.startswith(s), str),
    "ends_with": (lambda answer, s: answer.endswith(s), str),
    "contains": (lambda answer, s: s in answer, str),
    "not_contains": (lambda answer, s: s not in answer, str),
    "regex": (_regex, str),
    "json_valid": (_json_valid, bool),
    "max_chars": (lambda answer, n: len(answer) <= n, int),
    "min_chars": (lambda answer, n: len(answer) >= n, int),
}


@dataclass(frozen=True)
class Check:
    name: str
    value: Any

    def passes(self, answer: str) -> bool:
        return CHECKS[self.name][0](answer.strip(), self.value)

    def describe(self) -> str:
        return f"{self.name}: {json.dumps(self.value, ensure_ascii=False)}"


@dataclass
class Case:
    messages: list[Message]  # the conversation up to the answer to generate (ends with a user turn)
    reference: str | None = None
    checks: list[Check] = field(default_factory=list)
    id: str = ""
    images: list[Path] = field(default_factory=list)  # in the order of the <image> placeholders in `messages`
    audios: list[Path] = field(default_factory=list)  # in the order of the <audio> placeholders

    @property
    def prompt(self) -> str:
        return self.messages[-1]["content"]


# ---------------------------------------------------------------------------- loading


def load_suite(path: Path) -> list[Case]:
    if not path.is_file():
        raise UserError(f"{path}: suite file not found")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise UserError(f"{path}: not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    items = _jsonl_items(path, text) if path.suffix.lower() in (".jsonl", ".ndjson") else _yaml_items(path, text)
    if not items:
        raise UserError(f"{path}: the suite has no cases")
    return [_parse_case(raw, f"{path} case {i + 1} (line {line})", i, path.parent)
            for i, (raw, line) in enumerate(items)]


def _jsonl_items(path: Path, text: str) -> list[tuple[Any, int]]:
    items = []
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            items.append((json.loads(line), number))
        except json.JSONDecodeError as exc:
            raise UserError(f"{path} line {number}: not valid JSON ({exc.msg} at column {exc.colno})") from None
    return items


def _yaml_items(path: Path, text: str) -> list[tuple[Any, int]]:
    """The cases with the line each starts on (from the YAML node tree, so errors can point at it)."""
    try:
        root = yaml.compose(text, Loader=yaml.SafeLoader)
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" line {mark.line + 1}" if mark is not None else ""
        raise UserError(f"{path}{where}: not valid YAML ({getattr(exc, 'problem', exc)})") from None
    if not isinstance(data, dict) or not isinstance(data.get("cases"), list):
        raise UserError(f"{path}: expected a mapping with a `cases:` list (each case: prompt, reference, checks)")
    unknown = set(data) - {"cases"}
    if unknown:
        raise UserError(f"{path}: unknown top-level key(s) {', '.join(sorted(unknown))}; expected only `cases`")
    cases_node = next(value for key, value in root.value if key.value == "cases")
    return [(raw, node.start_mark.line + 1) for raw, node in zip(data["cases"], cases_node.value)]


_CASE_KEYS = ("id", "prompt", "messages", "system", "reference", "checks", "image", "images", "audio", "audios")


def _parse_case(raw: Any, where: str, index: int, folder: Path) -> Case:
    if not isinstance(raw, dict):
        raise UserError(f"{where}: expected a mapping with prompt, and optionally system, reference, checks")
    unknown = set(raw) - set(_CASE_KEYS)
    if unknown:
        raise UserError(f"{where}: unknown key(s) {', '.join(sorted(unknown))}; expected: {', '.join(_CASE_KEYS)}")
    messages = _case_messages(raw, where)
    reference = raw.get("reference")
    if reference is not None and not isinstance(reference, str):
        raise UserError(f"{where}: `reference` must be text")
    checks = raw.get("checks") or []
    if not isinstance(checks, list):
        raise UserError(f"{where}: `checks` must be a list, e.g. [{{starts_with: '...'}}, {{max_chars: 200}}]")
    # suites name files: nothing is written; clips are checked at the rate Gemma 4 and llama.cpp read them
    images, sounds = ImageFinder(folder), SoundFinder(folder, None)
    return Case(messages, reference, [_parse_check(c, where) for c in checks], str(raw.get("id") or index + 1),
                _case_media(raw, messages, where, folder, images), _case_media(raw, messages, where, folder, sounds))


def _case_media(raw: dict[str, Any], messages: list[Message], where: str, folder: Path,
                finder: ImageFinder | SoundFinder) -> list[Path]:
    """`image: PATH` or `images: [PATH, ...]` (`audio` / `audios` for clips; relative to the suite's folder),
    checked now; placed where the text has `<image>` / `<audio>`, else before the last user turn's text (as Ollama
    places a message's images)."""
    kind = finder.kind
    one, many = kind.name, kind.column
    if one in raw and many in raw:
        raise UserError(f"{where}: give `{one}` (one path) or `{many}` (a list), not both")
    names = [raw[one]] if one in raw else raw.get(many, [])
    if not isinstance(names, list) or not all(isinstance(n, str) and n.strip() for n in names):
        raise UserError(f"{where}: `{one}` must be a path, `{many}` a list of paths")
    found = [finder.find(name, folder, f"{where}: {one} {i + 1}").path for i, name in enumerate(names)]
    placed = sum(m["content"].count(kind.placeholder) for m in messages)
    if found and not placed:
        messages[-1]["content"] = kind.placeholder * len(found) + messages[-1]["content"]
    elif placed != len(found):
        raise UserError(f"{where}: {len(found)} {one}(s) but {placed} {kind.placeholder} placeholder(s) in the text")
    return found


def _case_messages(raw: dict[str, Any], where: str) -> list[Message]:
    if ("prompt" in raw) == ("messages" in raw):
        raise UserError(f"{where}: give `prompt` (text) or `messages` (a conversation ending with a user turn)")
    if "prompt" in raw:
        if not isinstance(raw["prompt"], str) or not raw["prompt"].strip():
            raise UserError(f"{where}: `prompt` must be non-empty text")
        messages = [{"role": "user", "content": raw["prompt"]}]
    else:
        messages = raw["messages"]
        if not isinstance(messages, list) or not all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in messages
        ):
            raise UserError(f"{where}: `messages` must be a list of {{role, content}} mappings")
    system = raw.get("system")
    if system is not None:
        if not isinstance(system, str):
            raise UserError(f"{where}: `system` must be text")
        messages = [{"role": "system", "content": system}, *messages]
    _check_ends_with_user(messages, where)
    return messages


def _check_ends_with_user(messages: list[Message], where: str) -> None:
    from gemmaforge.chat.conversation import check_roles

    check_roles(messages, where)
    if messages[-1]["role"] != "user":
        raise UserError(f"{where}: the conversation must end with a user turn (the one the model answers)")


def _parse_check(raw: Any, where: str) -> Check:
    known = ", ".join(CHECKS)
    if not isinstance(raw, dict) or len(raw) != 1:
        raise UserError(f"{where}: each check is a one-key mapping such as {{contains: 'text'}}; known checks: {known}")
    (name, value), = raw.items()
    if name not in CHECKS:
        raise UserError(f"{where}: unknown check '{name}'; known checks: {known}")
    expected = CHECKS[name][1]
    if not isinstance(value, expected) or (expected is int and isinstance(value, bool)):
        raise UserError(f"{where}: check '{name}' takes {expected.__name__}, got {value!r}")
    if name == "regex":
        try:
            re.compile(cast(str, value))  # a str: checked against CHECKS above
        except re.error as exc:
            raise UserError(f"{where}: check 'regex' pattern {value!r} is not a valid regular expression "
                            f"({exc})") from None
    return Check(name, value)


def val_sample_suite(conversations: list[list[Message]], n: int, seed: int,
                     images: list[list[Path]] | None = None, audios: list[list[Path]] | None = None) -> list[Case]:
    """The default suite: up to n val conversations, each cut before its last answer, which becomes
    the reference (with the conversation's images and clips)."""
    chosen = sorted(random.Random(seed).sample(range(len(conversations)), min(n, len(conversations))))
    return [
        Case(conversations[i][:-1], conversations[i][-1]["content"], id=f"val-{i + 1}",
             images=images[i] if images else [], audios=audios[i] if audios else [])
        for i in chosen
        if len(conversations[i]) >= 2 and conversations[i][-1]["role"] == "assistant"
    ]
