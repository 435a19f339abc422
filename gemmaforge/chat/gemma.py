"""Gemma 1-3's chat format: `<start_of_turn>ROLE\n...<end_of_turn>\n`, the system text folded into the first user
turn, no thinking.

Their official templates have no tools; they take LLaMA-Factory's "default" tool format, the one its
gemma/gemma2/gemma3 templates use (a "You have access to the following tools" prompt in the system text, calls as
`Action: NAME` / `Action Input: {json}` lines, results as a `tool` turn), so its users' data trains and serves as
it did there.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from gemmaforge.chat.conversation import BOS, Message, Writer, split_system
from gemmaforge.chat.format import ChatFormat
from gemmaforge.chat.reading import AnswerReader, Pieces, partial_tail
from gemmaforge.chat.tools import Tool, ToolCall

ACTION = "Action:"

# LLaMA-Factory's DEFAULT_TOOL_PROMPT (src/llamafactory/data/tool_utils.py), character for character.
_DEFAULT_TOOL_PROMPT = (
    "You have access to the following tools:\n{tool_text}"
    "Use the following format if using a tool:\n"
    "```\n"
    "Action: tool name (one of [{tool_names}])\n"
    "Action Input: the input to the tool, in a JSON format representing the kwargs "
    """(e.g. ```{{"input": "hello world", "num_beams": 5}}```)\n"""
    "```\n"
)


def default_tool_prompt(tools: list[Tool]) -> str:
    """What LLaMA-Factory's DefaultToolUtils.tool_formatter appends to the system text."""
    tool_text, names = "", []
    for tool in tools:
        function = tool["function"]
        params = function.get("parameters") or {}
        lines = ""
        for name, param in (params.get("properties") or {}).items():
            param = param if isinstance(param, dict) else {}
            required = ", required" if name in (params.get("required") or []) else ""
            enum = ", should be one of [{}]".format(", ".join(map(str, param["enum"]))) if param.get("enum") else ""
            items = f", where each item should be {param['items'].get('type', '')}" if param.get("items") else ""
            lines += f"  - {name} ({param.get('type', '')}{required}): {param.get('description', '')}{enum}{items}\n"
        tool_text += (f"> Tool Name: {function['name']}\nTool Description: {function.get('description', '')}\n"
                      f"Tool Args:\n{lines}\n")
        names.append(function["name"])
    return _DEFAULT_TOOL_PROMPT.format(tool_text=tool_text, tool_names=", ".join(names))


def default_calls(calls: list[ToolCall]) -> str:
    """LLaMA-Factory's DefaultToolUtils.function_formatter (arguments as json.dumps with ensure_ascii=False)."""
    return "\n".join(f"Action: {c['name']}\nAction Input: {json.dumps(c['arguments'], ensure_ascii=False)}"
                     for c in calls)


_ACTION = re.compile(r"Action:\s*([a-zA-Z0-9_]+)\s*Action Input:\s*(.+?)(?=\s*Action:|\s*$)", re.DOTALL)


def parse_default_calls(text: str) -> tuple[str, list[ToolCall]]:
    """LLaMA-Factory's DefaultToolUtils.tool_extractor: (the text before the first call, the calls); no calls
    when any Action Input is not a JSON object (the whole text is then an answer, as there)."""
    matches = list(_ACTION.finditer(text))
    calls = []
    for match in matches:
        try:
            arguments = json.loads(match.group(2).strip().strip('"').strip("`"))
        except json.JSONDecodeError:
            return text, []
        if not isinstance(arguments, dict):
            return text, []
        calls.append({"name": match.group(1).strip(), "arguments": arguments})
    return (text[:matches[0].start()].strip(), calls) if calls else (text, [])


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


class ActionReader(AnswerReader):
    """Answer text, and LLaMA-Factory's `Action:` lines read as calls when the request offered tools (everything
    from the first `Action:` on is read at the end)."""

    def __init__(self, tools: bool) -> None:
        super().__init__()
        self.tools = tools
        self.calls_seen = False  # an `Action:` has begun

    def read(self, done: bool) -> Pieces:
        out = Pieces()
        if not self.tools:
            out.content, self.buffer = self.buffer, ""
            return out
        if not self.calls_seen:
            at = self.buffer.find(ACTION)
            if at != -1:
                out.content += self.buffer[:at]
                self.buffer, self.calls_seen = self.buffer[at:], True
            else:
                keep = 0 if done else partial_tail(self.buffer, ACTION)
                out.content += self.buffer[:len(self.buffer) - keep]
                self.buffer = self.buffer[len(self.buffer) - keep:]
        if self.calls_seen and done:
            rest, calls = parse_default_calls(self.buffer)
            out.content += rest if not calls else ""
            out.tool_calls += calls
            self.buffer = ""
        return out


@dataclass(frozen=True)
class GemmaTurns(ChatFormat):
    def write(self, messages: list[Message], w: Writer, add_generation_prompt: bool, think: bool) -> None:
        """The system text (and LLaMA-Factory's tool prompt after it) opens the first user turn; calls and results
        are LLaMA-Factory's: a model turn of `Action:` lines, a `tool` turn."""
        system, turns = split_system(messages)
        prefix = ""
        if system is not None:
            tools = default_tool_prompt(system["tools"]) if system.get("tools") else ""
            if system["content"] or tools:
                prefix = system["content"] + tools + self.system_separator
        for i, message in enumerate(turns):
            role = "model" if message["role"] == "assistant" else message["role"]
            w.add(f"{self.turn_start}{role}\n{prefix if i == 0 else ''}")
            body = message["content"].strip()
            if message.get("tool_calls"):
                body = "\n".join(part for part in (body, default_calls(message["tool_calls"])) if part)
            if message["role"] == "assistant":
                w.answer()
            w.add(body + self.turn_end, supervised=message["role"] == "assistant")
            w.add("\n")
        if add_generation_prompt:
            w.add(f"{self.turn_start}model\n")

    def request_prompt(self, messages: list[Message], *, think: bool = False) -> str:
        """What the Modelfile TEMPLATE renders (`go_template`): a conversation that ends with the user's turn opens
        the model's; one that ends with an assistant message leaves it open, so the answer continues that
        message. Contents are as sent (Go's template has no trim): alternating turns of trimmed text render
        exactly as training rendered them. Tools, calls and results are rendered as training rendered them
        (LLaMA-Factory's format), which Ollama's template data cannot express: gemmaforge serve renders them."""
        tools = messages[0].get("tools") if messages and messages[0]["role"] == "system" else None
        system, turns = collate(messages)
        head = system + (default_tool_prompt(tools) if tools else "")
        parts = [BOS]
        first = True
        for i, message in enumerate(turns):
            last = i == len(turns) - 1
            if message["role"] in ("user", "tool"):
                prefix = head + self.system_separator if (first and head and message["role"] == "user") else ""
                first = first and message["role"] != "user"
                parts.append(f"{self.turn_start}{message['role']}\n{prefix}{message['content']}{self.turn_end}\n")
                if last:
                    parts.append(f"{self.turn_start}model\n")
            elif message["role"] == "assistant":  # system messages went into the system text
                calls = default_calls(message["tool_calls"]) if message.get("tool_calls") else ""
                parts.append(f"{self.turn_start}model\n" + "\n".join(p for p in (message["content"], calls) if p))
                if not last:
                    parts.append(f"{self.turn_end}\n")
        return "".join(parts)

    def reader(self, tools: bool, prompt: str) -> AnswerReader:
        return ActionReader(tools)

    def modelfile(self, trained_with_tools: bool) -> list[str]:
        template = f'TEMPLATE """{self.go_template()}"""'
        if not trained_with_tools:
            return [template]
        return ["# Trained on tool calls in LLaMA-Factory's format, which an Ollama TEMPLATE cannot render (nor Ollama",
                "# read back): serve this run with `gemmaforge serve` for tools.", template]


GEMMA_TURNS = GemmaTurns(
    title="the Gemma 1-3 chat format", turn_start="<start_of_turn>", turn_end="<end_of_turn>", system_turn=False,
    system_separator="\n\n", native_tools=False, thinking=False, image="<start_of_image>", image_margin="\n\n",
    jinja_file="gemma.jinja")
