"""A generated answer read as it streams: the answer's text, its thinking and its tool calls, apart.

Each chat format reads its own markup (gemma.py, gemma4.py); what they share is here: the pieces one step adds,
and holding back text that may still turn out to open a marker until the next piece tells, so that no marker ever
reaches a client as answer text.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field

from gemmaforge.chat.tools import ToolCall


@dataclass
class Pieces:
    """What one step of reading adds."""

    content: str = ""
    thinking: str = ""
    tool_calls: list[ToolCall] = field(default_factory=list)

    def __add__(self, other: Pieces) -> Pieces:
        return Pieces(self.content + other.content, self.thinking + other.thinking, self.tool_calls + other.tool_calls)


def partial_tail(text: str, *markers: str) -> int:
    """Length of the longest tail of `text` that begins one of `markers` (it may yet become the marker)."""
    return max((n for m in markers for n in range(min(len(m) - 1, len(text)), 0, -1) if text.endswith(m[:n])),
               default=0)


def split_sendable(text: str, done: bool, *markers: str) -> tuple[str, str]:
    """(what can be sent, what is held): held is a tail that may begin a marker, with the whitespace before it
    (text before a marker is sent without its trailing whitespace); at the end nothing is held."""
    if done:
        return text, ""
    head = text[:len(text) - partial_tail(text, *markers)]
    send = head.rstrip()
    return send, text[len(send):]


class AnswerReader(ABC):
    """Feed the generated text piece by piece (`feed`), then `finish`; each returns what can be sent now."""

    def __init__(self) -> None:
        self.buffer = ""

    def feed(self, text: str) -> Pieces:
        self.buffer += text
        return self.read(done=False)

    def finish(self) -> Pieces:
        return self.read(done=True)

    @abstractmethod
    def read(self, done: bool) -> Pieces:
        """Take what the buffer allows (all of it when `done`)."""


def read_whole(reader: AnswerReader, text: str) -> Pieces:
    """A whole answer read at once."""
    return reader.feed(text) + reader.finish()
