"""What the HTTP layer and the engines exchange: a job (prompt ids, sampling parameters, the adapter)
and the events an engine sends back for it (text deltas, then one Finished or Failed).

Engines run in their own threads; a job hands each event to the asyncio loop of the request that
is waiting for it, so one slow client never blocks an engine.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from gemmaforge.families import Family

MAX_TOP_LOGPROBS = 20  # as Ollama and OpenAI bound top_logprobs (Params.logprobs)


@dataclass(frozen=True)
class Params:
    """Sampling and stopping, in Ollama's option names. temperature 0 is greedy."""

    max_tokens: int
    temperature: float = 0.8
    top_p: float = 0.9
    top_k: int = 40
    min_p: float = 0.0
    seed: int | None = None
    repeat_penalty: float = 1.0
    repeat_last_n: int = 64
    stop: tuple[str, ...] = ()
    grammar: str | None = None  # structured output: "json" (any JSON object) or a JSON schema, as JSON text
    logprobs: int | None = None  # None: none; n: each token's log-probability and the n likeliest tokens' (0-20)


@dataclass(frozen=True)
class Candidate:
    """A token the model could have written next, and its log-probability under the model's distribution (the
    log-softmax of its logits, before any sampling option or grammar), as Ollama and OpenAI report them."""

    token: str  # its text (a byte of a multi-byte character reads as U+FFFD; `raw` has the byte)
    raw: bytes
    logprob: float


@dataclass(frozen=True)
class TokenLogprob(Candidate):
    """A token the answer holds, with the likeliest tokens at its position (Params.logprobs of them)."""

    top: tuple[Candidate, ...] = ()


@dataclass(frozen=True)
class Delta:
    text: str
    logprobs: tuple[TokenLogprob, ...] = ()  # the tokens whose text this delta completes (Params.logprobs)


@dataclass(frozen=True)
class Finished:
    reason: str  # "stop" (end of turn or a stop string) | "length" (max_tokens or the context) | "cancelled"
    prompt_tokens: int
    completion_tokens: int
    prompt_ns: int
    eval_ns: int
    stop_sequence: str | None = None  # the stop string that ended the answer (Anthropic's stop_sequence)


@dataclass(frozen=True)
class Failed:
    message: str


Event = Delta | Finished | Failed


@dataclass
class Job:
    prompt_ids: list[int]
    params: Params
    adapter: str | None  # None: the base model
    loop: asyncio.AbstractEventLoop
    stream: bool = True  # False: the text comes as one Delta before Finished (one wake-up of `loop`, not one a token)
    media: dict[str, Any] | None = None  # the prompt's picture and sound inputs (Engine.encode_media), if it has any
    events: asyncio.Queue[Event] = field(default_factory=asyncio.Queue)
    cancelled: threading.Event = field(default_factory=threading.Event)

    def emit(self, event: Event) -> None:
        """Thread-safe: called from an engine thread."""
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, event)
        except RuntimeError:  # the request's event loop has closed (its client is gone): nobody to tell
            self.cancelled.set()

    def fail(self, error: BaseException | str) -> None:
        message = error if isinstance(error, str) else f"generation failed: {type(error).__name__}: {error}"
        self.emit(Failed(message))


@dataclass
class Answer:
    """One job's answer while it is generated, the same for both engines: each new token is checked
    against the end-of-turn tokens, stop strings and limits, its text streamed, and exactly one
    Finished sent at the end."""

    job: Job
    stream: TextStream
    num_ctx: int
    prompt_ns: int = 0
    started_ns: int = field(default_factory=time.perf_counter_ns)
    tokens: int = 0  # generated, the stop token excluded
    held: list[str] = field(default_factory=list)  # the text of a job that does not stream, until it finishes
    pending: list[TokenLogprob] = field(default_factory=list)  # of the tokens whose text is not sent yet
    held_logprobs: list[TokenLogprob] = field(default_factory=list)  # of the text in `held`

    def accept(self, token: int, stops: set[int], logprob: TokenLogprob | None = None) -> bool:
        """Record `token` (with its log-probabilities when the job asked for them); True when the answer is
        finished (and Finished was sent)."""
        if self.job.cancelled.is_set():
            return self.finish("cancelled")
        if token in stops:
            return self.finish("stop")
        self.tokens += 1
        if logprob is not None:
            self.pending.append(logprob)
        delta, hit_stop_string = self.stream.push(token)
        self._send(delta)
        if hit_stop_string:
            return self.finish("stop", flush=False)
        if self.tokens >= self.job.params.max_tokens or len(self.job.prompt_ids) + self.tokens >= self.num_ctx:
            return self.finish("length")
        return False

    def finish(self, reason: str, flush: bool = True) -> bool:
        """Send what text was held back (unless a stop string ended it: the log-probabilities of the tokens that
        wrote the stop string go with it), then Finished."""
        if flush and reason != "cancelled":
            self._send(self.stream.flush())
        if self.held:
            self.job.emit(Delta("".join(self.held), tuple(self.held_logprobs)))
        self.job.emit(Finished(reason, len(self.job.prompt_ids), self.tokens, self.prompt_ns,
                               time.perf_counter_ns() - self.started_ns, self.stream.matched))
        return True


    def _send(self, text: str) -> None:
        """Send `text` with the log-probabilities of the tokens that completed it (a token whose text is held
        back, a stop string's start or part of a character, waits with it)."""
        if not text:
            return
        if self.job.stream:
            self.job.emit(Delta(text, tuple(self.pending)))
        else:
            self.held.append(text)
            self.held_logprobs += self.pending
        self.pending.clear()


class QueueFull(Exception):
    """The engine's waiting queue is at its bound: answer 503 with Retry-After."""


class TextStream:
    """Token ids -> text deltas, holding back what might still become a stop string or an incomplete
    UTF-8 character; `push` returns (new text, whether a stop string ended the answer)."""

    def __init__(self, decode: Any, stop: tuple[str, ...]):
        self.decode, self.stop = decode, tuple(s for s in stop if s)
        self.ids: list[int] = []
        self.sent = 0  # characters of the decoded text already emitted
        self.matched: str | None = None  # the stop string that ended the text, once one has

    def push(self, token_id: int) -> tuple[str, bool]:
        self.ids.append(token_id)
        text = self.decode(self.ids)
        for s in self.stop:
            at = text.find(s, max(0, self.sent - len(s)))
            if at != -1:
                self.matched = s
                return self._take(text, at), True
        if text.endswith("\ufffd"):  # a multi-byte character split across tokens: wait for the rest
            return "", False
        return self._take(text, len(text) - self._held_back(text)), False

    def flush(self) -> str:
        text = self.decode(self.ids)
        return self._take(text, len(text.rstrip("\ufffd")))

    def _held_back(self, text: str) -> int:
        """Length of the longest tail of `text` that begins some stop string."""
        return max((n for s in self.stop for n in range(min(len(s) - 1, len(text)), 0, -1)
                    if text.endswith(s[:n])), default=0)

    def _take(self, text: str, end: int) -> str:
        delta = text[self.sent:end] if end > self.sent else ""
        self.sent = max(self.sent, end)
        return delta


def marker_ids(tokenizer: Any, family: Family) -> dict[int, str]:
    """The ids of the family's structure markers (ChatFormat.markers) in a Hugging Face tokenizer."""
    vocab = tokenizer.get_vocab()
    return {vocab[m]: m for m in family.chat.markers if m in vocab}


def decode_with_markers(ids: list[int], markers: dict[int, str], decode: Any) -> str:
    """`decode(ids)` (which skips special tokens) with the chat format's structure markers (ChatFormat.markers:
    thought channels, tool calls) written out rather than skipped: each run between markers decoded alone."""
    if not markers or not any(i in markers for i in ids):
        return str(decode(ids))
    parts: list[str] = []
    run: list[int] = []
    for token in ids:
        if token in markers:
            parts += [decode(run) if run else "", markers[token]]
            run = []
        else:
            run.append(token)
    return "".join(parts) + (decode(run) if run else "")


class Engine(Protocol):
    """What the registry and the routes may touch of an engine (TransformersEngine, LlamaCppEngine)."""

    kind: str  # "transformers" | "llamacpp"
    family: Family
    device: Any  # where the weights are: "cpu", or a torch device (cuda: GPU memory)
    vision: Any  # how images enter its prompts (vision.ImagePrompt); None: it takes none
    audio_rate: int | None  # the sample rate its clips are given at; None: it takes no sound
    base_path: Path | None  # the weights it loaded: a model folder or a GGUF file
    base_name: str | None  # that model as the user named it
    adapters: dict[str, Path]  # LoRA adapters loaded beside the base weights, by name (never for a GGUF file)

    def encode(self, text: str) -> list[int]: ...

    def encode_media(self, text: str, images: Sequence[Any], clips: Sequence[Any] = ()
                     ) -> tuple[list[int], dict[str, Any]]:
        """`text`'s ids with each picture's and clip's marker expanded, and their inputs (Job.media): `images` PIL
        pictures, `clips` float32 mono samples at audio_rate. ValueError with the reason when the model or engine
        takes no pictures or no sound, or the markers and the media differ in number."""
        ...

    def compile_grammar(self, spec: str) -> None:
        """Make (and keep) the grammar for Params.grammar `spec`; ValueError with the reason when the schema
        cannot be held. Blocking: the first call may take seconds."""
        ...

    def submit(self, job: Job) -> None:
        """Queue the job (QueueFull when the queue is full); its events go to the job's loop."""
        ...

    def running(self) -> int:
        """Requests waiting or in flight."""
        ...

    def embed(self, texts: list[str], adapter: str | None) -> tuple[list[list[float]], int]:
        """Each text's embedding (the mean of the final hidden states over <bos> and its tokens, cut at the
        context) with `adapter` (None: the base model), and the tokens read."""
        ...

    def load_adapter(self, name: str, path: Path) -> None:
        """Load the PEFT adapter at `path` as `name`; ValueError when the engine takes none (a GGUF file)."""
        ...

    def unload_adapter(self, name: str) -> None:
        """Fail `name`'s requests and free the adapter."""
        ...

    def close(self) -> None: ...

    def parameter_count(self) -> int: ...

    def quantization_level(self) -> str:
        """As Ollama lists it: F16, BF16, Q8_0, ..."""
        ...

    def weight_files(self) -> list[Path]:
        """The files the weights were loaded from (their sizes are the model's listed size)."""
        ...
