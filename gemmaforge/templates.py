"""ONE chat-format definition per family (families.ChatFormat), rendered four ways:

1. training text + the character spans that carry loss (`render_conversation`, `encode_for_training`),
2. the Hugging Face jinja `chat_template` (`hf_chat_template`), also written to GGUF
   `tokenizer.chat_template`,
3. the Ollama Go TEMPLATE with its stop strings (`ollama_template`; Gemma 4 is rendered by Ollama's own renderer),
4. the prompt Ollama renders from an API request's messages (`ollama_prompt`), which serve uses.

All renderings follow the official Gemma templates: `<bos>` once, content trimmed, role `assistant`
written `model`; Gemma 1-3 fold the system text into the first user turn, Gemma 4 gives it a turn. Tools, tool
calls, tool results and thinking follow Gemma 4's official template; Gemma 1-3 have none in theirs and take
LLaMA-Factory's Gemma rendering of tools (tool_text.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gemmaforge.errors import UserError
from gemmaforge.families import ChatFormat, Family
from gemmaforge.tool_text import (
    TOOL_RESPONSE_OPEN,
    default_calls,
    default_tool_prompt,
    gemma4_call,
    gemma4_declaration,
    gemma4_response,
)

# {"role": "system" | "user" | "assistant" | "tool", "content": str} and, where they apply: "tools" (a system
# message: the tools the conversation offers, tool_text.Tool; every Gemma rendering places them in the system
# text), "tool_calls" and "thinking" (an assistant message), "name" (a tool result: the function it answers).
Message = dict[str, Any]
IGNORE_INDEX = -100
BOS = "<bos>"
THOUGHT_OPEN, THOUGHT_CLOSE = "<|channel>thought\n", "<channel|>"


@dataclass(frozen=True)
class Rendered:
    text: str
    supervised: list[tuple[int, int]]  # [start, end) character spans that carry loss


def check_roles(messages: list[Message], where: str, require_answer: bool = False) -> None:
    """Roles must be an optional leading system, then user/assistant alternating, user first, with tool results
    after an assistant message (always after one that calls tools, as LLaMA-Factory's alternation of
    user/observation with assistant/function_call turns allows); with `require_answer` (training data) the
    conversation must end with an assistant turn."""
    body = messages[1:] if messages and messages[0]["role"] == "system" else messages
    if not body:
        raise UserError(f"{where}: conversation has no user turn")
    previous: Message | None = None
    for i, message in enumerate(body):
        if previous is None:
            expected: tuple[str, ...] = ("user",)
        elif previous["role"] == "user":
            expected = ("assistant",)
        elif previous["role"] == "assistant":
            expected = ("tool",) if previous.get("tool_calls") else ("user", "tool")
        else:
            expected = ("tool", "assistant")
        if message["role"] not in expected:
            hint = ("tool results follow an assistant message; its calls' results come before the next question"
                    if "tool" in (message["role"], *expected)
                    else "roles must alternate user/assistant after an optional system message")
            raise UserError(f"{where}: turn {i + 1} has role '{message['role']}', expected "
                            f"{' or '.join(repr(e) for e in expected)} ({hint})")
        previous = message
    if require_answer and body[-1]["role"] != "assistant":
        raise UserError(f"{where}: the last turn is from the {body[-1]['role']}; a training conversation must end "
                        "with an answer")


def has_content(message: Message) -> bool:
    """Whether a message says anything: text, tool calls, thinking, (a system message) tools; a tool's result may
    be empty."""
    return bool(message["content"].strip() or message["role"] == "tool"
                or any(message.get(key) for key in ("tool_calls", "tools", "thinking")))


def check_features(messages: list[Message], family: Family, where: str) -> None:
    """Thinking is Gemma 4's: Gemma 1-3's chat format has no thought channel."""
    if not family.chat.thinking and any(m.get("thinking") for m in messages):
        raise UserError(f"{where}: a thinking (reasoning) turn, but the {family.name} chat format has no thinking; "
                        "only Gemma 4 has a thought channel")


class _Writer:
    """Text built piece by piece, with the character spans that carry loss, grouped by assistant message."""

    def __init__(self) -> None:
        self.parts: list[str] = []
        self.size = 0
        self.spans: list[list[tuple[int, int]]] = []

    def add(self, text: str, supervised: bool = False) -> None:
        if supervised and text:
            group = self.spans[-1]
            if group and group[-1][1] == self.size:  # contiguous: one span (each ends with one end marker)
                group[-1] = (group[-1][0], self.size + len(text))
            else:
                group.append((self.size, self.size + len(text)))
        self.parts.append(text)
        self.size += len(text)

    def answer(self) -> None:
        """The supervised text that follows belongs to a new assistant message."""
        self.spans.append([])


def render_conversation(
    messages: list[Message],
    family: Family,
    add_generation_prompt: bool = False,
    *,
    think: bool = False,
    train_on_prompt: bool = False,
    mask_history: bool = False,
) -> Rendered:
    """The exact text the official template renders (for Gemma 1-3 with tools, LLaMA-Factory's Gemma template),
    plus the supervised spans: by default what every assistant message makes the model write (its thinking,
    tool calls, answer and the end-of-turn marker that closes it; never the tool results), with `mask_history`
    only the last assistant message's, with `train_on_prompt` everything after `<bos>`. `think` opens Gemma 4's
    thinking mode."""
    w = _Writer()
    w.add(BOS)
    if family.chat.tool_style == "gemma4":
        _gemma4(messages, w, add_generation_prompt, think)
    else:
        _gemma(messages, family.chat, w, add_generation_prompt)
    text = "".join(w.parts)
    spans = [span for group in (w.spans[-1:] if mask_history else w.spans) for span in group]
    if train_on_prompt:
        spans = [(len(BOS), len(text))]
    return Rendered(text, spans)


def _system(messages: list[Message]) -> tuple[Message | None, list[Message]]:
    if messages and messages[0]["role"] == "system":
        return messages[0], messages[1:]
    return None, messages


def _gemma(messages: list[Message], chat: ChatFormat, w: _Writer, add_generation_prompt: bool) -> None:
    """Gemma 1-3: the system text (and LLaMA-Factory's tool prompt after it) opens the first user turn; calls and
    results are LLaMA-Factory's: a model turn of `Action:` lines, a `tool` turn."""
    system, turns = _system(messages)
    prefix = ""
    if system is not None:
        tools = default_tool_prompt(system["tools"]) if system.get("tools") else ""
        if system["content"] or tools:
            prefix = system["content"] + tools + chat.system_separator
    for i, message in enumerate(turns):
        role = "model" if message["role"] == "assistant" else message["role"]
        w.add(f"{chat.turn_start}{role}\n{prefix if i == 0 else ''}")
        body = message["content"].strip()
        if message.get("tool_calls"):
            body = "\n".join(part for part in (body, default_calls(message["tool_calls"])) if part)
        if message["role"] == "assistant":
            w.answer()
        w.add(body + chat.turn_end, supervised=message["role"] == "assistant")
        w.add("\n")
    if add_generation_prompt:
        w.add(f"{chat.turn_start}model\n")


def strip_thinking(text: str) -> str:
    """The official Gemma 4 template's strip_thinking: thought channels removed from an answer, then trimmed."""
    out = []
    for part in text.split(THOUGHT_CLOSE):
        out.append(part.split("<|channel>")[0] if "<|channel>" in part else part)
    return "".join(out).strip()


def _gemma4(messages: list[Message], w: _Writer, add_generation_prompt: bool, think: bool) -> None:
    """Gemma 4's official template (Google's canonical one of 2026-07-09, the small-model variant: no empty thought
    channel after the generation prompt), for text contents. Tool results fold into the model turn that called
    them; an assistant message that follows another (or their tool results) continues the same model turn."""
    system, turns = _system(messages)
    tools = system.get("tools") if system else None
    if think or tools or system is not None:
        w.add("<|turn>system\n" + ("<|think|>\n" if think else "") + (system["content"].strip() if system else ""))
        w.add("".join(gemma4_declaration(tool) for tool in tools or ()) + "<turn|>\n")
    last_user = max((i for i, m in enumerate(turns) if m["role"] == "user"), default=-1)
    previous_type: str | None = None
    previous_role: str | None = None
    for i, message in enumerate(turns):
        if message["role"] == "tool":
            continue
        previous_type = None
        role = "model" if message["role"] == "assistant" else message["role"]
        if not (role == "model" and previous_role == "assistant"):
            w.add(f"<|turn>{role}\n")
        answer = message["role"] == "assistant"
        if answer:
            w.answer()
        if message.get("thinking") and i > last_user:
            w.add(THOUGHT_OPEN + message["thinking"] + "\n" + THOUGHT_CLOSE, supervised=answer)
        calls = message.get("tool_calls") or []
        if calls:
            w.add("".join(gemma4_call(call) for call in calls), supervised=answer)
            previous_type = "tool_call"
        responded = False
        if calls:
            for k in range(i + 1, len(turns)):
                if turns[k]["role"] != "tool":
                    break
                # the model writes the first <|tool_response> (it ends its calls); the rest is the tools' text
                first = not responded
                w.add(TOOL_RESPONSE_OPEN if first else "", supervised=answer)
                response = gemma4_response(_tool_name(turns[k], calls), turns[k]["content"])
                w.add(response.removeprefix(TOOL_RESPONSE_OPEN) if first else response)
                responded, previous_type = True, "tool_response"
        content = strip_thinking(message["content"]) if answer else message["content"].strip()
        w.add(content, supervised=answer)
        following = next((m["role"] for m in turns[i + 1:] if m["role"] != "tool"), None)
        continues = role == "model" and following == "assistant" and (not calls or responded)
        if previous_type == "tool_call" and not responded:
            w.add(TOOL_RESPONSE_OPEN, supervised=answer)
        elif not continues and not (responded and not content and following is None):
            w.add("<turn|>", supervised=answer)
            w.add("\n")
        previous_role = message["role"]
    if add_generation_prompt:
        if previous_type not in ("tool_response", "tool_call"):
            w.add("<|turn>model\n")
        elif previous_type == "tool_response" and think:
            w.add(THOUGHT_OPEN)


def _tool_name(result: Message, calls: list[dict[str, Any]]) -> str:
    """The function a tool result answers, resolved as the official template resolves it (the result's name, else
    'unknown', overridden by each call whose id equals the result's tool_call_id, two absent ids counting as
    equal), except that a named result without ids keeps its name, as Ollama's Gemma 4 renderer keeps tool_name
    (the official template would give every such result the last call's name)."""
    name = result.get("name") or "unknown"
    if result.get("tool_call_id") or not result.get("name"):
        for call in calls:
            if call.get("id") == result.get("tool_call_id"):
                name = call["name"]
    return str(name)


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

_CHAT_TEMPLATES = Path(__file__).parent / "chat_templates"


def hf_chat_template(family: Family) -> str:
    """Jinja for tokenizer_config.json / GGUF, rendering exactly what `render_conversation` does: for Gemma 4
    Google's official template itself (chat_templates/gemma4.jinja, the canonical template of 2026-07-09 as
    Ollama's renderer tests record it for the E2B/E4B checkpoints), for Gemma 1-3 chat_templates/gemma.jinja."""
    name = "gemma4.jinja" if family.chat.tool_style == "gemma4" else "gemma.jinja"
    return (_CHAT_TEMPLATES / name).read_text(encoding="utf-8")


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
    joined by a blank line is the system text, and consecutive messages of one role (tool results excepted) are
    merged into one, their contents joined by a blank line (and their tool calls kept in order)."""
    system = "\n\n".join(m["content"] for m in messages if m["role"] == "system")
    merged: list[Message] = []
    for message in messages:
        if merged and merged[-1]["role"] == message["role"] != "tool":
            previous = merged[-1]
            merged[-1] = {**previous, "content": previous["content"] + "\n\n" + message["content"]}
            calls = [*previous.get("tool_calls", ()), *message.get("tool_calls", ())]
            if calls:
                merged[-1]["tool_calls"] = calls
        else:
            merged.append(dict(message))
    return system, merged


def ollama_prompt(messages: list[Message], family: Family, *, think: bool = False) -> str:
    """The prompt Ollama renders from a request's messages for a model gemmaforge exported, <bos> first.

    Gemma 4: Ollama renders every gemma4 model with its built-in renderer, Google's official template ported to Go
    (it picks it from the GGUF's architecture, whatever the TEMPLATE; our Modelfile names the variant training
    used), so this is the official rendering with its generation prompt: a final assistant message is closed and
    a new model turn opened, as there.

    Gemma 1-3: what the Modelfile TEMPLATE renders (`ollama_template`): a conversation that ends with the user's
    turn opens the model's; one that ends with an assistant message leaves it open, so the answer continues that
    message. Contents are as sent (Go's template has no trim): alternating turns of trimmed text render exactly
    as training rendered them. Tools, calls and results are rendered as training rendered them (LLaMA-Factory's
    format), which Ollama's template data cannot express: gemmaforge serve renders them."""
    if family.chat.tool_style == "gemma4":
        return render_conversation(messages, family, add_generation_prompt=True, think=think).text
    chat = family.chat
    tools = messages[0].get("tools") if messages and messages[0]["role"] == "system" else None
    system, turns = collate(messages)
    head = system + (default_tool_prompt(tools) if tools else "")
    parts = [BOS]
    first = True
    for i, message in enumerate(turns):
        last = i == len(turns) - 1
        if message["role"] in ("user", "tool"):
            prefix = head + chat.system_separator if (first and head and message["role"] == "user") else ""
            first = first and message["role"] != "user"
            parts.append(f"{chat.turn_start}{message['role']}\n{prefix}{message['content']}{chat.turn_end}\n")
            if last:
                parts.append(f"{chat.turn_start}model\n")
        elif message["role"] == "assistant":  # system messages went into the system text
            calls = default_calls(message["tool_calls"]) if message.get("tool_calls") else ""
            parts.append(f"{chat.turn_start}model\n" + "\n".join(p for p in (message["content"], calls) if p))
            if not last:
                parts.append(f"{chat.turn_end}\n")
    return "".join(parts)
