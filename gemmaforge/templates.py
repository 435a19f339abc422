"""ONE chat-format definition per family (families.ChatFormat), rendered four ways:

1. training text + the character spans that carry loss (`render_conversation`, `encode_for_training`),
2. the Hugging Face jinja `chat_template` (`hf_chat_template`), also written to GGUF
   `tokenizer.chat_template`,
3. the Ollama Go TEMPLATE with its stop strings (`ollama_template`),
4. the prompt that TEMPLATE renders from an API request's messages (`ollama_prompt`), which serve uses.

All renderings follow the official Gemma templates: `<bos>` once, content trimmed, role `assistant`
written `model`; Gemma 1-3 fold the system text into the first user turn, Gemma 4 gives it a turn.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from gemmaforge.errors import UserError
from gemmaforge.families import Family

Message = dict[str, str]  # {"role": "system" | "user" | "assistant", "content": str}
IGNORE_INDEX = -100
BOS = "<bos>"


@dataclass(frozen=True)
class Rendered:
    text: str
    supervised: list[tuple[int, int]]  # [start, end) character spans that carry loss


def check_roles(messages: list[Message], where: str, require_answer: bool = False) -> None:
    """Roles must be an optional leading system, then user/assistant alternating, user first; with
    `require_answer` (training data) the conversation must end with an assistant turn."""
    body = messages[1:] if messages and messages[0]["role"] == "system" else messages
    if not body:
        raise UserError(f"{where}: conversation has no user turn")
    for i, message in enumerate(body):
        expected = "user" if i % 2 == 0 else "assistant"
        if message["role"] != expected:
            raise UserError(
                f"{where}: turn {i + 1} has role '{message['role']}', expected '{expected}' "
                "(roles must alternate user/assistant after an optional system message)"
            )
    if require_answer and body[-1]["role"] != "assistant":
        raise UserError(f"{where}: the last turn is from the user; a training conversation must end with an answer")


def render_conversation(
    messages: list[Message],
    family: Family,
    add_generation_prompt: bool = False,
    *,
    train_on_prompt: bool = False,
    mask_history: bool = False,
) -> Rendered:
    """The exact text the official template renders, plus the supervised spans: by default the
    content of every assistant turn and the end-of-turn marker that closes it (the tokens the model
    must learn to emit); with `mask_history` only the last answer; with `train_on_prompt` everything
    after `<bos>`."""
    chat = family.chat
    system = messages[0]["content"] if messages and messages[0]["role"] == "system" else None
    turns = messages[1:] if system is not None else messages
    parts = [BOS]
    if system is not None and chat.system_turn:
        parts.append(f"{chat.turn_start}system\n{system.strip()}{chat.turn_end}\n")
    spans: list[tuple[int, int]] = []
    for i, message in enumerate(turns):
        role = "model" if message["role"] == "assistant" else message["role"]
        prefix = system + chat.system_separator if (i == 0 and system is not None and not chat.system_turn) else ""
        head = f"{chat.turn_start}{role}\n{prefix}"
        parts.append(head)
        start = sum(map(len, parts))
        body = message["content"].strip() + chat.turn_end
        parts.append(body + "\n")
        if message["role"] == "assistant":
            spans.append((start, start + len(body)))
    if add_generation_prompt:
        parts.append(f"{chat.turn_start}model\n")
    text = "".join(parts)
    if train_on_prompt:
        spans = [(len(BOS), len(text))]
    elif mask_history:
        spans = spans[-1:]
    return Rendered(text, spans)


def supervised_labels(
    ids: list[int], offsets: list[tuple[int, int]], spans: list[tuple[int, int]]
) -> list[int]:
    """Labels for a tokenized rendering: the id where the token starts inside a supervised span,
    IGNORE_INDEX elsewhere."""
    return [tok if any(s <= start < e for s, e in spans) else IGNORE_INDEX for tok, (start, _end) in zip(ids, offsets)]


def encode_for_training(
    messages: list[Message],
    tokenizer: Any,
    family: Family,
    cutoff_len: int,
    *,
    train_on_prompt: bool = False,
    mask_history: bool = False,
) -> tuple[list[int], list[int]]:
    """Token ids of the rendered text (tokenized once, as at inference) and their labels, truncated to
    cutoff_len tokens."""
    rendered = render_conversation(messages, family, train_on_prompt=train_on_prompt, mask_history=mask_history)
    enc = tokenizer(rendered.text, add_special_tokens=False, return_offsets_mapping=True)
    ids: list[int] = enc["input_ids"][:cutoff_len]
    return ids, supervised_labels(ids, enc["offset_mapping"], rendered.supervised)


# ---------------------------------------------------------------------------- HF jinja

_HF_TEMPLATE = (
    "{{ bos_token }}"
    "{%- if messages[0]['role'] == 'system' -%}"
    "{%- set system_text = messages[0]['content'] -%}"
    "{%- set loop_messages = messages[1:] -%}"
    "{%- else -%}"
    "{%- set system_text = none -%}"
    "{%- set loop_messages = messages -%}"
    "{%- endif -%}"
    "@SYSTEM_TURN@"
    "{%- for message in loop_messages -%}"
    "{%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
    "{%- endif -%}"
    "{%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}"
    "{{ '@START@' + role + '\\n' }}"
    "@SYSTEM_PREFIX@"
    "{{ message['content'] | trim }}"
    "{{ '@END@\\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '@START@model\\n' }}{%- endif -%}"
)
_HF_SYSTEM_TURN = (
    "{%- if system_text is not none -%}"
    "{{ '@START@system\\n' + system_text | trim + '@END@\\n' }}"
    "{%- endif -%}"
)
_HF_SYSTEM_PREFIX = "{%- if loop.first and system_text is not none -%}{{ system_text + '@SEP@' }}{%- endif -%}"


def hf_chat_template(family: Family) -> str:
    """Jinja for tokenizer_config.json / GGUF, rendering exactly what `render_conversation` does."""
    chat = family.chat
    text = _HF_TEMPLATE.replace("@SYSTEM_TURN@", _HF_SYSTEM_TURN if chat.system_turn else "")
    text = text.replace("@SYSTEM_PREFIX@", "" if chat.system_turn else _HF_SYSTEM_PREFIX)
    sep = chat.system_separator.replace("\n", "\\n")
    return text.replace("@START@", chat.turn_start).replace("@END@", chat.turn_end).replace("@SEP@", sep)


# ---------------------------------------------------------------------------- Ollama Go template

# No <bos>: the runtime adds it. `.System` holds the system messages Ollama collected; system
# messages also stay in `.Messages`, so the loop renders only user and assistant turns.
_OLLAMA_LOOP = """{{- range $i, $m := .Messages }}
{{- $last := eq (len (slice $.Messages $i)) 1 }}
{{- if eq $m.Role "user" }}@START@user
@USER_TURN@
{{- else if eq $m.Role "assistant" }}@START@model
{{ $m.Content }}{{ if not $last }}@END@
{{ end }}
{{- end }}
{{- end }}"""

# Gemma 1-3: the system text opens the first user turn.
_OLLAMA_USER_FOLDED = """{{ if and $first $.System }}{{ $.System }}@SEP@{{ end }}{{ $m.Content }}@END@
{{ $first = false }}
{{- if $last }}@START@model
{{ end }}"""

_OLLAMA_USER = """{{ $m.Content }}@END@
{{ if $last }}@START@model
{{ end }}"""

_OLLAMA_SYSTEM_TURN = """{{- if .System }}@START@system
{{ .System }}@END@
{{ end }}
"""


def ollama_template(family: Family) -> str:
    chat = family.chat
    if chat.system_turn:
        text = _OLLAMA_SYSTEM_TURN + _OLLAMA_LOOP.replace("@USER_TURN@", _OLLAMA_USER)
    else:
        text = "{{- $first := true }}\n" + _OLLAMA_LOOP.replace("@USER_TURN@", _OLLAMA_USER_FOLDED)
    return (text.replace("@START@", chat.turn_start).replace("@END@", chat.turn_end)
            .replace("@SEP@", chat.system_separator))


def collate(messages: list[Message]) -> tuple[str, list[Message]]:
    """Ollama's reading of a request's messages (its template package's collate): every system message's text
    joined by a blank line is the system text, and consecutive messages of one role are merged into one,
    their contents joined by a blank line."""
    system = "\n\n".join(m["content"] for m in messages if m["role"] == "system")
    merged: list[Message] = []
    for message in messages:
        if merged and merged[-1]["role"] == message["role"]:
            merged[-1] = {"role": message["role"], "content": merged[-1]["content"] + "\n\n" + message["content"]}
        else:
            merged.append(dict(message))
    return system, merged


def ollama_prompt(messages: list[Message], family: Family) -> str:
    """What Ollama renders from `messages` with `ollama_template(family)`, <bos> first as its runtime adds it:
    a conversation that ends with the user's turn opens the model's; one that ends with an assistant message
    leaves it open, so the answer continues that message. Contents are as sent (Go's template has no trim):
    alternating turns of trimmed text render exactly as training rendered them."""
    chat = family.chat
    system, turns = collate(messages)
    parts = [BOS]
    if system and chat.system_turn:
        parts.append(f"{chat.turn_start}system\n{system}{chat.turn_end}\n")
    first = True
    for i, message in enumerate(turns):
        last = i == len(turns) - 1
        if message["role"] == "user":
            prefix = system + chat.system_separator if (first and system and not chat.system_turn) else ""
            first = False
            parts.append(f"{chat.turn_start}user\n{prefix}{message['content']}{chat.turn_end}\n")
            if last:
                parts.append(f"{chat.turn_start}model\n")
        elif message["role"] == "assistant":  # system messages went into the system text
            parts.append(f"{chat.turn_start}model\n{message['content']}")
            if not last:
                parts.append(f"{chat.turn_end}\n")
    return "".join(parts)
