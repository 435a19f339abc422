"""Anthropic's dialect: /v1/messages bodies (the Messages API that coding agents speak) parsed into a Completion,
events rendered back as Anthropic streams them (server-sent events from message_start to message_stop) or as one
message, in the shapes of Ollama's own Anthropic layer.

Content blocks become the chat Messages every dialect renders: text and base64 images in their order, tool_use
blocks as the assistant's tool calls, each tool_result block as a tool message naming the function of the tool_use
it answers, thinking blocks as the assistant's thinking."""

from __future__ import annotations

import hashlib
import json
import uuid
from collections.abc import AsyncIterator, Iterator
from typing import Any

from gemmaforge.chat.conversation import Message
from gemmaforge.chat.reading import Pieces
from gemmaforge.chat.tools import Tool, ToolCall, normalize_call, normalize_tool
from gemmaforge.inference.jobs import Delta, Event, Finished, TokenLogprob
from gemmaforge.serve.ollama_api import options_of
from gemmaforge.serve.openai_api import sse, tool_choice
from gemmaforge.serve.protocol import (
    Completion,
    Pictures,
    ServedModel,
    bad,
    chat_prompt,
    check_think,
    compact,
    each_message,
    field,
    images_in,
    json_schema,
    stops,
)

# the content blocks each role's messages may hold (redacted_thinking is accepted and dropped: it is encrypted)
_BLOCKS = {"user": ("text", "image", "tool_result"),
           "assistant": ("text", "tool_use", "thinking", "redacted_thinking")}
# an empty block of each kind a stream opens before its deltas fill it
_OPENED = {"thinking": {"type": "thinking", "thinking": "", "signature": ""}, "text": {"type": "text", "text": ""}}
_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error",
                503: "overloaded_error", 529: "overloaded_error"}


class AnthropicDialect:
    media_type = "text/event-stream"

    def parse(self, data: dict[str, Any], served: ServedModel, chat: bool = True) -> Completion:
        max_tokens = field(data, "max_tokens", int)
        if max_tokens is None:
            raise bad("max_tokens: required (the Messages API asks every request for its limit)")
        if max_tokens < 1:
            raise bad(f"max_tokens: must be at least 1, got {max_tokens}")
        prompt, images, tools = self.prompt(data, served)
        # as Ollama's Anthropic layer: the sampling fields a request gives, over the model's defaults
        sampling = {key: data.get(key) for key in ("temperature", "top_p", "top_k")}
        return Completion(data["model"], prompt, True, field(data, "stream", bool, False),
                          options_of(served, {**sampling, "num_predict": max_tokens}, where=""),
                          stops(data, key="stop_sequences"), grammar=output_format(data), reading=served.family.chat,
                          tools=bool(tools), images=images)

    def prompt(self, data: dict[str, Any], served: ServedModel) -> tuple[str, tuple[Any, ...], list[Tool]]:
        """The request's prompt in the served model's template, its decoded images and the tools it offers: what a
        completion continues, and what /v1/messages/count_tokens counts."""
        think = thinking_of(data, served)
        tools = tools_of(data) if tool_choice({"tool_choice": choice_of(data)}) == "auto" else []
        messages = [*system_of(data), *_Turns(served.family.chat.image).read(data)]
        return chat_prompt(served, messages, tools, think), images_in(messages), tools

    async def stream(self, c: Completion, events: AsyncIterator[Event]) -> AsyncIterator[bytes]:
        blocks = _Blocks()
        reader = c.reader()
        start = envelope(c, blocks.ident, [], {"stop_reason": None, "stop_sequence": None},
                         {"input_tokens": c.prompt_tokens, "output_tokens": 0})
        yield sse_event({"type": "message_start", "message": start})
        async for event in events:
            if isinstance(event, Delta):
                for chunk in blocks.add(reader.feed(event.text) if reader else Pieces(event.text)):
                    yield chunk
            elif isinstance(event, Finished):
                for chunk in blocks.add(reader.finish() if reader else Pieces()):
                    yield chunk
                for chunk in blocks.end(event):
                    yield chunk
            else:
                yield sse_event(error_body(500, event.message))

    def whole(self, c: Completion, text: str, end: Finished,
              logprobs: tuple[TokenLogprob, ...] = ()) -> dict[str, Any]:  # the Messages API has no logprobs
        pieces = c.read_whole(text)
        content = [thinking_block(pieces.thinking)] if pieces.thinking else []
        content += [{"type": "text", "text": pieces.content}] if pieces.content else []
        content += [tool_use(call) for call in pieces.tool_calls]
        return envelope(c, f"msg_{uuid.uuid4().hex[:24]}", content, stop(end, bool(pieces.tool_calls)), usage(end))


# ---------------------------------------------------------------------------- the request


class _Turns:
    """Anthropic's messages as chat Messages, read in order: a tool_result names the function of the tool_use (in
    an earlier assistant message) that it answers, as the Gemma templates write results."""

    def __init__(self, placeholder: str) -> None:
        self.placeholder, self.pictures = placeholder, Pictures()
        self.called: dict[str, str] = {}  # tool_use id -> the function it called

    def read(self, data: dict[str, Any]) -> list[Message]:
        out = []
        for where, m in each_message(data):
            role = field(m, "role", str, where=where)
            if role not in _BLOCKS:
                raise bad(f"{where}role: {role!r} is not supported; expected user or assistant (the system prompt "
                          "is the request's top-level system)")
            blocks = content_blocks(m.get("content"), f"{where}content", _BLOCKS[role])
            turn = self.user(blocks) if role == "user" else [self.assistant(blocks)]
            out += [compact(message) for message in turn]
        return out

    def user(self, blocks: list[tuple[str, dict[str, Any]]]) -> list[Message]:
        """The tool results first (Anthropic puts them first in the user's turn), then what the user wrote."""
        results = [self.result(block, at) for at, block in blocks if block["type"] == "tool_result"]
        text, images = self.parts([(at, block) for at, block in blocks if block["type"] != "tool_result"])
        said = text or images or not results
        return [*results, *([{"role": "user", "content": text, "images": images}] if said else [])]

    def assistant(self, blocks: list[tuple[str, dict[str, Any]]]) -> Message:
        text, _ = self.parts([(at, block) for at, block in blocks if block["type"] == "text"])
        thinking = "".join(field(block, "thinking", str, "", at) for at, block in blocks if block["type"] == "thinking")
        calls = [self.call(block, at) for at, block in blocks if block["type"] == "tool_use"]
        return {"role": "assistant", "content": text, "tool_calls": calls, "thinking": thinking}

    def parts(self, blocks: list[tuple[str, dict[str, Any]]]) -> tuple[str, list[Any]]:
        """Text and image blocks as one text with the chat format's placeholder where each image goes."""
        texts, images = [], []
        for at, block in blocks:
            if block["type"] == "text":
                texts.append(field(block, "text", str, "", at))
            else:
                images.append(self.image(block, at))
                texts.append(self.placeholder)
        return "".join(texts), images

    def image(self, block: dict[str, Any], where: str) -> Any:
        source = field(block, "source", dict, {}, where)
        kind = field(source, "type", str, None, f"{where}source.")
        if kind == "url":
            raise bad(f"{where}source: remote URLs are not fetched by this server; send the image itself as "
                      '{"type": "base64", "media_type": ..., "data": ...}')
        if kind != "base64":
            raise bad(f"{where}source.type: expected \"base64\", got {kind!r}")
        return self.pictures.decode(field(source, "data", str, "", f"{where}source."), f"{where}source.data")

    def call(self, block: dict[str, Any], where: str) -> ToolCall:
        ident = field(block, "id", str, "", where)
        if not ident:
            raise bad(f"{where}id: required (the tool_result that answers this call names it)")
        try:
            call = normalize_call({"id": ident, "name": field(block, "name", str, "", where),
                                   "arguments": field(block, "input", dict, {}, where)}, where.removesuffix("."))
        except ValueError as e:
            raise bad(str(e)) from None
        self.called[ident] = call["name"]
        return call

    def result(self, block: dict[str, Any], where: str) -> Message:
        ident = field(block, "tool_use_id", str, "", where)
        if not ident:
            raise bad(f"{where}tool_use_id: required (the id of the tool_use this result answers)")
        content = block.get("content")
        text, images = self.parts(content_blocks("" if content is None else content, f"{where}content",
                                                 ("text", "image")))
        if field(block, "is_error", bool, False, where):  # the templates have no error flag: the text says it
            text = f"Error: {text}"
        return {"role": "tool", "content": text, "images": images, "name": self.called.get(ident, ""),
                "tool_call_id": ident}


def content_blocks(content: Any, where: str, allowed: tuple[str, ...]) -> list[tuple[str, dict[str, Any]]]:
    """`content` (a string, or content blocks of the `allowed` types) as (where each block is, the block)."""
    if isinstance(content, str):
        return [(f"{where}.", {"type": "text", "text": content})]
    if not isinstance(content, list):
        raise bad(f"{where}: expected a string or an array of content blocks")
    out = []
    for j, block in enumerate(content):
        kind = block.get("type") if isinstance(block, dict) else None
        if kind not in allowed:
            raise bad(f"{where}[{j}].type: {kind!r} blocks are not supported here; expected one of "
                      f"{', '.join(allowed)}")
        out.append((f"{where}[{j}].", block))
    return out


def system_of(data: dict[str, Any]) -> list[Message]:
    """The top-level system prompt (a string or text blocks, joined as Ollama joins them); none when it is empty, so
    that the served model's own system prompt applies."""
    system = data.get("system")
    text = "".join(field(block, "text", str, "", at) for at, block in content_blocks(
        "" if system is None else system, "system", ("text",)))
    return [{"role": "system", "content": text}] if text else []


def tools_of(data: dict[str, Any]) -> list[Tool]:
    return [_tool(tool, f"tools[{i}]") for i, tool in enumerate(field(data, "tools", list, []))]


def _tool(tool: Any, where: str) -> Tool:
    """A client tool ({"name", "description", "input_schema"}) in the shape the chat formats render."""
    if not isinstance(tool, dict):
        raise bad(f"{where}: expected a tool object with name, description and input_schema")
    kind = field(tool, "type", str, "custom", f"{where}.")
    if kind != "custom":
        raise bad(f"{where}.type: {kind!r} is a server tool, which this server does not run; define the tool "
                  "with name, description and input_schema and run it on the client")
    if not field(tool, "name", str, "", f"{where}."):
        raise bad(f"{where}.name: required")
    function = {"name": tool["name"], "description": field(tool, "description", str, "", f"{where}."),
                "parameters": field(tool, "input_schema", dict, None, f"{where}.")}
    try:
        return normalize_tool({k: v for k, v in function.items() if v}, where)
    except ValueError as e:  # the schema checks name OpenAI's field: name Anthropic's
        raise bad(str(e).replace(": parameters", ".input_schema", 1)) from None


def choice_of(data: dict[str, Any]) -> str:
    """tool_choice's type: "auto" (the default) or "none" (checked by the OpenAI dialect's rule)."""
    return str(field(field(data, "tool_choice", dict, {}), "type", str, "auto", "tool_choice."))


def thinking_of(data: dict[str, Any], served: ServedModel) -> bool:
    """`thinking`: enabled (a model that does not think refuses it), disabled, or adaptive (on where the model
    thinks). budget_tokens is checked, not enforced: Gemma's thinking has no budget, max_tokens bounds it all."""
    config = field(data, "thinking", dict, {})
    kind = field(config, "type", str, "disabled", "thinking.")
    field(config, "budget_tokens", int, None, "thinking.")
    if kind == "adaptive":
        return served.family.chat.thinking
    if kind not in ("enabled", "disabled"):
        raise bad(f"thinking.type: {kind!r} is not supported; expected enabled, disabled or adaptive")
    return check_think(served, kind == "enabled", key="thinking")


def output_format(data: dict[str, Any]) -> str | None:
    """Structured output: output_config.format {"type": "json_schema", "schema"} (the grammar holds the answer)."""
    spec = field(field(data, "output_config", dict, {}), "format", dict, None, "output_config.")
    if spec is None:
        return None
    kind = field(spec, "type", str, None, "output_config.format.")
    if kind != "json_schema":
        raise bad(f"output_config.format.type: expected \"json_schema\", got {kind!r}")
    return json_schema(spec.get("schema"), "output_config.format.schema")


# ---------------------------------------------------------------------------- the answer


class _Blocks:
    """A streamed answer's content blocks: each piece of thinking or text extends the open block of its kind or
    closes the open one and starts its own; each tool call is a block of its own (its input as one JSON delta)."""

    def __init__(self) -> None:
        self.ident = f"msg_{uuid.uuid4().hex[:24]}"
        self.index = -1  # of the latest block
        self.open: str | None = None  # the type of the block still open
        self.thought: list[str] = []  # the open thinking block's text (for its signature)
        self.called = False

    def add(self, pieces: Pieces) -> Iterator[bytes]:
        if pieces.thinking:
            self.thought.append(pieces.thinking)
            yield from self._extend("thinking", {"type": "thinking_delta", "thinking": pieces.thinking})
        if pieces.content:
            yield from self._extend("text", {"type": "text_delta", "text": pieces.content})
        for call in pieces.tool_calls:
            block = tool_use(call)
            yield from self._start({**block, "input": {}})
            yield self._delta({"type": "input_json_delta", "partial_json": json.dumps(call["arguments"],
                                                                                      ensure_ascii=False)})
            yield from self._close()
            self.called = True

    def end(self, f: Finished) -> Iterator[bytes]:
        yield from self._close()
        yield sse_event({"type": "message_delta", "delta": stop(f, self.called), "usage": usage(f)})
        yield sse_event({"type": "message_stop"})

    def _extend(self, kind: str, delta: dict[str, Any]) -> Iterator[bytes]:
        if self.open != kind:
            yield from self._start(_OPENED[kind])
        yield self._delta(delta)

    def _start(self, block: dict[str, Any]) -> Iterator[bytes]:
        yield from self._close()
        self.index += 1
        self.open = block["type"]
        yield sse_event({"type": "content_block_start", "index": self.index, "content_block": block})

    def _close(self) -> Iterator[bytes]:
        if self.open == "thinking":
            yield self._delta({"type": "signature_delta", "signature": signature("".join(self.thought))})
            self.thought = []
        if self.open is not None:
            yield sse_event({"type": "content_block_stop", "index": self.index})
        self.open = None

    def _delta(self, delta: dict[str, Any]) -> bytes:
        return sse_event({"type": "content_block_delta", "index": self.index, "delta": delta})


def envelope(c: Completion, ident: str, content: list[dict[str, Any]], stopped: dict[str, Any],
             counts: dict[str, int]) -> dict[str, Any]:
    """A message (whole, or message_start's) in Anthropic's shape."""
    return {"id": ident, "type": "message", "role": "assistant", "model": c.model, "content": content, **stopped,
            "usage": counts}


def stop(f: Finished, called: bool) -> dict[str, Any]:
    """stop_reason and stop_sequence: a tool call ends the turn for its result (as in Ollama's layer)."""
    if called:
        return {"stop_reason": "tool_use", "stop_sequence": None}
    if f.reason == "length":
        return {"stop_reason": "max_tokens", "stop_sequence": None}
    if f.stop_sequence is not None:
        return {"stop_reason": "stop_sequence", "stop_sequence": f.stop_sequence}
    return {"stop_reason": "end_turn", "stop_sequence": None}


def usage(f: Finished) -> dict[str, int]:
    return {"input_tokens": f.prompt_tokens, "output_tokens": f.completion_tokens}


def thinking_block(thinking: str) -> dict[str, Any]:
    return {"type": "thinking", "thinking": thinking, "signature": signature(thinking)}


def signature(thinking: str) -> str:
    """A thinking block's signature: clients send it back with the block, and this server reads the thinking as
    sent (it is never checked), so it is only the thought's digest."""
    return hashlib.sha256(thinking.encode()).hexdigest()


def tool_use(call: ToolCall) -> dict[str, Any]:
    return {"type": "tool_use", "id": f"toolu_{uuid.uuid4().hex[:24]}", "name": call["name"],
            "input": call["arguments"]}


def error_body(status: int, message: str) -> dict[str, Any]:
    """An error in Anthropic's shape, its type from the status as Ollama's Anthropic layer picks it."""
    kind = _ERROR_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": message}}


def sse_event(data: dict[str, Any]) -> bytes:
    """An Anthropic server-sent event: named after its data's type."""
    return sse(data, data["type"])
