"""OpenAI's Responses API, POST /v1/responses, stateless as Ollama's own: `instructions` and the `input` items
(messages, function calls and their outputs, reasoning passed back) are parsed into a Completion in the training
template; the answer is rendered back as one `response` object (reasoning, message and function_call output
items) or as the API's named server-sent events, in the shapes of Ollama's Responses layer and of the official
openai client's types (its stream accumulator takes the events). Nothing is stored: a request that names an
earlier response is refused."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from dataclasses import field as dataclass_field
from typing import Any

from gemmaforge.chat.conversation import Message
from gemmaforge.chat.reading import Pieces
from gemmaforge.chat.tools import Tool, ToolCall, normalize_call, normalize_tool
from gemmaforge.inference.jobs import MAX_TOP_LOGPROBS, Delta, Event, Finished, TokenLogprob
from gemmaforge.serve.openai_api import options_of, output_format, sse, think_of, tool_choice
from gemmaforge.serve.protocol import (
    Completion,
    Pictures,
    ServedModel,
    bad,
    chat_prompt,
    data_uri_image,
    field,
    images_in,
    logprob_json,
)

NOT_STORED = ("responses are not stored by this server (it is stateless, as Ollama's is): send the whole "
              "conversation as input")
# request fields whose meaning needs what a stateless server does not keep or do: refused when set, not ignored
REFUSED = {
    "previous_response_id": NOT_STORED,
    "conversation": NOT_STORED,
    "background": "background responses are not supported (nothing is kept to poll); stream instead",
    "prompt": "stored prompt templates are not supported; send instructions and input",
    "max_tool_calls": "not supported; the model decides how many functions to call",
}
LOGPROBS = "message.output_text.logprobs"  # the `include` that asks for the answer's log-probabilities
ITEMS = "message, function_call, function_call_output or reasoning"
ROLES = ("user", "system", "developer", "assistant")
SUMMARIES = ("auto", "concise", "detailed")


@dataclass(frozen=True)
class ResponsesCompletion(Completion):
    echo: dict[str, Any] = dataclass_field(default_factory=dict)  # the request's settings each response repeats


class ResponsesDialect:
    media_type = "text/event-stream"

    def parse(self, data: dict[str, Any], served: ServedModel, chat: bool) -> Completion:
        """A Responses body as a chat completion: `tool_choice` "none" keeps the tools out of the prompt (they are
        still checked, and echoed); `reasoning.effort` other than "none" thinks."""
        for key, why in REFUSED.items():
            if data.get(key):
                raise bad(f"{key}: {why}")
        offered = function_tools(data)
        tools = offered if tool_choice(data) == "auto" else []
        messages = input_messages(data, served.family.chat.image)
        think, logprobs = think_of(data), logprobs_of(data)
        if think and logprobs is not None:  # the reader does not say which tokens wrote the thought
            raise bad(f"include: {LOGPROBS} is not supported together with reasoning")
        prompt = chat_prompt(served, messages, tools, think)
        options = options_of(served, data, ("max_output_tokens",))
        if options["num_predict"] is not None and options["num_predict"] < 1:
            raise bad("max_output_tokens: must be at least 1")
        text_format = field(field(data, "text", dict, {}), "format", dict, {"type": "text"}, "text.")
        return ResponsesCompletion(data["model"], prompt, True, field(data, "stream", bool, False), options,
                                   grammar=output_format(text_format, "text.format."), reading=served.family.chat,
                                   tools=bool(tools), images=images_in(messages), logprobs=logprobs,
                                   echo=echo_of(data, offered, options, text_format))

    async def stream(self, c: Completion, events: AsyncIterator[Event]) -> AsyncIterator[bytes]:
        writer, reader = Writer(c), c.reader()
        for out in writer.start():
            yield sse(out, out["type"])
        async for event in events:
            if isinstance(event, Delta):
                sent = writer.add(reader.feed(event.text) if reader else Pieces(event.text), event.logprobs)
            elif isinstance(event, Finished):
                sent = writer.add(reader.finish() if reader else Pieces()) + writer.finish(event)
            else:
                sent = writer.fail(event.message)
            for out in sent:
                yield sse(out, out["type"])

    def whole(self, c: Completion, text: str, end: Finished,
              logprobs: tuple[TokenLogprob, ...] = ()) -> dict[str, Any]:
        """The streamed answer's steps taken at once, and the response object they end with."""
        writer = Writer(c)
        events = writer.add(c.read_whole(text), logprobs) + writer.finish(end)
        response: dict[str, Any] = events[-1]["response"]
        return response


# ---------------------------------------------------------------------------- the request


def logprobs_of(data: dict[str, Any]) -> int | None:
    """The Responses API asks for log-probabilities with include ["message.output_text.logprobs"], and for the
    likeliest tokens at each position with top_logprobs (0-20): Completion.logprobs."""
    include = field(data, "include", list, [])
    top = field(data, "top_logprobs", int)
    if top is not None and not 0 <= top <= MAX_TOP_LOGPROBS:
        raise bad(f"top_logprobs: {top} is out of range [0, {MAX_TOP_LOGPROBS}]")
    return (top or 0) if LOGPROBS in include else None


def function_tools(data: dict[str, Any]) -> list[Tool]:
    """The Responses API's flat function tools ({"type": "function", "name", "description", "parameters"}) in the
    shape every chat format renders; the hosted tools (web search, files, computers, MCP) are OpenAI's to run."""
    tools = []
    for i, tool in enumerate(field(data, "tools", list, [])):
        where = f"tools[{i}]"
        if not isinstance(tool, dict):
            raise bad(f"{where}: expected a function tool {{\"type\": \"function\", \"name\", \"parameters\"}}")
        kind = field(tool, "type", str, None, f"{where}.")
        if kind != "function":
            raise bad(f"{where}.type: {kind!r} tools are not supported; only function tools, which the model calls "
                      "and the client runs")
        function = {key: tool[key] for key in ("name", "description", "parameters") if tool.get(key) is not None}
        try:
            tools.append(normalize_tool({"type": "function", "function": function}, where))
        except ValueError as e:
            raise bad(str(e)) from None
    return tools


def input_messages(data: dict[str, Any], placeholder: str) -> list[Message]:
    """`instructions` (the system prompt) and `input` (a user message, or the items of a conversation) as chat
    Messages, `placeholder` where each image goes (the decoded images under "images")."""
    instructions = field(data, "instructions", str)
    given = field(data, "input", (str, list))
    read = InputItems(placeholder)
    if instructions:
        read.messages.append({"role": "system", "content": instructions})
    if isinstance(given, str) and given:
        read.messages.append({"role": "user", "content": given})
    elif isinstance(given, list) and given:
        for i, item in enumerate(given):
            read.item(item, f"input[{i}]")
    else:
        raise bad("input: required, a non-empty string or array of input items")
    messages = read.done()
    if all(m["role"] == "system" for m in messages):
        raise bad("input: there is no user or assistant message to answer")
    return messages


class InputItems:
    """Input items read in order into chat messages: function_call items are an assistant's tool calls (those in a
    row, one message's), function_call_output items tool results, and a reasoning item is the thinking of the
    assistant message that follows it."""

    def __init__(self, placeholder: str) -> None:
        self.placeholder, self.pictures = placeholder, Pictures()
        self.messages: list[Message] = []
        self.thinking = ""  # a reasoning item's, until the next assistant message takes it
        self.names: dict[str, str] = {}  # call_id -> the function called

    def item(self, item: Any, where: str) -> None:
        if not isinstance(item, dict):
            raise bad(f"{where}: expected an input item (an object with a type)")
        kind = field(item, "type", str, "message" if "role" in item else None, f"{where}.")
        readers = {"message": self.message, "function_call": self.call, "function_call_output": self.output,
                   "reasoning": self.reasoning}
        if kind == "item_reference":
            raise bad(f"{where}: item references are not supported; {NOT_STORED}")
        if kind not in readers:
            raise bad(f"{where}.type: {'required' if kind is None else repr(kind) + ' is not supported'}; expected "
                      f"{ITEMS}")
        readers[kind](item, f"{where}.")

    def message(self, item: dict[str, Any], where: str) -> None:
        role = field(item, "role", str, None, where)
        if role not in ROLES:
            raise bad(f"{where}role: {role!r} is not supported; expected {', '.join(ROLES)}")
        role = "system" if role == "developer" else role
        content, images = self.content(item.get("content"), f"{where}content", role)
        self.add({"role": role, "content": content, "images": images})

    def call(self, item: dict[str, Any], where: str) -> None:
        name, call_id = field(item, "name", str, "", where), field(item, "call_id", str, "", where)
        arguments = field(item, "arguments", str, "", where)
        if not name:
            raise bad(f"{where}name: required")
        try:
            call = normalize_call({"name": name, "arguments": arguments, "id": call_id}, where.removesuffix("."))
        except ValueError as e:
            raise bad(str(e)) from None
        self.names[call_id] = name
        last = self.messages[-1] if self.messages else None
        if last and last["role"] == "assistant" and last.get("tool_calls"):  # parallel calls: one turn's
            last["tool_calls"].append(call)
        else:
            self.add({"role": "assistant", "content": "", "tool_calls": [call]})

    def output(self, item: dict[str, Any], where: str) -> None:
        call_id = field(item, "call_id", str, "", where)
        content, images = self.content(item.get("output"), f"{where}output", "tool")
        self.add({"role": "tool", "content": content, "images": images, "tool_call_id": call_id,
                  "name": self.names.get(call_id, "")})

    def reasoning(self, item: dict[str, Any], where: str) -> None:
        """A reasoning item passed back: its full text where it has one, else its summary (this server's)."""
        self.thinking = "\n\n".join(self.texts(item, where, "content") or self.texts(item, where, "summary"))

    def texts(self, item: dict[str, Any], where: str, key: str) -> list[str]:
        parts = field(item, key, list, [], where)
        if not all(isinstance(part, dict) and isinstance(part.get("text"), str) for part in parts):
            raise bad(f"{where}{key}: expected an array of {{\"type\", \"text\"}} parts")
        return [part["text"] for part in parts]

    def content(self, value: Any, where: str, role: str) -> tuple[str, list[Any]]:
        """A content (a string, or input_text / output_text / input_image parts) as text with a placeholder where
        each image goes, and the images."""
        if isinstance(value, str):
            return value, []
        if not isinstance(value, list):
            raise bad(f"{where}: expected a string or an array of content parts")
        texts, images = [], []
        for j, part in enumerate(value):
            at = f"{where}[{j}]"
            kind = part.get("type") if isinstance(part, dict) else None
            if kind in ("input_text", "output_text"):
                text = field(part, "text", str, None, f"{at}.")
                if text is None:
                    raise bad(f"{at}.text: required")
                texts.append(text)
            elif kind == "input_image":
                images.append(self.image(part, at))
                texts.append(self.placeholder)
            elif kind == "input_file":
                raise bad(f"{at}: file inputs are not supported; send their text as input_text")
            else:
                raise bad(f"{at}: expected an input_text, input_image or output_text part")
        if images and role not in ("user", "tool"):
            raise bad(f"{where}: {role} messages carry no images; send them in a user message")
        return "".join(texts), images

    def image(self, part: dict[str, Any], at: str) -> Any:
        url = part.get("image_url")
        if not isinstance(url, str):
            why = ("file_id: files are not stored by this server" if part.get("file_id") else "required")
            raise bad(f"{at}.image_url: {why}; send the image itself as a data URI (data:image/png;base64,...)")
        return data_uri_image(url, f"{at}.image_url", self.pictures)

    def add(self, message: Message) -> None:
        if message["role"] == "assistant" and self.thinking:
            message["thinking"], self.thinking = self.thinking, ""
        self.messages.append(message)

    def done(self) -> list[Message]:
        return [{k: v for k, v in m.items() if v or k == "content"} for m in self.messages]


def echo_of(data: dict[str, Any], tools: list[Tool], options: dict[str, Any],
            text_format: dict[str, Any]) -> dict[str, Any]:
    """What every response object repeats of its request (the fields the openai client's Response type has)."""
    reasoning = field(data, "reasoning", dict)
    summary = field(reasoning or {}, "summary", str, None, "reasoning.")
    if summary is not None and summary not in SUMMARIES:
        raise bad(f"reasoning.summary: {summary!r} is not supported; expected {', '.join(SUMMARIES)}")
    truncation = field(data, "truncation", str, "disabled")
    if truncation not in ("auto", "disabled"):
        raise bad(f"truncation: {truncation!r} is not supported; expected auto or disabled")
    field(data, "store", bool)  # accepted (a client's default is true), but nothing is stored
    strict = [field(tool, "strict", bool, None, f"tools[{i}].") for i, tool in enumerate(data.get("tools") or [])]
    return {"instructions": field(data, "instructions", str), "max_output_tokens": options["num_predict"],
            "tools": [{"type": "function", **tool["function"], "strict": flag} for tool, flag in zip(tools, strict)],
            "tool_choice": tool_choice(data), "parallel_tool_calls": field(data, "parallel_tool_calls", bool, True),
            "temperature": options["temperature"], "top_p": options["top_p"], "text": {"format": text_format},
            "reasoning": {"effort": reasoning.get("effort"), "summary": summary} if reasoning else None,
            "truncation": truncation, "metadata": field(data, "metadata", dict, {}), "store": False,
            "background": False, "previous_response_id": None, "service_tier": "default",
            "top_logprobs": field(data, "top_logprobs", int, 0),
            "max_tool_calls": None, "user": field(data, "user", str)}


# ---------------------------------------------------------------------------- the answer


@dataclass(frozen=True)
class Part:
    """How an item's text streams: a reasoning item's summary, a message's content."""

    prefix: str  # of the item's id
    part: str  # response.<part>.added / .done
    text: str  # response.<text>.delta / .done
    index: str  # the field that says which part


PARTS = {"reasoning": Part("rs", "reasoning_summary_part", "reasoning_summary_text", "summary_index"),
         "message": Part("msg", "content_part", "output_text", "content_index")}


def part_of(kind: str, text: str, logprobs: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    if kind == "reasoning":
        return {"type": "summary_text", "text": text}
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs or []}


def item_of(kind: str, ident: str, text: str | None, status: str,
            logprobs: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """A reasoning or message output item; `text` None: just added, with no part yet."""
    parts = [] if text is None else [part_of(kind, text, logprobs)]
    if kind == "reasoning":
        return {"id": ident, "type": "reasoning", "summary": parts}
    return {"id": ident, "type": "message", "role": "assistant", "status": status, "content": parts}


def hex_id() -> str:
    return uuid.uuid4().hex[:24]


class Writer:
    """One response as it is written: its output items in order, each added, grown and finished, and the events
    that say so, numbered. A whole answer takes the same steps at once and keeps the response they end with, so
    the two cannot differ in shape."""

    def __init__(self, c: Completion) -> None:
        self.c, self.ident, self.created = c, f"resp_{hex_id()}", int(time.time())
        self.echo = c.echo if isinstance(c, ResponsesCompletion) else {}
        self.sequence = 0
        self.items: list[dict[str, Any]] = []  # the finished output items
        self.kind: str | None = None  # of the item being written ("reasoning" or "message"), its id and text
        self.item_id, self.text = "", ""
        self.logprobs: list[dict[str, Any]] = []  # of the message being written (Completion.logprobs)
        self.pending: list[TokenLogprob] = []  # of text the reader holds back

    def event(self, kind: str, **data: Any) -> dict[str, Any]:
        self.sequence += 1
        return {"type": kind, "sequence_number": self.sequence - 1, **data}

    def response(self, status: str, usage: dict[str, Any] | None = None, error: dict[str, str] | None = None,
                 output: list[dict[str, Any]] | None = None) -> dict[str, Any]:
        return {"id": self.ident, "object": "response", "created_at": self.created, "status": status,
                "completed_at": int(time.time()) if status == "completed" else None, "error": error,
                "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
                "model": self.c.model, "output": list(self.items if output is None else output), "usage": usage,
                **self.echo}

    def start(self) -> list[dict[str, Any]]:
        return [self.event(f"response.{kind}", response=self.response("in_progress"))
                for kind in ("created", "in_progress")]

    def add(self, pieces: Pieces, logprobs: Sequence[TokenLogprob] = ()) -> list[dict[str, Any]]:
        """The events of what the reader read: thought, answer text, calls, in the order the model writes them.
        `logprobs` (of the tokens read; never asked for with a thought) go with the answer's text."""
        self.pending += logprobs
        events = self.write("reasoning", pieces.thinking) if pieces.thinking else []
        if pieces.content:
            events += self.write("message", pieces.content, [logprob_json(x) for x in self.pending])
        if pieces.content or pieces.thinking:
            self.pending = []
        for call in pieces.tool_calls:
            events += self.call(call)
        return events

    def finish(self, end: Finished) -> list[dict[str, Any]]:
        status = "incomplete" if end.reason == "length" else "completed"
        events = self.close(status)
        if all(item["type"] == "reasoning" for item in self.items):  # no answer: an empty message, as Ollama's
            events += self.open("message") + self.close(status)
        usage = {"input_tokens": end.prompt_tokens, "output_tokens": end.completion_tokens,
                 "total_tokens": end.prompt_tokens + end.completion_tokens,
                 "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
                 "output_tokens_details": {"reasoning_tokens": 0}}  # the thought's tokens are not counted apart
        return [*events, self.event(f"response.{status}", response=self.response(status, usage))]

    def fail(self, message: str) -> list[dict[str, Any]]:
        """An engine failure mid-stream: an `error` event, then the response failed with what it had so far."""
        output = self.items + ([item_of(self.kind, self.item_id, self.text, "incomplete", self.logprobs)]
                               if self.kind else [])
        error = {"code": "server_error", "message": message}
        return [self.event("error", code="server_error", message=message, param=None),
                self.event("response.failed", response=self.response("failed", error=error, output=output))]

    def at(self) -> dict[str, Any]:
        """Where the item being written is: its id, its output index, its (only) part."""
        assert self.kind is not None
        return {"item_id": self.item_id, "output_index": len(self.items), PARTS[self.kind].index: 0}

    def write(self, kind: str, text: str, logprobs: list[dict[str, Any]] | None = None) -> list[dict[str, Any]]:
        events = [] if self.kind == kind else self.close("completed") + self.open(kind)
        self.text += text
        extra = {} if logprobs is None else {"logprobs": logprobs}  # a message's text events carry them
        self.logprobs += logprobs or []
        return [*events, self.event(f"response.{PARTS[kind].text}.delta", **self.at(), delta=text, **extra)]

    def open(self, kind: str) -> list[dict[str, Any]]:
        self.kind, self.item_id, self.text, self.logprobs = kind, f"{PARTS[kind].prefix}_{hex_id()}", "", []
        return [self.event("response.output_item.added", output_index=len(self.items),
                           item=item_of(kind, self.item_id, None, "in_progress")),
                self.event(f"response.{PARTS[kind].part}.added", **self.at(), part=part_of(kind, ""))]

    def close(self, status: str) -> list[dict[str, Any]]:
        if self.kind is None:
            return []
        kind, part = self.kind, PARTS[self.kind]
        item = item_of(kind, self.item_id, self.text, status, self.logprobs)
        extra = {"logprobs": self.logprobs} if kind == "message" else {}
        events = [self.event(f"response.{part.text}.done", **self.at(), text=self.text, **extra),
                  self.event(f"response.{part.part}.done", **self.at(), part=part_of(kind, self.text, self.logprobs)),
                  self.event("response.output_item.done", output_index=len(self.items), item=item)]
        self.items.append(item)
        self.kind = None
        return events

    def call(self, call: ToolCall) -> list[dict[str, Any]]:
        """A function_call item, whole at once: the reader hands over a call only once it is complete."""
        events = self.close("completed")
        arguments = json.dumps(call["arguments"], ensure_ascii=False)
        item = {"id": f"fc_{hex_id()}", "type": "function_call", "status": "in_progress",
                "call_id": call.get("id") or f"call_{hex_id()}", "name": call["name"], "arguments": ""}
        done = {**item, "status": "completed", "arguments": arguments}
        where = {"item_id": item["id"], "output_index": len(self.items)}
        events += [self.event("response.output_item.added", output_index=len(self.items), item=item),
                   self.event("response.function_call_arguments.delta", **where, delta=arguments),
                   self.event("response.function_call_arguments.done", **where, name=call["name"],
                              arguments=arguments),
                   self.event("response.output_item.done", output_index=len(self.items), item=done)]
        self.items.append(done)
        return events
