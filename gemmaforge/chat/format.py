"""What every chat format is and does; gemma.py and gemma4.py are the two Gemma has.

A format renders four ways, all from its one definition:
1. training text + the character spans that carry loss (`render`, `encode`),
2. the Hugging Face jinja `chat_template` (`jinja`), also written to GGUF `tokenizer.chat_template`,
3. for Ollama: a Go TEMPLATE (`go_template`) and the Modelfile lines that choose how Ollama renders (`modelfile`),
4. the prompt Ollama renders from an API request's messages (`request_prompt`), which serve uses;
and reads what the model generates back into text, thinking and tool calls (`reader`).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gemmaforge.chat.conversation import BOS, Message, Rendered, Writer, supervised_labels
from gemmaforge.chat.reading import AnswerReader
from gemmaforge.errors import UserError

_JINJA = Path(__file__).parents[1] / "chat_templates"

# No <bos>: the runtime adds it. `.System` holds the system messages Ollama collected; system
# messages also stay in `.Messages`, so the loop renders only user and assistant turns.
_GO_LOOP = """{{- range $i, $m := .Messages }}
{{- $last := eq (len (slice $.Messages $i)) 1 }}
{{- if eq $m.Role "user" }}@START@user
@USER_TURN@
{{- else if eq $m.Role "assistant" }}@START@model
{{ $m.Content }}{{ if not $last }}@END@
{{ end }}
{{- end }}
{{- end }}"""

# the system text opens the first user turn
_GO_USER_FOLDED = """{{ if and $first $.System }}{{ $.System }}@SEP@{{ end }}{{ $m.Content }}@END@
{{ $first = false }}
{{- if $last }}@START@model
{{ end }}"""

_GO_USER = """{{ $m.Content }}@END@
{{ if $last }}@START@model
{{ end }}"""

_GO_SYSTEM_TURN = """{{- if .System }}@START@system
{{ .System }}@END@
{{ end }}
"""


@dataclass(frozen=True)
class ChatFormat(ABC):
    title: str  # how messages name it ("the Gemma 1-3 chat format")
    turn_start: str  # opens a turn, followed by the role and "\n"
    turn_end: str  # closes a turn's content; followed by "\n"
    system_turn: bool  # True: system is its own turn; False: folded into the first user turn
    system_separator: str  # between folded system text and the first user text
    native_tools: bool  # its official template renders tools (else only runs trained on tool data take them)
    thinking: bool  # has a thought channel (`think`)
    image: str  # what the official template writes for an image (vision.py expands it)
    image_margin: str  # what Gemma's processor writes on each side of an image's tokens
    jinja_file: str  # its Hugging Face chat template, in gemmaforge/chat_templates/
    # special tokens an answer may contain that carry its structure (thoughts, tool calls): decoded, not skipped
    markers: tuple[str, ...] = ()
    # chat-syntax tokens a GGUF marks user-defined so that llama.cpp's chat parsers see them in output
    syntax_tokens: tuple[str, ...] = ()
    audio: str | None = None  # what the official template writes for an audio clip (audio.py expands it); None: none

    # ------------------------------------------------------------------ what each format defines

    @abstractmethod
    def write(self, messages: list[Message], w: Writer, add_generation_prompt: bool, think: bool) -> None:
        """The conversation's text after <bos>, every assistant message's supervised part marked (`w.answer()`
        then `w.add(text, supervised=True)`)."""

    @abstractmethod
    def request_prompt(self, messages: list[Message], *, think: bool = False) -> str:
        """The prompt Ollama renders from an API request's messages for a model gemmaforge exported, <bos> first."""

    @abstractmethod
    def reader(self, tools: bool, prompt: str) -> AnswerReader:
        """A reader for the answer that continues `prompt`; `tools`: the request offered tools."""

    @abstractmethod
    def modelfile(self, trained_with_tools: bool) -> list[str]:
        """The Modelfile lines that make Ollama render prompts in this format."""

    # ------------------------------------------------------------------ shared

    def render(
        self,
        messages: list[Message],
        add_generation_prompt: bool = False,
        *,
        think: bool = False,
        train_on_prompt: bool = False,
        mask_history: bool = False,
    ) -> Rendered:
        """The exact text the official template renders (for Gemma 1-3 with tools, LLaMA-Factory's Gemma
        template), plus the supervised spans: by default what every assistant message makes the model write (its
        thinking, tool calls, answer and the end-of-turn marker that closes it; never the tool results), with
        `mask_history` only the last assistant message's, with `train_on_prompt` everything after `<bos>`.
        `think` opens the thinking mode."""
        w = Writer()
        w.add(BOS)
        self.write(messages, w, add_generation_prompt, think)
        text = "".join(w.parts)
        spans = [span for group in (w.spans[-1:] if mask_history else w.spans) for span in group]
        if train_on_prompt:
            spans = [(len(BOS), len(text))]
        return Rendered(text, spans)

    def encode(
        self,
        messages: list[Message],
        tokenizer: Any,
        cutoff_len: int,
        *,
        train_on_prompt: bool = False,
        mask_history: bool = False,
    ) -> tuple[list[int], list[int]]:
        """Token ids of the rendered text (tokenized once, as at inference) and their labels, truncated to
        cutoff_len tokens."""
        rendered = self.render(messages, train_on_prompt=train_on_prompt, mask_history=mask_history)
        enc = tokenizer(rendered.text, add_special_tokens=False, return_offsets_mapping=True)
        ids: list[int] = enc["input_ids"][:cutoff_len]
        return ids, supervised_labels(ids, enc["offset_mapping"], rendered.supervised)

    def check_features(self, messages: list[Message], where: str) -> None:
        """What the conversation uses must exist in the format (thinking)."""
        if not self.thinking and any(m.get("thinking") for m in messages):
            raise UserError(f"{where}: a thinking (reasoning) turn, but {self.title} has no thinking; "
                            "only Gemma 4 has a thought channel")

    def jinja(self) -> str:
        """Jinja for tokenizer_config.json / GGUF, rendering exactly what `render` does."""
        return (_JINJA / self.jinja_file).read_text(encoding="utf-8")

    def go_template(self) -> str:
        """The Ollama Go TEMPLATE of plain turns (no tools, no thinking), as /api/show reports it."""
        if self.system_turn:
            text = _GO_SYSTEM_TURN + _GO_LOOP.replace("@USER_TURN@", _GO_USER)
        else:
            text = "{{- $first := true }}\n" + _GO_LOOP.replace("@USER_TURN@", _GO_USER_FOLDED)
        return (text.replace("@START@", self.turn_start).replace("@END@", self.turn_end)
                .replace("@SEP@", self.system_separator))
