"""Gemma 4's chat format: Google's official template (the canonical one of 2026-07-09, the small-model variant: no
empty thought channel after the generation prompt): `<|turn>ROLE\n...<turn|>\n`, a system turn, tools declared in
it, calls and results in the model's turn, a thought channel.

Its tool text (`<|tool>declaration:...<tool|>`, `<|tool_call>call:NAME{key:value}<tool_call|>`,
`<|tool_response>response:NAME{...}<tool_response|>`, strings between `<|"|>`) is ported from the official
template's macros (format_function_declaration, format_parameters, format_argument, format_tool_response_block) so
that it matches what that template renders byte for byte; `parse_call` reads a generated call back.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from gemmaforge.chat.conversation import Message, Writer, split_system
from gemmaforge.chat.format import ChatFormat
from gemmaforge.chat.reading import AnswerReader, Pieces, split_sendable
from gemmaforge.chat.tools import Tool, ToolCall

QUOTE = '<|"|>'  # the string delimiter
TOOL_CALL_OPEN, TOOL_CALL_CLOSE = "<|tool_call>", "<tool_call|>"
TOOL_RESPONSE_OPEN, TOOL_RESPONSE_CLOSE = "<|tool_response>", "<tool_response|>"
CHANNEL_OPEN, CHANNEL_CLOSE, CHANNEL_NAME = "<|channel>", "<channel|>", "thought\n"
THOUGHT_OPEN, THOUGHT_CLOSE = CHANNEL_OPEN + CHANNEL_NAME, CHANNEL_CLOSE
_STANDARD_KEYS = ("description", "type", "properties", "required", "nullable")
_AFTER_CALL = (TOOL_CALL_CLOSE, TOOL_RESPONSE_OPEN)


# ---------------------------------------------------------------------------- tool text


def _sorted_items(mapping: dict[str, Any]) -> list[tuple[str, Any]]:
    """jinja's dictsort: by key, case-insensitively."""
    return sorted(mapping.items(), key=lambda item: str(item[0]).lower())


def _upper(mapping: dict[str, Any], key: str) -> str:
    """jinja's `mapping[key] | upper`: "" when the key is absent, a None as "NONE", a list as its Python text."""
    return str(mapping[key]).upper() if key in mapping else ""


def value_text(value: Any, escape_keys: bool = True) -> str:
    """The template's format_argument."""
    if value is None:
        return "null"
    if isinstance(value, str):
        return QUOTE + value + QUOTE
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, dict):
        return "{" + ",".join(f"{QUOTE + str(k) + QUOTE if escape_keys else k}:{value_text(v, escape_keys)}"
                              for k, v in _sorted_items(value)) + "}"
    if isinstance(value, list | tuple):
        return "[" + ",".join(value_text(v, escape_keys) for v in value) + "]"
    return str(value)


def _quoted_list(items: Any) -> str:
    return ",".join(QUOTE + str(item) + QUOTE for item in items)


def _parameters(properties: dict[str, Any], filter_keys: bool = False) -> str:
    """The template's format_parameters (a value that is not an object renders as the template renders it: a
    property with an empty type)."""
    out = []
    for key, value in _sorted_items(properties):
        if filter_keys and key in _STANDARD_KEYS:
            continue
        value = value if isinstance(value, dict) else {}
        fields = []
        if value.get("description"):
            fields.append(f"description:{QUOTE}{value['description']}{QUOTE}")
        kind = _upper(value, "type")
        if kind == "STRING" and value.get("enum"):
            fields.append("enum:" + value_text(value["enum"]))
        elif kind == "ARRAY" and isinstance(value.get("items"), dict) and value["items"]:
            fields.append("items:{" + _items(value["items"]) + "}")
        if value.get("nullable"):
            fields.append("nullable:true")
        if kind == "OBJECT":
            if isinstance(value.get("properties"), dict):
                fields.append("properties:{" + _parameters(value["properties"]) + "}")
            else:
                fields.append("properties:{" + _parameters(value, filter_keys=True) + "}")
            if value.get("required"):
                fields.append(f"required:[{_quoted_list(value['required'])}]")
        fields.append(f"type:{QUOTE}{kind}{QUOTE}")
        out.append(f"{key}:{{{','.join(fields)}}}")
    return ",".join(out)


def _items(items: dict[str, Any]) -> str:
    out = []
    for key, value in _sorted_items(items):
        if value is None:
            continue
        if key == "properties":
            out.append("properties:{" + (_parameters(value) if isinstance(value, dict) else "") + "}")
        elif key == "required":
            out.append(f"required:[{_quoted_list(value)}]")
        elif key == "type":
            kinds = value.upper() if isinstance(value, str) else [str(v).upper() for v in value]
            out.append("type:" + value_text(kinds))
        else:
            out.append(f"{key}:{value_text(value)}")
    return ",".join(out)


def declaration(tool: Tool) -> str:
    """`<|tool>declaration:NAME{...}<tool|>` as the template's format_function_declaration writes it (its quirks
    kept: a parameters block without a type is not closed)."""
    function = tool["function"]
    description = str(function["description"]) if "description" in function else ""
    text = f"declaration:{function['name']}{{description:{QUOTE}{description}{QUOTE}"
    params = function.get("parameters")
    if params:
        text += ",parameters:{"
        if params.get("properties"):
            text += "properties:{" + _parameters(params["properties"]) + "},"
        if params.get("required"):
            text += f"required:[{_quoted_list(params['required'])}],"
        if params.get("type"):
            text += f"type:{QUOTE}{_upper(params, 'type')}{QUOTE}}}"
    if "response" in function and isinstance(function["response"], dict):
        response = function["response"]
        text += ",response:{"
        if response.get("description"):
            text += f"description:{QUOTE}{response['description']}{QUOTE},"
        if _upper(response, "type") == "OBJECT":
            text += f"type:{QUOTE}OBJECT{QUOTE}}}"
    return "<|tool>" + (text + "}").strip() + "<tool|>"


def call_text(call: ToolCall) -> str:
    args = ",".join(f"{k}:{value_text(v, escape_keys=False)}" for k, v in _sorted_items(call["arguments"]))
    return f"{TOOL_CALL_OPEN}call:{call['name']}{{{args}}}{TOOL_CALL_CLOSE}"


def response_text(name: str, content: str) -> str:
    value = value_text(content, escape_keys=False)
    return f"{TOOL_RESPONSE_OPEN}response:{name}{{value:{value}}}{TOOL_RESPONSE_CLOSE}"


_STRING = re.compile(re.escape(QUOTE) + "(.*?)" + re.escape(QUOTE), re.DOTALL)
_BARE_KEY = re.compile(r"([{,]\s*)([A-Za-z_][\w\-.]*)\s*:")
_CALL = re.compile(r"call:([^{\s]+)\s*(\{.*\})\s*$", re.DOTALL)


def parse_call(text: str) -> ToolCall | None:
    """`call:NAME{key:value,...}` (what stands between <|tool_call> and <tool_call|>) as a ToolCall; None when it
    is not one. Strings between <|"|> become JSON strings, bare keys are quoted, the rest is read as JSON."""
    match = _CALL.match(text.strip())
    if not match:
        return None
    strings: list[str] = []

    def hold(m: re.Match[str]) -> str:
        strings.append(m.group(1))
        return f"\x00{len(strings) - 1}\x00"

    body = _BARE_KEY.sub(lambda m: f'{m.group(1)}"{m.group(2)}":', _STRING.sub(hold, match.group(2)))
    body = re.sub(r"\x00(\d+)\x00", lambda m: json.dumps(strings[int(m.group(1))], ensure_ascii=False), body)
    try:
        arguments = json.loads(body)
    except json.JSONDecodeError:
        return None
    return {"name": match.group(1), "arguments": arguments} if isinstance(arguments, dict) else None


# ---------------------------------------------------------------------------- thoughts


def strip_thinking(text: str) -> str:
    """The official template's strip_thinking: thought channels removed from an answer, then trimmed."""
    out = []
    for part in text.split(THOUGHT_CLOSE):
        out.append(part.split(CHANNEL_OPEN)[0] if CHANNEL_OPEN in part else part)
    return "".join(out).strip()


def split_marked_thought(text: str) -> tuple[str, str] | None:
    """(thinking, answer) of an answer that begins with its thought channel written out (as LLaMA-Factory's
    gemma4 template writes thoughts in data); None when it does not."""
    marked = text.lstrip()
    if not (marked.startswith(THOUGHT_OPEN) and THOUGHT_CLOSE in marked):
        return None
    thinking, _, answer = marked.removeprefix(THOUGHT_OPEN).partition(THOUGHT_CLOSE)
    return thinking.removesuffix("\n"), answer


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


# ---------------------------------------------------------------------------- reading answers


class Gemma4Reader(AnswerReader):
    """The thought channel `<|channel>thought\n...<channel|>` and calls `<|tool_call>call:NAME{...}<tool_call|>`
    apart from the answer (the engines decode these markers rather than skipping them, see ChatFormat.markers)."""

    def __init__(self, in_thought: bool) -> None:
        super().__init__()
        # content | channel (its name "thought\n" comes next) | thought | call | after call; a prompt that ends
        # inside the thought channel (thinking on, after a tool's result) starts in "thought"
        self.state = "thought" if in_thought else "content"

    def read(self, done: bool) -> Pieces:
        out = Pieces()
        while self._step(out, done):
            pass
        return out

    def _step(self, out: Pieces, done: bool) -> bool:
        """Consume what the buffer allows in the current state; True when the state changed (read on)."""
        text = self.buffer
        if self.state == "content":
            opens = [(text.find(m), m) for m in (CHANNEL_OPEN, TOOL_CALL_OPEN) if m in text]
            if opens:
                at, marker = min(opens)
                out.content += text[:at].rstrip()
                self.buffer, self.state = text[at + len(marker):], "channel" if marker == CHANNEL_OPEN else "call"
                return True
            send, self.buffer = split_sendable(text, done, CHANNEL_OPEN, TOOL_CALL_OPEN)
            out.content += send
            return False
        if self.state == "channel":
            if not done and CHANNEL_NAME.startswith(text):
                return False  # "thought\n" may still be arriving
            self.buffer, self.state = text.removeprefix(CHANNEL_NAME), "thought"
            return True
        if self.state == "thought":
            if CHANNEL_CLOSE in text:
                thought, rest = text.split(CHANNEL_CLOSE, 1)
                out.thinking += thought.rstrip()
                self.buffer, self.state = rest.lstrip(), "content"
                return True
            send, self.buffer = split_sendable(text, done, CHANNEL_CLOSE)
            out.thinking += send
            return False
        if self.state == "after call":  # stray markers after a call (its end, the tool's turn) are not answer
            text = text.lstrip()
            while text.startswith(_AFTER_CALL):
                text = text.removeprefix(TOOL_CALL_CLOSE).removeprefix(TOOL_RESPONSE_OPEN).lstrip()
            self.buffer = text
            if not done and any(m.startswith(text) for m in _AFTER_CALL):
                return False  # may still become one
            self.state = "content"
            return bool(text)
        # a call: read when it closes (or when the answer ends without the close)
        if TOOL_CALL_CLOSE in text or done and text:
            body, _, rest = text.partition(TOOL_CALL_CLOSE)
            call = parse_call(body)
            if call is None:  # not a call after all: its text is shown (strings quoted) rather than lost
                out.content += body.replace(QUOTE, '"')
            else:
                out.tool_calls.append(call)
            self.buffer, self.state = rest, "after call"
            return True
        return False


# ---------------------------------------------------------------------------- the format


@dataclass(frozen=True)
class Gemma4Format(ChatFormat):
    def write(self, messages: list[Message], w: Writer, add_generation_prompt: bool, think: bool) -> None:
        """The official template for text contents. Tool results fold into the model turn that called them; an
        assistant message that follows another (or their tool results) continues the same model turn."""
        system, turns = split_system(messages)
        tools = system.get("tools") if system else None
        if think or tools or system is not None:
            w.add("<|turn>system\n" + ("<|think|>\n" if think else "") + (system["content"].strip() if system else ""))
            w.add("".join(declaration(tool) for tool in tools or ()) + "<turn|>\n")
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
                w.add("".join(call_text(call) for call in calls), supervised=answer)
                previous_type = "tool_call"
            responded = False
            if calls:
                for k in range(i + 1, len(turns)):
                    if turns[k]["role"] != "tool":
                        break
                    # the model writes the first <|tool_response> (it ends its calls); the rest is the tools' text
                    first = not responded
                    w.add(TOOL_RESPONSE_OPEN if first else "", supervised=answer)
                    response = response_text(_tool_name(turns[k], calls), turns[k]["content"])
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

    def request_prompt(self, messages: list[Message], *, think: bool = False) -> str:
        """Ollama renders every gemma4 model with its built-in renderer, Google's official template ported to Go (it
        picks it from the GGUF's architecture, whatever the TEMPLATE; our Modelfile names the variant training
        used), so this is the official rendering with its generation prompt: a final assistant message is closed
        and a new model turn opened, as there."""
        return self.render(messages, add_generation_prompt=True, think=think).text

    def reader(self, tools: bool, prompt: str) -> AnswerReader:
        """Calls are read whether or not the request offered tools (the template has them); a prompt that ends
        inside the thought channel starts the answer there."""
        return Gemma4Reader(in_thought=prompt.endswith(THOUGHT_OPEN))

    def modelfile(self, trained_with_tools: bool) -> list[str]:
        """Ollama's built-in renderer and parser, Google's official template in Go (tools, thinking, tool calls
        read back), which Ollama picks for any gemma4 GGUF whatever its TEMPLATE; named here so that it is the
        small-model variant training used (no empty thought channel after the generation prompt), which Ollama
        would not pick for a model of 12B parameters or more."""
        return ["# Ollama >= 0.21.0: its Gemma 4 renderer (Google's chat template: tools, thinking) and parser",
                "RENDERER gemma4-small", "PARSER gemma4"]


_MARKERS = (CHANNEL_OPEN, CHANNEL_CLOSE, TOOL_CALL_OPEN, TOOL_CALL_CLOSE, QUOTE)
GEMMA4_FORMAT = Gemma4Format(
    title="the Gemma 4 chat format", turn_start="<|turn>", turn_end="<turn|>", system_turn=True, system_separator="",
    native_tools=True, thinking=True, image="<|image|>", image_margin="", jinja_file="gemma4.jinja",
    markers=_MARKERS, syntax_tokens=(*_MARKERS, TOOL_RESPONSE_OPEN, TOOL_RESPONSE_CLOSE), audio="<|audio|>")
