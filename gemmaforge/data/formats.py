"""Dataset shapes -> the canonical messages form.

A `Schema` names the columns and role tags of one dataset shape, with the same keys and defaults as
LLaMA-Factory's `dataset_info.json` (`columns`, `tags`), so a LLaMA-Factory dataset entry and a plain
file share one converter. Three formattings: alpaca (instruction/input/output, optional system and
history), sharegpt (`conversations` of from/value with human/gpt/system tags, and LLaMA-Factory's tool turns:
function_call holding the call as JSON, observation holding the result) and openai (`messages` of role/content,
with OpenAI's assistant tool_calls and tool messages). A `tools` column (LLaMA-Factory's, OpenAI's fine-tuning
files') lists the tools a conversation offers. Preference data: pairs of a chosen and a rejected answer (`to_pair`),
and answers labelled desirable or not (`to_feedback`, KTO's).

Media (`record_media`, one kind at a time: media.py): LLaMA-Factory's `images` and `audios` columns with one `<image>`
or `<audio>` in the text where each goes; OpenAI `image_url` and `input_audio` content parts, and `{"type": "image"}` /
`{"type": "audio"}` parts (the chat-template style) that take the next entry of the column; a `file_name` column
(Hugging Face's imagefolder and audiofolder metadata) whose one picture or clip (by its suffix) opens the first user
turn unless the text places it. The text keeps the kind's placeholder where each goes; data/media_files.py finds and
checks the files.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from typing import Any

from gemmaforge.chat.conversation import Message, check_roles
from gemmaforge.chat.gemma4 import split_marked_thought
from gemmaforge.chat.tools import Tool, ToolCall, normalize_call, normalize_tool
from gemmaforge.config import Formatting
from gemmaforge.data.sources import TEXT_COLUMN
from gemmaforge.errors import UserError
from gemmaforge.media import AUDIO, IMAGE, MediaKind

IMAGE_PLACEHOLDER = IMAGE.placeholder  # LLaMA-Factory's: where one of a record's images goes in its text
FOLDER_COLUMN = "file_name"  # Hugging Face's imagefolder / audiofolder metadata: the record's file beside the JSONL
# a file_name with one of these suffixes is a clip (audiofolder: what libsndfile decodes), any other a picture
SOUND_SUFFIXES = (".wav", ".flac", ".mp3", ".ogg", ".oga", ".opus", ".aif", ".aiff", ".au", ".w64", ".caf")
KTO_LABEL = "label"  # TRL's unpaired preference column (and LLaMA-Factory's kto_en_demo's): true when desirable


@dataclass(frozen=True)
class Schema:
    formatting: Formatting
    # alpaca columns
    prompt: str = "instruction"
    query: str | None = "input"
    response: str = "output"
    history: str | None = "history"
    # sharegpt / openai column and tags
    messages: str = "conversations"
    role_tag: str = "from"
    content_tag: str = "value"
    user_tag: str = "human"
    assistant_tag: str = "gpt"
    system_tag: str = "system"
    observation_tag: str = "observation"
    function_tag: str = "function_call"
    # both: a column holding the system prompt, and one holding the tools offered (a JSON list or its text)
    system: str | None = "system"
    tools: str | None = "tools"
    images: str | None = "images"  # the record's images (paths, data URIs), in the order of their placeholders
    audios: str | None = "audios"  # the record's sound clips, likewise
    # preference pairs (LLaMA-Factory's ranking datasets, TRL's preference form): the two answers' columns
    chosen: str | None = None
    rejected: str | None = None
    # answers labelled desirable or not (KTO: LLaMA-Factory's kto_tag, TRL's unpaired `label`): the label's column
    kto_tag: str | None = None

    @property
    def ranking(self) -> bool:
        return self.chosen is not None and self.rejected is not None

    def describe(self) -> str:
        if self.formatting == "alpaca":
            return f"alpaca ({self.prompt}/{self.query}/{self.response})"
        return f"{self.formatting} ({self.messages}: {self.role_tag}/{self.content_tag})"


# A raw-text record (a `text` column, a .txt file's line): an alpaca prompt column, as LLaMA-Factory's c4_demo and
# wiki_demo entries map it (`columns: {prompt: text}`)
TEXT_SCHEMA = Schema("alpaca", prompt=TEXT_COLUMN, query=None, history=None)


def default_schema(formatting: Formatting) -> Schema:
    if formatting == "openai":
        return Schema(
            "openai", messages="messages", role_tag="role", content_tag="content", user_tag="user",
            assistant_tag="assistant", observation_tag="tool", function_tag="function",
        )
    return Schema(formatting)


COLUMN_KEYS = ("prompt", "query", "response", "history", "messages", "system", "tools", "images", "audios", "chosen",
               "rejected", "kto_tag")
TAG_KEYS = ("role_tag", "content_tag", "user_tag", "assistant_tag", "system_tag", "observation_tag", "function_tag")
# LLaMA-Factory column keys for data we cannot train on yet.
UNSUPPORTED_COLUMNS = {"videos": "video data"}


def schema_with(base: Schema, columns: dict[str, Any] | None, tags: dict[str, Any] | None, where: str) -> Schema:
    """`base` with LLaMA-Factory style `columns` / `tags` mappings applied; unknown keys are errors."""
    changes: dict[str, Any] = {}
    for kind, mapping, allowed in (("columns", columns, COLUMN_KEYS), ("tags", tags, TAG_KEYS)):
        for key, value in (mapping or {}).items():
            if key in UNSUPPORTED_COLUMNS:
                raise UserError(f"{where}: {kind}.{key}: {UNSUPPORTED_COLUMNS[key]} is not supported (conversations "
                                "with text, images and sound, preference pairs, labelled answers and raw text only)")
            if key not in allowed:
                raise UserError(f"{where}: {kind}.{key}: unknown key; expected one of: {', '.join(allowed)}")
            if value is not None and not isinstance(value, str):
                raise UserError(f"{where}: {kind}.{key}: expected a column/tag name (string), got {value!r}")
            changes[key] = value
    return replace(base, **changes)


def detect_schema(record: Any, where: str) -> Schema:
    """The shape of the first record; the error lists what was found and what is expected."""
    if isinstance(record, dict):
        if "chosen" in record and "rejected" in record:
            return _pair_schema(record)
        if isinstance(record.get(KTO_LABEL), bool):
            return _feedback_schema(record)
        if "instruction" in record and "output" in record:
            return default_schema("alpaca")
        if isinstance(record.get(TEXT_COLUMN), str) and not {"instruction", "conversations", "messages"} & set(record):
            return TEXT_SCHEMA
        for column in ("conversations", "messages"):
            turns = record.get(column)
            if isinstance(turns, list) and turns and isinstance(turns[0], dict):
                if "from" in turns[0] and "value" in turns[0]:
                    return replace(default_schema("sharegpt"), messages=column)
                if "role" in turns[0] and "content" in turns[0]:
                    return replace(default_schema("openai"), messages=column)
    keys = ", ".join(sorted(map(str, record))) if isinstance(record, dict) else type(record).__name__
    raise UserError(
        f"{where}: cannot detect the dataset format (keys: {keys}); expected alpaca instruction/input/output, "
        "sharegpt conversations of from/value, openai messages of role/content, or a text column (raw text) "
        "(or name your columns with data.columns, as in LLaMA-Factory's dataset_info.json)"
    )


def _pair_schema(record: dict[str, Any]) -> Schema:
    """A preference record's shape: TRL's (`prompt` as text or messages; or no prompt, each side a whole
    conversation), LLaMA-Factory's sharegpt (`conversations`) or alpaca (`instruction`/`input`) ranking records."""
    prompt = record.get("prompt")
    if isinstance(prompt, str):
        return Schema("alpaca", prompt="prompt", query=None, history=None, chosen="chosen", rejected="rejected")
    if "instruction" in record:
        return replace(default_schema("alpaca"), chosen="chosen", rejected="rejected")
    column = next((c for c in ("prompt", "conversations", "messages") if isinstance(record.get(c), list)), "prompt")
    turns = record.get(column) or record["chosen"]  # no prompt column: the sides are whole conversations
    first = turns[0] if isinstance(turns, list) and turns else None
    shape: Formatting = "sharegpt" if isinstance(first, dict) and "from" in first else "openai"
    return replace(default_schema(shape), messages=column, chosen="chosen", rejected="rejected")


def _feedback_schema(record: dict[str, Any]) -> Schema:
    """A labelled answer's shape: TRL's unpaired form (`prompt` and `completion`, as text or messages) or a whole
    conversation (alpaca, sharegpt or openai) whose last turn is the answer, as LLaMA-Factory's kto_en_demo."""
    if "completion" in record:
        if isinstance(record.get("prompt"), str):
            return Schema("alpaca", prompt="prompt", query=None, history=None, response="completion", kto_tag=KTO_LABEL)
        return replace(default_schema("openai"), messages="prompt", response="completion", kto_tag=KTO_LABEL)
    shape = detect_schema({k: v for k, v in record.items() if k != KTO_LABEL}, "a labelled record")
    return replace(shape, kto_tag=KTO_LABEL)


def to_feedback(record: Any, schema: Schema, where: str,
                default_system: str | None = None) -> tuple[list[Message], Message, bool]:
    """One labelled record as (the prompt's messages, the answer, whether the answer is desirable)."""
    if not isinstance(record, dict):
        raise UserError(f"{where}: expected a JSON object, got {type(record).__name__}")
    if schema.kto_tag is None:
        raise UserError(f"{where}: train.method: kto trains on answers labelled desirable or undesirable (TRL's "
                        "prompt/completion/label, LLaMA-Factory's kto_tag column) or on preference pairs; this one "
                        f"is {schema.describe()}")
    label = record.get(schema.kto_tag)
    if not isinstance(label, bool):
        raise UserError(f"{where}: field '{schema.kto_tag}' must be true (a desirable answer) or false (an "
                        f"undesirable one), got {label!r}")
    completion = record.get(schema.response)
    if schema.formatting != "alpaca" and completion is not None:  # TRL's conversational form: prompt, completion
        answer = _side(completion, schema, f"{where}: {schema.response}")
        if len(answer) != 1 or answer[0]["role"] != "assistant":
            raise UserError(f"{where}: field '{schema.response}' must be one assistant answer, got {len(answer)} "
                            f"turns ({', '.join(m['role'] for m in answer)})")
        messages = [*_turns(record, schema, where), answer[0]]
    else:
        messages = _alpaca(record, schema, where) if schema.formatting == "alpaca" else _turns(record, schema, where)
    messages = _with_system_and_tools(messages, record, schema, where, default_system)
    check_roles(messages, where, require_answer=True)
    return messages[:-1], messages[-1], label


def to_pair(record: Any, schema: Schema, where: str,
            default_system: str | None = None) -> tuple[list[Message], Message, Message]:
    """One preference record as (the prompt's messages, the chosen answer, the rejected answer). A record without
    a prompt column (TRL's implicit prompt) holds two whole conversations: the prompt is what they share."""
    if not isinstance(record, dict):
        raise UserError(f"{where}: expected a JSON object, got {type(record).__name__}")
    if not schema.ranking:
        raise UserError(f"{where}: train.method: dpo (and rm) trains on preference pairs, records with a chosen and a "
                        "rejected answer (TRL's prompt/chosen/rejected, LLaMA-Factory's ranking datasets); this one is "
                        f"{schema.describe()}")
    assert schema.chosen is not None and schema.rejected is not None
    for key in (schema.chosen, schema.rejected):
        if record.get(key) in (None, "", [], {}):
            raise UserError(f"{where}: field '{key}' is missing or empty: a preference pair needs a chosen and a "
                            "rejected answer")
    chosen = _side(record[schema.chosen], schema, f"{where}: {schema.chosen}")
    rejected = _side(record[schema.rejected], schema, f"{where}: {schema.rejected}")
    if schema.formatting == "alpaca":
        prompt = _alpaca_prompt(record, schema, where)
    elif record.get(schema.messages) is not None:
        prompt = _turns(record, schema, where)
    else:  # TRL's implicit prompt
        shared = next((i for i, (a, b) in enumerate(zip(chosen, rejected)) if a != b), min(len(chosen), len(rejected)))
        prompt, chosen, rejected = chosen[:shared], chosen[shared:], rejected[shared:]
        if not prompt or prompt[-1]["role"] == "assistant":
            raise UserError(f"{where}: the chosen and the rejected conversation do not start with the same prompt "
                            "(they differ before the last answer); give the prompt in its own `prompt` column")
    for side, messages in ((schema.chosen, chosen), (schema.rejected, rejected)):
        if len(messages) != 1 or messages[0]["role"] != "assistant":
            raise UserError(f"{where}: field '{side}' must be one assistant answer to the prompt, got "
                            f"{len(messages)} turns ({', '.join(m['role'] for m in messages)})")
    if chosen[0] == rejected[0]:
        raise UserError(f"{where}: the chosen and the rejected answer are the same; a preference pair must differ")
    prompt = _with_system_and_tools(prompt, record, schema, where, default_system)
    check_roles([*prompt, chosen[0]], where, require_answer=True)
    return prompt, chosen[0], rejected[0]


def _side(value: Any, schema: Schema, where: str) -> list[Message]:
    """One answer of a pair: text, one turn, or a list of turns (TRL's conversational form)."""
    if isinstance(value, str):
        return [{"role": "assistant", "content": value}]
    turns = [value] if isinstance(value, dict) else value
    messages_column = schema.messages if schema.formatting != "alpaca" else "turns"
    shape = schema if schema.formatting != "alpaca" else default_schema("openai")
    return _turns({messages_column: turns}, replace(shape, messages=messages_column), where)


def to_messages(record: Any, schema: Schema, where: str, default_system: str | None = None) -> list[Message]:
    """One record as messages: optional system (carrying the tools offered, if any), then user/assistant turns
    with tool results after the calls, ending with an answer."""
    if not isinstance(record, dict):
        raise UserError(f"{where}: expected a JSON object, got {type(record).__name__}")
    if schema == TEXT_SCHEMA:
        raise UserError(f"{where}: a record of raw text (a `{TEXT_COLUMN}` column or a .txt line) has no answer to "
                        "fine-tune on; train it with train.method: pt (continued pretraining)")
    if schema.ranking:
        raise UserError(f"{where}: a preference pair (a chosen and a rejected answer) trains with train.method: dpo, "
                        "kto or rm")
    if schema.kto_tag is not None:
        raise UserError(f"{where}: an answer labelled desirable or undesirable (column '{schema.kto_tag}') trains "
                        "with train.method: kto")
    if schema.formatting == "alpaca":
        messages = _alpaca(record, schema, where)
    else:
        messages = _turns(record, schema, where)
    messages = _with_system_and_tools(messages, record, schema, where, default_system)
    check_roles(messages, where, require_answer=True)
    return messages


def _with_system_and_tools(messages: list[Message], record: dict[str, Any], schema: Schema, where: str,
                           default_system: str | None) -> list[Message]:
    """The record's system prompt (or the default one) first, carrying the tools it offers."""
    if messages[0]["role"] != "system":
        system = _optional_text(record, schema.system, where) or default_system
        if system:
            messages.insert(0, {"role": "system", "content": system})
    tools = _tools(record, schema, where)
    if tools:
        if messages[0]["role"] != "system":
            messages.insert(0, {"role": "system", "content": ""})
        messages[0] = {**messages[0], "tools": tools}
    return messages


def document_text(record: Any, schema: Schema, where: str) -> str:
    """A record as continued pretraining reads it, as LLaMA-Factory's pretraining stage does: the text of its first
    prompt (alpaca: the prompt column, its query after a newline; a `text` column is an alpaca prompt; sharegpt
    and openai: the first turn that is not the system's)."""
    if not isinstance(record, dict):
        raise UserError(f"{where}: expected a JSON object, got {type(record).__name__}")
    if schema.formatting == "alpaca":
        prompt = _required_text(record, schema.prompt, where, "continued pretraining reads this column's text")
        return "\n".join(part for part in (prompt, _optional_text(record, schema.query, where)) if part)
    turns = record.get(schema.messages)
    if not isinstance(turns, list):
        raise UserError(f"{where}: field '{schema.messages}' is missing or not a list")
    for i, turn in enumerate(turns):
        if isinstance(turn, dict) and turn.get(schema.role_tag) != schema.system_tag:
            return _text(turn.get(schema.content_tag), f"{where}: {schema.messages}[{i}].{schema.content_tag}")
    raise UserError(f"{where}: field '{schema.messages}' holds no turn with text")


def _tools(record: dict[str, Any], schema: Schema, where: str) -> list[Tool]:
    """The tools column: a list of tool definitions, or its JSON text (as LLaMA-Factory's datasets hold it)."""
    value = record.get(schema.tools) if schema.tools else None
    if isinstance(value, str):
        if not value.strip():
            return []
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise UserError(f"{where}: field '{schema.tools}' is not valid JSON ({e.msg})") from None
    if value is None:
        return []
    if not isinstance(value, list):
        raise UserError(f"{where}: field '{schema.tools}' must be a list of tool definitions")
    return [_checked(normalize_tool, tool, f"{where}: {schema.tools}[{i}]") for i, tool in enumerate(value)]


def _checked(normalize: Any, value: Any, where: str) -> Any:
    try:
        return normalize(value, where)
    except ValueError as e:
        raise UserError(str(e)) from None


def _alpaca(record: dict[str, Any], schema: Schema, where: str) -> list[Message]:
    answer = _required_text(record, schema.response, where, "alpaca records need instruction and output")
    return [*_alpaca_prompt(record, schema, where), {"role": "assistant", "content": answer}]


def _alpaca_prompt(record: dict[str, Any], schema: Schema, where: str) -> list[Message]:
    """An alpaca record's history and its instruction (with its input) as the last user turn."""
    messages: list[Message] = []
    history = record.get(schema.history) if schema.history else None
    if history:
        if not isinstance(history, list) or not all(
            isinstance(pair, list | tuple) and len(pair) == 2 and all(isinstance(x, str) for x in pair)
            for pair in history
        ):
            raise UserError(f"{where}: field '{schema.history}' must be a list of [instruction, answer] string pairs")
        for old_prompt, old_answer in history:
            messages += [{"role": "user", "content": old_prompt}, {"role": "assistant", "content": old_answer}]
    prompt = _required_text(record, schema.prompt, where, "alpaca records need instruction and output")
    extra = _optional_text(record, schema.query, where)
    # Joined with one newline, as LLaMA-Factory does, so its users' data renders the same here.
    user = "\n".join(part for part in (prompt, extra) if part)
    return [*messages, {"role": "user", "content": user}]


def _turns(record: dict[str, Any], schema: Schema, where: str) -> list[Message]:
    turns = record.get(schema.messages)
    if isinstance(turns, str):  # CSV / Parquet cells often hold the list as JSON text
        try:
            turns = json.loads(turns)
        except json.JSONDecodeError:
            pass
    if not isinstance(turns, list) or not turns:
        raise UserError(f"{where}: field '{schema.messages}' is missing or not a non-empty list of turns")
    roles = {schema.user_tag: "user", schema.assistant_tag: "assistant", schema.system_tag: "system",
             schema.observation_tag: "tool", schema.function_tag: "function_call"}
    if schema.formatting == "openai":
        roles.update(developer="system", tool="tool")
    messages: list[Message] = []
    for i, turn in enumerate(turns):
        at = f"{where}: turn {i + 1}"
        if not isinstance(turn, dict):
            raise UserError(f"{at} is not an object with {schema.role_tag}/{schema.content_tag}")
        tag = turn.get(schema.role_tag)
        if tag not in roles:
            expected = ", ".join(f"'{t}'" for t in roles)
            raise UserError(f"{at} has unknown role '{tag}' ({schema.role_tag}); expected one of: {expected}")
        role = roles[tag]
        if role == "system" and i > 0:
            raise UserError(f"{at} is a system message; only the first turn may be one")
        content = turn.get(schema.content_tag)
        if role == "function_call":  # LLaMA-Factory: {"name", "arguments"} (or a list of them) as JSON text
            messages.append({"role": "assistant", "content": "", "tool_calls": _function_call(content, at)})
            continue
        calls = turn.get("tool_calls") if role == "assistant" else None  # OpenAI's shape
        if content is None and calls:
            content = ""
        media: dict[str, list[Any]] = {}
        if isinstance(content, list):  # content parts: OpenAI's, and the chat templates' {"type": "image"}
            content, media = _parts(content, f"{at}: {schema.content_tag}")
            if media and role != "user":
                raise UserError(f"{at}: a {tag} turn holds {' and '.join(media)}; media go in user turns")
        if not isinstance(content, str):
            raise UserError(f"{at}: '{schema.content_tag}' is missing or not a string")
        if role == "system" and not content.strip() and not turn.get("tools"):
            continue  # an empty system prompt is no system prompt
        message: Message = {"role": role, "content": content}
        message.update(media)  # taken out again by record_media
        if calls:
            if not isinstance(calls, list):
                raise UserError(f"{at}: tool_calls must be a list")
            message["tool_calls"] = [_checked(normalize_call, c, f"{at}: tool_calls[{j}]") for j, c in enumerate(calls)]
        thinking = turn.get("thinking", turn.get("reasoning_content")) if role == "assistant" else None
        marked = split_marked_thought(content) if role == "assistant" and not thinking else None
        if marked:  # Gemma 4's own markup in the answer (as LLaMA-Factory's gemma4 template writes thoughts)
            thinking, message["content"] = marked
        if thinking:
            message["thinking"] = _text(thinking, f"{at}: thinking")
        if role == "tool":
            message.update({k: _text(turn[k], f"{at}: {k}") for k in ("name", "tool_call_id") if turn.get(k)})
        if role == "system" and turn.get("tools"):  # as train.jsonl writes a conversation's tools
            message["tools"] = _tools({"tools": turn["tools"]}, replace(schema, tools="tools"), at)
        messages.append(message)
    return messages


def _parts(parts: list[Any], where: str) -> tuple[str, dict[str, list[Any]]]:
    """Content parts as text with a kind's placeholder where each medium goes, and the media of each kind in that
    order (by the kind's column): an `image_url` part's URL ({"url": ...} or the URL itself), an `image` part's
    image, an `input_audio` part's clip (OpenAI's base64 `data` in its `format`) or an `audio` part's, or None for an
    `image` / `audio` part without one (the next entry of the record's column)."""
    text: list[str] = []
    media: dict[str, list[Any]] = {}
    for j, part in enumerate(parts):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text" and isinstance(part.get("text"), str):
            text.append(part["text"])
            continue
        if kind == "image_url":
            url = part.get("image_url")
            url = url.get("url") if isinstance(url, dict) else url
            if not isinstance(url, str):
                raise UserError(f"{where}[{j}]: expected image_url.url, a path or data URI")
            found, medium = url, IMAGE
        elif kind == "input_audio":
            found, medium = _input_audio(part.get("input_audio"), f"{where}[{j}]"), AUDIO
        elif kind in ("image", "audio"):
            medium = IMAGE if kind == "image" else AUDIO
            found = part.get(kind) or part.get("url") or part.get("path")
        else:
            raise UserError(f"{where}[{j}]: expected a text part ({{'type': 'text', 'text': ...}}), an image part "
                            "(image_url, image) or an audio part (input_audio, audio)")
        media.setdefault(medium.column, []).append(found)
        text.append(medium.placeholder)
    return "".join(text), media


def _input_audio(part: Any, where: str) -> str:
    """OpenAI's `input_audio` ({"data": base64, "format": "wav" | "mp3" | ...}) as a data URI."""
    if not isinstance(part, dict) or not isinstance(part.get("data"), str) or not part["data"].strip():
        raise UserError(f"{where}: expected input_audio.data, the clip in base64 (and input_audio.format, e.g. wav)")
    return f"data:audio/{part.get('format') or 'wav'};base64,{part['data']}"


def record_media(record: dict[str, Any], messages: list[Message], schema: Schema, where: str,
                 kind: MediaKind) -> list[Any]:
    """The record's media of `kind` in the order of its placeholders in `messages` (taken out of the messages that
    carried them as content parts): each a path, URL or data URI as written, or a dict of embedded bytes (a Parquet
    image or clip). A `file_name` file of this kind with no placeholder opens the first user turn. The placeholders
    must match the media in number."""
    placeholder, name = kind.placeholder, getattr(schema, kind.column)
    column = record.get(name) if name else None
    folder_file = record.get(FOLDER_COLUMN)
    if column is None and isinstance(folder_file, str) and _kind_of_file(folder_file) is kind:
        column = [folder_file]
        if not any(placeholder in m["content"] for m in messages):
            first = next(m for m in messages if m["role"] == "user")
            first["content"] = placeholder + first["content"]
    if isinstance(column, str | dict):
        column = [column]
    if column is not None and not isinstance(column, list):
        raise UserError(f"{where}: field '{name}' must be a list of {kind.name} paths")
    pending = list(column or [])
    found: list[Any] = []
    for message in messages:
        for medium in message.pop(kind.column, ()):
            if medium is None:
                if not pending:
                    raise UserError(f"{where}: an {kind.name} part without its {kind.name}, and no {kind.name} left "
                                    f"in '{name}' to take its place")
                medium = pending.pop(0)
            found.append(medium)
    found += pending
    if column is None and not found:
        return []  # a record without this kind: an <image> in its text is text
    placed = sum(m["content"].count(placeholder) for m in messages)
    if placed != len(found):
        raise UserError(f"{where}: {len(found)} {kind.name}(s) but {placed} {placeholder} placeholder(s) in the "
                        f"text; write one {placeholder} where each {kind.name} goes")
    if any(placeholder in m["content"] for m in messages if m["role"] != "user"):
        raise UserError(f"{where}: an {placeholder} outside the user turns; {kind.column} go in user turns")
    return found


def _kind_of_file(name: str) -> MediaKind:
    return AUDIO if name.lower().endswith(SOUND_SUFFIXES) else IMAGE


def _function_call(content: Any, where: str) -> list[ToolCall]:
    try:
        calls = json.loads(content) if isinstance(content, str) else None
    except json.JSONDecodeError as e:
        raise UserError(f"{where}: a function_call turn must hold its call as JSON ({e.msg})") from None
    calls = calls if isinstance(calls, list) else [calls]
    return [_checked(normalize_call, call, f"{where}: function_call") for call in calls]


def _text(value: Any, where: str) -> str:
    if not isinstance(value, str):
        raise UserError(f"{where}: expected a string")
    return value


def _required_text(record: dict[str, Any], key: str, where: str, hint: str) -> str:
    value = record.get(key)
    if not isinstance(value, str):
        raise UserError(f"{where}: field '{key}' is missing or not a string ({hint})")
    return value


def _optional_text(record: dict[str, Any], key: str | None, where: str) -> str | None:
    value = record.get(key) if key else None
    if value is not None and not isinstance(value, str):
        raise UserError(f"{where}: field '{key}' must be a string")
    return value or None
