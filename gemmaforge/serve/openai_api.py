"""OpenAI's dialect: /v1/chat/completions and /v1/completions bodies parsed into a Completion, events rendered
back as server-sent events (chunks, then [DONE]) or as one completion object, in the shapes of Ollama's own
OpenAI layer."""

from __future__ import annotations

import itertools
import json
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from typing import Any

from gemmaforge.chat.reading import Pieces
from gemmaforge.chat.tools import ToolCall
from gemmaforge.inference.jobs import MAX_TOP_LOGPROBS, Delta, Event, Finished, TokenLogprob
from gemmaforge.serve.protocol import (
    OLLAMA_DEFAULTS,
    Completion,
    ServedModel,
    bad,
    chat_prompt,
    field,
    generate_prompt,
    images_in,
    json_schema,
    logprob_json,
    logprobs_of,
    messages_of,
    sounds_in,
    stops,
    tools_of,
)

EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh", "max")  # OpenAI's reasoning efforts


class OpenAIDialect:
    media_type = "text/event-stream"

    def parse(self, data: dict[str, Any], served: ServedModel, chat: bool) -> Completion:
        tools: list[Any] = []
        images: tuple[Any, ...] = ()
        sounds: tuple[tuple[str, bytes], ...] = ()
        if chat:
            tools = tools_of(data) if tool_choice(data) == "auto" else []
            messages = messages_of(data, served.family.chat.image, openai=True, audio=served.family.chat.audio)
            prompt, images = chat_prompt(served, messages, tools, think_of(data)), images_in(messages)
            sounds = sounds_in(messages)
        elif isinstance(data.get("prompt"), str):
            prompt, _, _ = generate_prompt(served, {"prompt": data["prompt"]})
        else:
            raise bad("prompt: expected a string")
        stream = field(data, "stream", bool, False)
        include_usage = stream and field(field(data, "stream_options", dict, {}), "include_usage", bool, False,
                                         "stream_options.")
        return Completion(data["model"], prompt, chat, stream, options_of(served, data), stops(data), include_usage,
                          grammar=response_format(data), reading=served.family.chat if chat else None,
                          tools=bool(tools), images=images, sounds=sounds,
                          logprobs=logprobs_of(data) if chat else completion_logprobs(data))

    async def stream(self, c: Completion, events: AsyncIterator[Event]) -> AsyncIterator[bytes]:
        answer = _Answer(c)
        reader = c.reader()
        if c.chat:
            yield sse(answer.envelope([{"index": 0, "delta": {"role": "assistant", "content": ""},
                                        "finish_reason": None}], True))
        pending: list[TokenLogprob] = []  # of text the reader holds back: sent with the next chunk
        async for event in events:
            if isinstance(event, Delta):
                pieces = reader.feed(event.text) if reader else Pieces(event.text)
                pending += event.logprobs
                if pieces.content or pieces.thinking or pieces.tool_calls or not c.chat:
                    yield sse(answer.envelope([answer.choice(pieces, None, True, pending)], True))
                    pending = []
            elif isinstance(event, Finished):
                pieces = reader.finish() if reader else Pieces()
                if pieces.content or pieces.thinking or pieces.tool_calls or pending:
                    yield sse(answer.envelope([answer.choice(pieces, None, True, pending)], True))
                yield sse(answer.envelope([answer.choice(None if c.chat else Pieces(), answer.finish_reason(event),
                                                         True)], True))
                if c.include_usage:
                    yield sse(answer.envelope([], True, usage=usage(event)))
            else:
                yield sse({"error": {"message": event.message, "type": "api_error", "param": None, "code": None}})
        yield b"data: [DONE]\n\n"

    def whole(self, c: Completion, text: str, end: Finished,
              logprobs: tuple[TokenLogprob, ...] = ()) -> dict[str, Any]:
        answer = _Answer(c)
        pieces = c.read_whole(text)
        choice = answer.choice(pieces, None, False, logprobs)
        return answer.envelope([{**choice, "finish_reason": answer.finish_reason(end)}], False, usage=usage(end))


def tool_choice(data: dict[str, Any]) -> str:
    """OpenAI's tool_choice: "auto" (the default) offers the tools, "none" does not; forcing calls is not
    something the chat template can express."""
    choice = data.get("tool_choice", "auto")
    if choice not in ("auto", "none"):
        raise bad("tool_choice: only \"auto\" and \"none\" are supported (the chat template cannot force a call; "
                  "the model decides whether to call)")
    return str(choice)


def think_of(data: dict[str, Any]) -> bool:
    """Thinking as OpenAI's APIs ask for it: Chat Completions' reasoning_effort, or the Responses API's
    reasoning.effort, other than "none" (every other effort is the one thought channel Gemma 4 has)."""
    key, effort = "reasoning_effort", field(data, "reasoning_effort", str)
    if effort is None:
        key, effort = "reasoning.effort", field(field(data, "reasoning", dict, {}), "effort", str, None, "reasoning.")
    if effort is not None and effort not in EFFORTS:
        raise bad(f"{key}: {effort!r} is not supported; expected {', '.join(EFFORTS)}")
    return effort not in (None, "none")


def completion_logprobs(data: dict[str, Any]) -> int | None:
    """/v1/completions' `logprobs`: how many of the likeliest tokens to list at each position (0-20)."""
    top = field(data, "logprobs", int)
    if top is not None and not 0 <= top <= MAX_TOP_LOGPROBS:
        raise bad(f"logprobs: {top} is out of range [0, {MAX_TOP_LOGPROBS}]")
    return top


def response_format(data: dict[str, Any]) -> str | None:
    """Chat Completions' response_format, its schema under `json_schema`."""
    return output_format(field(data, "response_format", dict, {}), "response_format.", "json_schema")


def output_format(spec: dict[str, Any], where: str, holder: str | None = None) -> str | None:
    """An OpenAI output format (`where` names it): text, json_object (JSON mode) or json_schema (its `schema`, in
    `holder` (Chat Completions' json_schema object) or beside `type` (the Responses API's text.format), strict or
    not: the grammar holds every answer to the schema either way)."""
    kind = field(spec, "type", str, "text", where)
    if kind == "text":
        return None
    if kind == "json_object":
        return "json"
    if kind == "json_schema":
        inner, path = (field(spec, holder, dict, {}, where), f"{where}{holder}.") if holder else (spec, where)
        return json_schema(inner.get("schema"), f"{path}schema")
    raise bad(f"{where}type: {kind!r} is not supported; expected text, json_object or json_schema")


def options_of(served: ServedModel, data: dict[str, Any],
               limits: tuple[str, ...] = ("max_completion_tokens", "max_tokens")) -> dict[str, Any]:
    """As Ollama's OpenAI layer: temperature and top_p default to 1.0; the first of `limits` given (Chat
    Completions' max_completion_tokens or max_tokens, the Responses API's max_output_tokens) is num_predict."""
    for key in ("frequency_penalty", "presence_penalty"):
        if field(data, key, float, 0.0):
            raise bad(f"{key}: not supported (use 0); repeat penalties are set through the Ollama API's options")
    if field(data, "n", int, 1) != 1:
        raise bad("n: only one choice per request is supported")
    merged = {**OLLAMA_DEFAULTS, **served.options, "temperature": 1.0, "top_p": 1.0}
    for key in ("temperature", "top_p"):
        merged[key] = float(field(data, key, float, merged[key]))
    merged["seed"] = field(data, "seed", int)
    given = [field(data, key, int) for key in limits]  # each checked, the first given counts
    merged["num_predict"] = next((n for n in given if n is not None), None)
    return merged


class _Answer:
    """One answer's id, creation time and object kind, shared by its chunks."""

    def __init__(self, c: Completion) -> None:
        self.c, self.created = c, int(time.time())
        self.ident = f"{'chatcmpl' if c.chat else 'cmpl'}-{uuid.uuid4().hex[:24]}"
        self.kind = "chat.completion" if c.chat else "text_completion"
        self.calls = 0  # tool calls sent so far (their stream index; the finish reason)

    def envelope(self, choices: list[dict[str, Any]], chunked: bool, **extra: Any) -> dict[str, Any]:
        return {"id": self.ident, "object": self.kind + (".chunk" if chunked and self.c.chat else ""),
                "created": self.created, "model": self.c.model, "system_fingerprint": "fp_gemmaforge",
                "choices": choices, **extra}

    def choice(self, pieces: Pieces | None, reason: str | None, chunked: bool,
               logprobs: Sequence[TokenLogprob] = ()) -> dict[str, Any]:
        if not self.c.chat:
            return {"text": pieces.content if pieces else "", "index": 0, "logprobs": self.text_logprobs(logprobs),
                    "finish_reason": reason}
        key = "delta" if chunked else "message"
        if pieces is None:
            return {"index": 0, key: {}, "finish_reason": reason}
        listed = None if self.c.logprobs is None else {"content": [logprob_json(x) for x in logprobs], "refusal": None}
        message: dict[str, Any] = {} if chunked else {"role": "assistant"}
        if pieces.content or not chunked:
            message["content"] = pieces.content or (None if pieces.tool_calls else "")
        if pieces.thinking:
            message["reasoning_content"] = pieces.thinking
        if pieces.tool_calls:
            message["tool_calls"] = [self.call(call, chunked) for call in pieces.tool_calls]
        return {"index": 0, key: message, "logprobs": listed, "finish_reason": reason}

    def text_logprobs(self, logprobs: Sequence[TokenLogprob]) -> dict[str, Any] | None:
        """/v1/completions' logprobs: the tokens, theirs, the likeliest at each position and where each token's
        text starts in the answer (counted from this chunk's text when streamed, as OpenAI counts)."""
        if self.c.logprobs is None:
            return None
        offsets = list(itertools.accumulate((len(x.token) for x in logprobs), initial=0))[:-1]
        return {"tokens": [x.token for x in logprobs], "token_logprobs": [x.logprob for x in logprobs],
                "top_logprobs": [{c.token: c.logprob for c in x.top} for x in logprobs], "text_offset": offsets}

    def call(self, call: ToolCall, chunked: bool) -> dict[str, Any]:
        self.calls += 1
        function = {"name": call["name"], "arguments": json.dumps(call["arguments"], ensure_ascii=False)}
        return {**({"index": self.calls - 1} if chunked else {}), "id": f"call_{uuid.uuid4().hex[:24]}",
                "type": "function", "function": function}

    def finish_reason(self, f: Finished) -> str:
        return "length" if f.reason == "length" else "tool_calls" if self.calls else "stop"


def usage(f: Finished) -> dict[str, int]:
    return {"prompt_tokens": f.prompt_tokens, "completion_tokens": f.completion_tokens,
            "total_tokens": f.prompt_tokens + f.completion_tokens}


def sse(obj: dict[str, Any], event: str | None = None) -> bytes:
    """A server-sent event: its data, after the event's name where the API names them (the Responses API)."""
    head = f"event: {event}\n" if event else ""
    return f"{head}data: {json.dumps(obj, ensure_ascii=False)}\n\n".encode()
