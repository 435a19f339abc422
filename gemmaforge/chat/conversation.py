"""A conversation as every stage holds it, the checks every stage applies to one, and rendered text with the
character spans that carry loss."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from gemmaforge.errors import UserError

# {"role": "system" | "user" | "assistant" | "tool", "content": str} and, where they apply: "tools" (a system
# message: the tools the conversation offers, tools.Tool; every Gemma rendering places them in the system text),
# "tool_calls" and "thinking" (an assistant message), "name" (a tool result: the function it answers).
Message = dict[str, Any]
IGNORE_INDEX = -100
BOS = "<bos>"


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


def split_system(messages: list[Message]) -> tuple[Message | None, list[Message]]:
    """(the leading system message or None, the turns after it)."""
    if messages and messages[0]["role"] == "system":
        return messages[0], messages[1:]
    return None, messages


class Writer:
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


def supervised_labels(
    ids: list[int], offsets: list[tuple[int, int]], spans: list[tuple[int, int]]
) -> list[int]:
    """Labels for a tokenized rendering: the id where the token starts inside a supervised span,
    IGNORE_INDEX elsewhere."""
    return [tok if any(s <= start < e for s, e in spans) else IGNORE_INDEX for tok, (start, _end) in zip(ids, offsets)]
