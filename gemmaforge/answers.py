"""A generated answer read as it streams: the answer's text, its thinking and its tool calls, apart.

Gemma 4 writes a thought channel `<|channel>thought\n...<channel|>` and calls `<|tool_call>call:NAME{...}<tool_call|>`
(the engines decode these markers rather than skipping them, see ChatFormat.markers); Gemma 1-3 fine-tunes call
tools in LLaMA-Factory's `Action:` / `Action Input:` lines (tool_text.py). Text that may still turn out to open a
marker is held back until the next piece tells, so no marker ever reaches a client as answer text.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from gemmaforge.families import ChatFormat
from gemmaforge.tool_text import (
    QUOTE,
    TOOL_CALL_CLOSE,
    TOOL_CALL_OPEN,
    TOOL_RESPONSE_OPEN,
    ToolCall,
    parse_default_calls,
    parse_gemma4_call,
)

CHANNEL_OPEN, CHANNEL_CLOSE, CHANNEL_NAME = "<|channel>", "<channel|>", "thought\n"
ACTION = "Action:"
_AFTER_CALL = (TOOL_CALL_CLOSE, TOOL_RESPONSE_OPEN)


@dataclass
class Pieces:
    """What one step of reading adds."""

    content: str = ""
    thinking: str = ""
    tool_calls: list[ToolCall] = field(default_factory=list)

    def __add__(self, other: Pieces) -> Pieces:
        return Pieces(self.content + other.content, self.thinking + other.thinking, self.tool_calls + other.tool_calls)


def _partial_tail(text: str, *markers: str) -> int:
    """Length of the longest tail of `text` that begins one of `markers` (it may yet become the marker)."""
    return max((n for m in markers for n in range(min(len(m) - 1, len(text)), 0, -1) if text.endswith(m[:n])),
               default=0)


def _split_sendable(text: str, done: bool, *markers: str) -> tuple[str, str]:
    """(what can be sent, what is held): held is a tail that may begin a marker, with the whitespace before it
    (text before a marker is sent without its trailing whitespace); at the end nothing is held."""
    if done:
        return text, ""
    head = text[:len(text) - _partial_tail(text, *markers)]
    send = head.rstrip()
    return send, text[len(send):]


class AnswerReader:
    """Feed the generated text piece by piece (`feed`), then `finish`; each returns what can be sent now."""

    def __init__(self, chat: ChatFormat, tools: bool, in_thought: bool = False):
        self.gemma4 = chat.tool_style == "gemma4"
        self.tools = tools  # Gemma 1-3 read `Action:` lines only when the request offered tools
        self.buffer = ""
        # Gemma 4: content | channel (its name "thought\n" comes next) | thought | call | after call; a prompt that
        # ends inside the thought channel (thinking on, after a tool's result) starts in "thought"
        self.state = "thought" if in_thought else "content"
        self.calls_seen = False  # Gemma 1-3: an `Action:` has begun; the rest is read at the end

    def feed(self, text: str) -> Pieces:
        self.buffer += text
        return self._read(done=False)

    def finish(self) -> Pieces:
        return self._read(done=True)

    def _read(self, done: bool) -> Pieces:
        out = Pieces()
        if self.gemma4:
            while self._gemma4_step(out, done):
                pass
        else:
            self._default_step(out, done)
        return out

    # -------------------------------------------------------------------- Gemma 4

    def _gemma4_step(self, out: Pieces, done: bool) -> bool:
        """Consume what the buffer allows in the current state; True when the state changed (read on)."""
        text = self.buffer
        if self.state == "content":
            opens = [(text.find(m), m) for m in (CHANNEL_OPEN, TOOL_CALL_OPEN) if m in text]
            if opens:
                at, marker = min(opens)
                out.content += text[:at].rstrip()
                self.buffer, self.state = text[at + len(marker):], "channel" if marker == CHANNEL_OPEN else "call"
                return True
            send, self.buffer = _split_sendable(text, done, CHANNEL_OPEN, TOOL_CALL_OPEN)
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
            send, self.buffer = _split_sendable(text, done, CHANNEL_CLOSE)
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
            call = parse_gemma4_call(body)
            if call is None:  # not a call after all: its text is shown (strings quoted) rather than lost
                out.content += body.replace(QUOTE, '"')
            else:
                out.tool_calls.append(call)
            self.buffer, self.state = rest, "after call"
            return True
        return False

    # -------------------------------------------------------------------- Gemma 1-3 (LLaMA-Factory's format)

    def _default_step(self, out: Pieces, done: bool) -> None:
        if not self.tools:
            out.content, self.buffer = self.buffer, ""
            return
        if not self.calls_seen:
            at = self.buffer.find(ACTION)
            if at != -1:
                out.content += self.buffer[:at]
                self.buffer, self.calls_seen = self.buffer[at:], True
            else:
                keep = 0 if done else _partial_tail(self.buffer, ACTION)
                out.content += self.buffer[:len(self.buffer) - keep]
                self.buffer = self.buffer[len(self.buffer) - keep:]
        if self.calls_seen and done:
            rest, calls = parse_default_calls(self.buffer)
            out.content += rest if not calls else ""
            out.tool_calls += calls
            self.buffer = ""


def read_whole(reader: AnswerReader, text: str) -> Pieces:
    """A whole answer read at once."""
    return reader.feed(text) + reader.finish()
