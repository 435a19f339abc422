"""OpenAI's dialect: /v1/chat/completions and /v1/completions bodies parsed into a Completion, events rendered
back as server-sent events (chunks, then [DONE]) or as one completion object, in the shapes of Ollama's own
OpenAI layer."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from gemmaforge.chat.reading import Pieces
from gemmaforge.chat.tools import ToolCall
from gemmaforge.inference.jobs import Delta, Event, Finished
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
    messages_of,
    stops,
    tools_of,
)


class OpenAIDialect:
    media_type = "text/event-stream"

    def parse(self, data: dict[str, Any], served: ServedModel, chat: bool) -> Completion:
        tools: list[Any] = []
        images: tuple[Any, ...] = ()
        if chat:
            tools = tools_of(data) if tool_choice(data) == "auto" else []
            messages = messages_of(data, served.family.chat.image, openai=True)
            prompt, images = chat_prompt(served, messages, tools, think_of(data)), images_in(messages)
        elif isinstance(data.get("prompt"), str):
            prompt, _ = generate_prompt(served, {"prompt": data["prompt"]})
        else:
            raise bad("prompt: expected a string")
        stream = field(data, "stream", bool, False)
        include_usage = stream and field(field(data, "stream_options", dict, {}), "include_usage", bool, False,
                                         "stream_options.")
        return Completion(data["model"], prompt, chat, stream, options_of(served, data), stops(data), include_usage,
                          grammar=response_format(data), reading=served.family.chat if chat else None,
                          tools=bool(tools), images=images)

    async def stream(self, c: Completion, events: AsyncIterator[Event]) -> AsyncIterator[bytes]:
        answer = _Answer(c)
        reader = c.reader()
        if c.chat:
            yield sse(answer.envelope([{"index": 0, "delta": {"role": "assistant", "content": ""},
                                        "finish_reason": None}], True))
        async for event in events:
            if isinstance(event, Delta):
                pieces = reader.feed(event.text) if reader else Pieces(event.text)
                if pieces.content or pieces.thinking or pieces.tool_calls or not c.chat:
                    yield sse(answer.envelope([answer.choice(pieces, None, True)], True))
            elif isinstance(event, Finished):
                pieces = reader.finish() if reader else Pieces()
                if pieces.content or pieces.thinking or pieces.tool_calls:
                    yield sse(answer.envelope([answer.choice(pieces, None, True)], True))
                yield sse(answer.envelope([answer.choice(None if c.chat else Pieces(), answer.finish_reason(event),
                                                         True)], True))
                if c.include_usage:
                    yield sse(answer.envelope([], True, usage=usage(event)))
            else:
                yield sse({"error": {"message": event.message, "type": "api_error", "param": None, "code": None}})
        yield b"data: [DONE]\n\n"

    def whole(self, c: Completion, text: str, end: Finished) -> dict[str, Any]:
        answer = _Answer(c)
        pieces = c.read_whole(text)
        choice = answer.choice(pieces, None, False)
        return answer.envelope([{**choice, "finish_reason": answer.finish_reason(end)}], False, usage=usage(end))


def tool_choice(data: dict[str, Any]) -> str:
    """OpenAI's tool_choice: "auto" (the default) offers the tools, "none" does not; forcing calls is not
    something the chat template can express."""
    choice = data.get("tool_choice", "auto")
    if choice not in ("auto", "none"):
        raise bad("tool_choice: only \"auto\" and \"none\" are supported (the model decides whether to call)")
    return str(choice)


def think_of(data: dict[str, Any]) -> bool:
    """Thinking as OpenAI-compatible servers take it: reasoning_effort (or reasoning.effort) other than "none"."""
    effort = field(data, "reasoning_effort", str)
    if effort is None:
        effort = field(field(data, "reasoning", dict, {}), "effort", str, None, "reasoning.")
    if effort is not None and effort not in ("none", "minimal", "low", "medium", "high"):
        raise bad(f"reasoning_effort: {effort!r} is not supported; expected none, minimal, low, medium or high")
    return effort not in (None, "none")


def response_format(data: dict[str, Any]) -> str | None:
    """OpenAI's response_format: text, json_object (JSON mode) or json_schema (its `schema`, strict or not: the
    grammar holds every answer to the schema either way)."""
    spec = field(data, "response_format", dict, {})
    kind = field(spec, "type", str, "text", "response_format.")
    if kind == "text":
        return None
    if kind == "json_object":
        return "json"
    if kind == "json_schema":
        schema = field(spec, "json_schema", dict, {}, "response_format.")
        return json_schema(schema.get("schema"), "response_format.json_schema.schema")
    raise bad(f"response_format.type: {kind!r} is not supported; expected text, json_object or json_schema")


def options_of(served: ServedModel, data: dict[str, Any]) -> dict[str, Any]:
    """As Ollama's OpenAI layer: temperature and top_p default to 1.0; max_tokens is num_predict."""
    for key in ("frequency_penalty", "presence_penalty"):
        if field(data, key, float, 0.0):
            raise bad(f"{key}: not supported (use 0); repeat penalties are set through the Ollama API's options")
    if field(data, "n", int, 1) != 1:
        raise bad("n: only one choice per request is supported")
    merged = {**OLLAMA_DEFAULTS, **served.options, "temperature": 1.0, "top_p": 1.0}
    for key in ("temperature", "top_p"):
        merged[key] = float(field(data, key, float, merged[key]))
    merged["seed"] = field(data, "seed", int)
    merged["num_predict"] = field(data, "max_completion_tokens", int, field(data, "max_tokens", int))
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

    def choice(self, pieces: Pieces | None, reason: str | None, chunked: bool) -> dict[str, Any]:
        if not self.c.chat:
            return {"text": pieces.content if pieces else "", "index": 0, "logprobs": None, "finish_reason": reason}
        key = "delta" if chunked else "message"
        if pieces is None:
            return {"index": 0, key: {}, "finish_reason": reason}
        message: dict[str, Any] = {} if chunked else {"role": "assistant"}
        if pieces.content or not chunked:
            message["content"] = pieces.content or (None if pieces.tool_calls else "")
        if pieces.thinking:
            message["reasoning_content"] = pieces.thinking
        if pieces.tool_calls:
            message["tool_calls"] = [self.call(call, chunked) for call in pieces.tool_calls]
        return {"index": 0, key: message, "finish_reason": reason}

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


def sse(obj: dict[str, Any]) -> bytes:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n".encode()
