"""Ollama's dialect: /api/chat and /api/generate bodies parsed into a Completion, events rendered back as
Ollama streams them (one JSON object a line, the last with the counts and timings) or as one object."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from datetime import UTC, datetime
from typing import Any

from gemmaforge.chat.reading import Pieces
from gemmaforge.inference.jobs import Delta, Event, Finished, TokenLogprob
from gemmaforge.serve.protocol import (
    OLLAMA_DEFAULTS,
    Completion,
    LoadOnly,
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
    refuse_unsupported,
    sounds_in,
    stops,
    tools_of,
)

# Ollama sampling options this server does not implement, with the value that leaves the answer unchanged: any
# other value is refused. Options about the runtime (num_thread, num_gpu, num_batch, use_mmap, ...) are ignored.
_NEUTRAL_OPTIONS = {"frequency_penalty": 0, "presence_penalty": 0, "mirostat": 0, "typical_p": 1, "tfs_z": 1}


class OllamaDialect:
    media_type = "application/x-ndjson"

    def parse(self, data: dict[str, Any], served: ServedModel, chat: bool) -> Completion | LoadOnly:
        refuse_unsupported(data)
        if not (data.get("messages") if chat else data.get("prompt") or data.get("raw")):  # loads the model
            empty = {"message": {"role": "assistant", "content": ""}} if chat else {"response": ""}
            return LoadOnly({"model": data["model"], "created_at": now(), **empty, "done": True, "done_reason": "load"})
        think, tools = think_of(data), tools_of(data) if chat else []
        if chat:
            messages = messages_of(data, served.family.chat.image, audio=served.family.chat.audio)
            prompt, images, sounds = chat_prompt(served, messages, tools, think), images_in(messages), \
                sounds_in(messages)
        else:
            if data.get("tools"):
                raise bad("tools: /api/generate takes no tools; use /api/chat")
            prompt, images, sounds = generate_prompt(served, data, think)
        options = field(data, "options", dict, {})
        raw = not chat and field(data, "raw", bool, False)
        return Completion(data["model"], prompt, chat, field(data, "stream", bool, True), options_of(served, options),
                          stops(options, "options."), grammar=format_of(data),
                          reading=None if raw else served.family.chat, tools=bool(tools), images=images,
                          sounds=sounds, logprobs=logprobs_of(data))

    async def stream(self, c: Completion, events: AsyncIterator[Event]) -> AsyncIterator[bytes]:
        reader = c.reader()
        calls = 0
        pending: list[TokenLogprob] = []  # of text the reader holds back: sent with the next chunk
        async for event in events:
            if isinstance(event, Delta):
                pieces = reader.feed(event.text) if reader else Pieces(event.text)
                pending += event.logprobs
                if pieces.content or pieces.thinking or pieces.tool_calls:
                    yield ndjson(_chunk(c, pieces, calls, done=False, **_logprobs(c, pending)))
                    calls += len(pieces.tool_calls)
                    pending = []
            elif isinstance(event, Finished):
                pieces = reader.finish() if reader else Pieces()
                if pieces.content or pieces.thinking or pieces.tool_calls:
                    yield ndjson(_chunk(c, pieces, calls, done=False, **_logprobs(c, pending)))
                    pending = []
                yield ndjson(_chunk(c, Pieces(), 0, **_final(c, event), **_logprobs(c, pending)))
            else:
                yield ndjson({"error": event.message})

    def whole(self, c: Completion, text: str, end: Finished,
              logprobs: tuple[TokenLogprob, ...] = ()) -> dict[str, Any]:
        pieces = c.read_whole(text)
        return _chunk(c, pieces, 0, **_final(c, end), **_logprobs(c, logprobs))


def _logprobs(c: Completion, logprobs: Sequence[TokenLogprob]) -> dict[str, Any]:
    """Ollama's `logprobs` of a chunk's tokens, when the request asked for them."""
    return {} if c.logprobs is None else {"logprobs": [logprob_json(x) for x in logprobs]}


def think_of(data: dict[str, Any]) -> bool:
    """Ollama's `think`: true/false, or a level ("high", "medium", "low") that Gemma takes as on."""
    value = field(data, "think", (bool, str), False)
    if isinstance(value, str) and value not in ("high", "medium", "low"):
        raise bad(f"think: {value!r} is not supported; expected true, false, high, medium or low")
    return bool(value)


def format_of(data: dict[str, Any]) -> str | None:
    """Ollama's `format`: "json" (JSON mode) or a JSON schema (what the ollama client sends for a pydantic model)."""
    value = data.get("format")
    if value in (None, ""):
        return None
    if value == "json":
        return "json"
    return json_schema(value, "format")


def options_of(served: ServedModel, options: dict[str, Any], where: str = "options.") -> dict[str, Any]:
    """A request's `options` over the served model's Modelfile defaults over Ollama's own (`where`: how errors name
    them; Anthropic's dialect passes its top-level sampling fields, as Ollama's Anthropic layer does)."""
    for key, neutral in _NEUTRAL_OPTIONS.items():
        if field(options, key, float, neutral, where) != neutral:
            raise bad(f"{where}{key}: not supported (leave it out or use {neutral}); the repeat penalty is "
                      "options.repeat_penalty with options.repeat_last_n")
    merged = {**OLLAMA_DEFAULTS, **served.options}
    for key in ("temperature", "top_p", "min_p", "repeat_penalty"):
        merged[key] = float(field(options, key, float, merged[key], where))
    for key in ("top_k", "repeat_last_n", "seed", "num_predict", "num_ctx"):
        merged[key] = field(options, key, int, merged.get(key), where)
    return merged


def _chunk(c: Completion, pieces: Pieces, first_call: int, **extra: Any) -> dict[str, Any]:
    if c.chat:
        message: dict[str, Any] = {"role": "assistant", "content": pieces.content}
        if pieces.thinking:
            message["thinking"] = pieces.thinking
        if pieces.tool_calls:
            message["tool_calls"] = [{"id": f"call_{uuid.uuid4().hex[:8]}", "function": {
                "index": first_call + i, "name": call["name"], "arguments": call["arguments"]}}
                for i, call in enumerate(pieces.tool_calls)]
        content: dict[str, Any] = {"message": message}
    else:
        content = {"response": pieces.content, **({"thinking": pieces.thinking} if pieces.thinking else {})}
    return {"model": c.model, "created_at": now(), **content, **extra}


def _final(c: Completion, f: Finished) -> dict[str, Any]:
    return {"done": True, "done_reason": f.reason, "total_duration": time.perf_counter_ns() - c.started_ns,
            "load_duration": 0, "prompt_eval_count": f.prompt_tokens, "prompt_eval_duration": f.prompt_ns,
            "eval_count": f.completion_tokens, "eval_duration": f.eval_ns}


def now() -> str:
    return datetime.now(UTC).isoformat().replace("+00:00", "Z")


def ndjson(obj: dict[str, Any]) -> bytes:
    return (json.dumps(obj, ensure_ascii=False) + "\n").encode()
