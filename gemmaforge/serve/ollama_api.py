"""Ollama's dialect: /api/chat and /api/generate bodies parsed into a Completion, events rendered back as
Ollama streams them (one JSON object a line, the last with the counts and timings) or as one object."""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from typing import Any

from gemmaforge.inference.jobs import Delta, Event, Finished
from gemmaforge.serve.protocol import (
    OLLAMA_DEFAULTS,
    Completion,
    bad,
    chat_prompt,
    field,
    generate_prompt,
    json_schema,
    messages_of,
    refuse_unsupported,
    stops,
)
from gemmaforge.serve.registry import Served

# Ollama sampling options this server does not implement, with the value that leaves the answer unchanged: any
# other value is refused. Options about the runtime (num_thread, num_gpu, num_batch, use_mmap, ...) are ignored.
_NEUTRAL_OPTIONS = {"frequency_penalty": 0, "presence_penalty": 0, "mirostat": 0, "typical_p": 1, "tfs_z": 1}


class OllamaDialect:
    media_type = "application/x-ndjson"

    def parse(self, data: dict[str, Any], served: Served, chat: bool) -> Completion | dict[str, Any]:
        refuse_unsupported(data)
        if not (data.get("messages") if chat else data.get("prompt") or data.get("raw")):  # loads the model
            empty = {"message": {"role": "assistant", "content": ""}} if chat else {"response": ""}
            return {"model": data["model"], "created_at": now(), **empty, "done": True, "done_reason": "load"}
        prompt = chat_prompt(served, messages_of(data)) if chat else generate_prompt(served, data)
        options = field(data, "options", dict, {})
        return Completion(data["model"], prompt, chat, field(data, "stream", bool, True), options_of(served, options),
                          stops(options, "options."), grammar=format_of(data))

    async def stream(self, c: Completion, events: AsyncIterator[Event]) -> AsyncIterator[bytes]:
        async for event in events:
            if isinstance(event, Delta):
                yield ndjson(_chunk(c, event.text, done=False))
            elif isinstance(event, Finished):
                yield ndjson(_chunk(c, "", **_final(c, event)))
            else:
                yield ndjson({"error": event.message})

    def whole(self, c: Completion, text: str, end: Finished) -> dict[str, Any]:
        return _chunk(c, text, **_final(c, end))


def format_of(data: dict[str, Any]) -> str | None:
    """Ollama's `format`: "json" (JSON mode) or a JSON schema (what the ollama client sends for a pydantic model)."""
    value = data.get("format")
    if value in (None, ""):
        return None
    if value == "json":
        return "json"
    return json_schema(value, "format")


def options_of(served: Served, options: dict[str, Any]) -> dict[str, Any]:
    """A request's `options` over the served model's Modelfile defaults over Ollama's own."""
    where = "options."
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


def _chunk(c: Completion, text: str, **extra: Any) -> dict[str, Any]:
    content = {"message": {"role": "assistant", "content": text}} if c.chat else {"response": text}
    return {"model": c.model, "created_at": now(), **content, **extra}


def _final(c: Completion, f: Finished) -> dict[str, Any]:
    return {"done": True, "done_reason": f.reason, "total_duration": time.perf_counter_ns() - c.started_ns,
            "load_duration": 0, "prompt_eval_count": f.prompt_tokens, "prompt_eval_duration": f.prompt_ns,
            "eval_count": f.completion_tokens, "eval_duration": f.eval_ns}


def now() -> str:
    return datetime.now(UTC).isoformat().replace("+00:00", "Z")


def ndjson(obj: dict[str, Any]) -> bytes:
    return (json.dumps(obj, ensure_ascii=False) + "\n").encode()
