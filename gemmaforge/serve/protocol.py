"""What the Ollama, OpenAI and Anthropic dialects share: the neutral completion request each parses its bodies
into, the field readers whose errors name the field (every malformed request is answered 400, never 5xx), the
prompt in the training template, and the sampling parameters a completion request comes to."""

from __future__ import annotations

import dataclasses
import json
import re
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from dataclasses import field as dataclass_field
from typing import Any, Protocol

from gemmaforge.chat.conversation import BOS, Message
from gemmaforge.chat.format import ChatFormat
from gemmaforge.chat.reading import AnswerReader, Pieces, read_whole
from gemmaforge.chat.tools import Tool, normalize_call, normalize_tool
from gemmaforge.errors import UserError
from gemmaforge.families import Family
from gemmaforge.inference.jobs import MAX_TOP_LOGPROBS, Candidate, Event, Finished, Params, TokenLogprob
from gemmaforge.intake import MAX_PIXELS, base64_bytes, decode_picture

# Ollama's own defaults, which Params carries
OLLAMA_DEFAULTS = {f.name: f.default for f in dataclasses.fields(Params)
                   if f.name in ("temperature", "top_p", "top_k", "min_p", "repeat_penalty", "repeat_last_n")}
_ROLES = ("system", "user", "assistant", "tool")
_IMAGE_ROLES = ("user", "tool")  # rendered in message order, so the images keep theirs
_JSON_NAMES = {int: "number", float: "number", str: "string", bool: "boolean", dict: "object", list: "array"}


class ApiError(Exception):
    def __init__(self, status: int, message: str, kind: str = "invalid_request_error",
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.kind, self.headers = status, message, kind, headers or {}


def bad(message: str) -> ApiError:
    return ApiError(400, message)


@dataclass(frozen=True)
class Limits:
    max_tokens: int  # the most tokens one answer may have


@dataclass(frozen=True)
class Completion:
    """One completion request in no API's terms: what to continue, how to sample, how to answer."""

    model: str  # as the client named it (answers echo it)
    prompt: str  # the training template's text (or a raw prompt)
    chat: bool  # answer as a chat message rather than as text
    stream: bool
    options: dict[str, Any]  # Ollama's option names: temperature, top_p, top_k, min_p, seed, num_predict, ...
    stop: tuple[str, ...] = ()
    include_usage: bool = False  # a streamed answer ends with the token counts (OpenAI's stream_options)
    grammar: str | None = None  # structured output (Params.grammar)
    reading: ChatFormat | None = None  # the answer is read in this format (thinking, tool calls); None: raw text
    tools: bool = False  # the request offered tools: calls are read back
    images: tuple[Any, ...] = ()  # decoded, in the order of their placeholders in `prompt`
    # the clips' files as sent, in the order of their markers, with where the request held each (the route decodes them)
    sounds: tuple[tuple[str, bytes], ...] = ()
    logprobs: int | None = None  # Params.logprobs: None, or how many of the likeliest tokens to add to each
    prompt_tokens: int = 0  # the prompt's length in tokens, once encoded (a stream's first event may report it)
    started_ns: int = dataclass_field(default_factory=time.perf_counter_ns)

    def reader(self) -> AnswerReader | None:
        """How the answer is read (None: as raw text), in the chat format of the prompt it continues."""
        if self.reading is None:
            return None
        return self.reading.reader(self.tools, self.prompt)

    def read_whole(self, text: str) -> Pieces:
        reader = self.reader()
        return read_whole(reader, text) if reader else Pieces(text)


@dataclass(frozen=True)
class LoadOnly:
    """A request that asks for no generation (Ollama's empty prompt: load the model, or unload it with keep_alive
    0), and the answer its dialect gives it."""

    answer: dict[str, Any]


class ServedModel(Protocol):
    """What a dialect reads of the model a request names (registry.Served is one): the dialects' conversions
    need no engine, so they are tested as plain functions (tests/unit/test_serve_dialects.py)."""

    @property
    def name(self) -> str: ...

    @property
    def family(self) -> Family: ...  # its chat format renders the prompt and reads the answer

    @property
    def system(self) -> str | None: ...  # the system prompt it was trained and deployed with

    @property
    def options(self) -> dict[str, Any]: ...  # Modelfile-style defaults: temperature, top_p, ...

    @property
    def tools(self) -> bool: ...  # whether requests may offer tools


class Dialect(Protocol):
    """An API's side of the completion routes: its bodies parsed into a Completion, events rendered back."""

    media_type: str  # of a streamed answer

    def parse(self, data: dict[str, Any], served: ServedModel, chat: bool) -> Completion | LoadOnly:
        """The request, or one that needs no generation (Ollama's model load)."""
        ...

    def stream(self, c: Completion, events: AsyncIterator[Event]) -> AsyncIterator[bytes]: ...

    def whole(self, c: Completion, text: str, end: Finished,
              logprobs: tuple[TokenLogprob, ...] = ()) -> dict[str, Any]:
        """The whole answer: its text, how it ended, and its tokens' log-probabilities if c.logprobs asked."""
        ...


def parse_json(body: bytes) -> dict[str, Any]:
    if not body.strip():
        raise bad("missing request body")
    try:
        data = json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise bad(f"invalid JSON: {e}") from None
    if not isinstance(data, dict):
        raise bad("the request body must be a JSON object")
    return data


def field(data: dict[str, Any], key: str, kind: type | tuple[type, ...], default: Any = None, where: str = "") -> Any:
    """data[key] checked against `kind` (bool is not a number, an int is a float)."""
    value = data.get(key)
    if value is None:
        return default
    kinds = kind if isinstance(kind, tuple) else (kind,)
    if float in kinds:
        kinds = (*kinds, int)
    if isinstance(value, bool) and bool not in kinds or not isinstance(value, kinds):
        names = " or ".join(dict.fromkeys(_JSON_NAMES.get(k, k.__name__) for k in kinds))
        raise bad(f"{where}{key}: expected {names}, got {_JSON_NAMES.get(type(value), type(value).__name__)}")
    return value


def required(data: dict[str, Any], *keys: str) -> list[str]:
    """The string fields `keys` of `data`, each present and not empty (else a 400 naming them all)."""
    values = [field(data, key, str) for key in keys]
    if not all(values):
        raise bad(f"{' and '.join(keys)} {'is' if len(keys) == 1 else 'are'} required")
    return values


_DURATION = re.compile(r"([0-9]*\.?[0-9]+)(ns|us|µs|ms|s|m|h)")
_SECONDS = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}


def parse_duration(text: str) -> float:
    """Seconds in a Go duration ("5m", "1h30m", "-1s", "0"), as Ollama reads keep_alive; ValueError otherwise."""
    sign, body = (-1.0, text[1:]) if text.startswith("-") else (1.0, text.removeprefix("+"))
    if body == "0":
        return 0.0
    parts = _DURATION.findall(body)
    if not body or "".join(number + unit for number, unit in parts) != body:
        raise ValueError(f"{text!r} is not a duration (e.g. 5m, 1h30m, 30s, 0, -1m)")
    return sign * sum(float(number) * _SECONDS[unit] for number, unit in parts)


def keep_alive(data: dict[str, Any]) -> float | None:
    """A request's keep_alive in seconds (a number of seconds or a duration string; < 0: until the server
    stops); None when it is not given."""
    value = field(data, "keep_alive", (float, str))
    if isinstance(value, str):
        try:
            return parse_duration(value)
        except ValueError as e:
            raise bad(f"keep_alive: {e}") from None
    return value


def model_name(data: dict[str, Any]) -> str:
    name = field(data, "model", str)
    if not name:
        raise bad("model is required")
    return name


class Pictures:
    """A request's images, decoded one by one within what they may hold together (MAX_PIXELS)."""

    def __init__(self) -> None:
        self.left = MAX_PIXELS

    def decode(self, text: Any, where: str) -> Any:
        """An image sent as base64 (a data URI is accepted too), through the intake every picture goes through
        (gemmaforge/intake.py)."""
        try:
            return self.decode_bytes(base64_bytes(text, where), where)
        except UserError as e:
            raise bad(str(e)) from None

    def decode_bytes(self, data: bytes, where: str) -> Any:
        image = decode_picture(data, where, self.left)
        self.left -= image.width * image.height
        return image


def ollama_media(sent: list[Any], where: str, pictures: Pictures, placeholder: str, audio: str | None
                 ) -> tuple[str, list[Any], list[tuple[str, bytes]]]:
    """Ollama's `images` (base64), which carry clips too, told apart by their first bytes as Ollama tells them
    (WAV, MP3; FLAC and Ogg too, which llama.cpp and the intake read): the markers they put before the text (in the
    order sent, as Ollama places them), the decoded pictures and the clips' files."""
    markers, images, sounds = [], [], []
    for j, text in enumerate(sent):
        at = f"{where}images[{j}]"
        try:
            data = base64_bytes(text, at)
            if is_sound(data):
                if audio is None:
                    raise UserError(f"{at}: a clip, and this model's chat format takes no sound (Gemma 4 E2B and "
                                    "E4B hear)")
                markers.append(audio)
                sounds.append((at, data))
            else:
                markers.append(placeholder)
                images.append(pictures.decode_bytes(data, at))
        except UserError as e:
            raise bad(str(e)) from None
    return "".join(markers), images, sounds


def is_sound(data: bytes) -> bool:
    """Whether a file's first bytes are a clip's: WAV (RIFF....WAVE), MP3 (an ID3 tag or an MPEG frame sync),
    FLAC, Ogg."""
    return (data[:4] == b"RIFF" and data[8:12] == b"WAVE") or data[:3] == b"ID3" or data[:4] in (b"fLaC", b"OggS") \
        or (len(data) > 1 and data[0] == 0xFF and data[1] & 0xE0 == 0xE0)


def image_url(part: dict[str, Any], where: str, pictures: Pictures) -> Any:
    """An OpenAI `image_url` content part's image: a data URI (remote URLs are refused, never fetched)."""
    url = part.get("image_url")
    url = url.get("url") if isinstance(url, dict) else url
    if not isinstance(url, str):
        raise bad(f"{where}image_url.url: expected a string")
    return data_uri_image(url, f"{where}image_url", pictures, ".url")


def data_uri_image(url: str, where: str, pictures: Pictures, key: str = "") -> Any:
    """The image of a data URI that `where` holds (at `key` within it: Chat Completions' image_url.url; the
    Responses API's image_url is the URI itself); remote URLs are refused, never fetched."""
    if url.startswith(("http://", "https://")):
        raise bad(f"{where}: remote URLs are not fetched by this server; send the image itself as a data URI "
                  "(data:image/png;base64,...)")
    if not (url.startswith("data:") and url.partition(",")[0].endswith(";base64")):
        raise bad(f"{where}{key}: expected a data URI (data:image/png;base64,...)")
    return pictures.decode(url, where)


def input_audio(part: dict[str, Any], where: str, marker: str | None) -> bytes:
    """An OpenAI `input_audio` content part's clip: its base64 `data` (a file in `format`: wav, mp3, ... anything
    libsndfile reads), decoded by the route at the engine's rate. `marker`: where the chat format writes a clip
    (None: it writes none)."""
    if marker is None:
        raise bad(f"{where}input_audio: this model's chat format takes no sound (Gemma 4 E2B and E4B hear)")
    sent = part.get("input_audio")
    if not isinstance(sent, dict) or not isinstance(sent.get("data"), str) or not sent["data"]:
        raise bad(f"{where}input_audio.data: expected the clip's file in base64")
    if not isinstance(sent.get("format", "wav"), str):
        raise bad(f"{where}input_audio.format: expected a string such as wav or mp3")
    try:
        return base64_bytes(sent["data"], f"{where}input_audio.data", "clip")
    except UserError as e:
        raise bad(str(e)) from None


def _content(m: dict[str, Any], where: str, openai: bool, placeholder: str, pictures: Pictures,
             audio: str | None) -> tuple[str, list[Any], list[tuple[str, bytes]]]:
    """A message's text, with `placeholder` where each of its images goes (`audio` where each clip goes), and the
    images and clips: OpenAI's content parts in their order; Ollama's `images` before the text, as Ollama places
    them."""
    content = m.get("content")
    images: list[Any] = []
    sounds: list[tuple[str, bytes]] = []
    if openai and isinstance(content, list):  # [{"type": "text", "text": ...}, {"type": "image_url", ...}]
        texts = []
        for j, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind == "text" and isinstance(part.get("text"), str):
                texts.append(part["text"])
            elif kind == "image_url":
                images.append(image_url(part, f"{where}content[{j}].", pictures))
                texts.append(placeholder)
            elif kind == "input_audio":
                sounds.append((f"{where}content[{j}].input_audio", input_audio(part, f"{where}content[{j}].", audio)))
                texts.append(audio or "")
            else:
                raise bad(f"{where}content[{j}]: expected a text, image_url or input_audio part")
        content = "".join(texts)
    elif content is None:
        content = ""
    elif not isinstance(content, str):
        raise bad(f"{where}content: expected string, got {type(content).__name__}")
    markers, sent_images, sent_sounds = ollama_media(field(m, "images", list, [], where), where, pictures, placeholder,
                                                     audio)
    return markers + content, images + sent_images, sounds + sent_sounds


def images_in(messages: list[Message]) -> tuple[Any, ...]:
    return tuple(image for m in messages for image in m.get("images", ()))


def sounds_in(messages: list[Message]) -> tuple[tuple[str, bytes], ...]:
    return tuple(clip for m in messages for clip in m.get("audios", ()))


def each_message(data: dict[str, Any]) -> Iterator[tuple[str, dict[str, Any]]]:
    """A request's `messages` (at least one, each an object): where each is, as errors name it, and the message."""
    messages = field(data, "messages", list)
    if not messages:
        raise bad("messages: at least one message is required")
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise bad(f"messages[{i}]: expected an object with role and content")
        yield f"messages[{i}].", m


def compact(message: Message) -> Message:
    """A message without the keys it leaves empty (its content is kept, even empty)."""
    return {k: v for k, v in message.items() if v or k == "content"}


def messages_of(data: dict[str, Any], placeholder: str, openai: bool = False, audio: str | None = None
                ) -> list[Message]:
    """A request's messages as chat Messages: text contents with `placeholder` where an image goes (the decoded
    images under "images"), `audio` where a clip goes (OpenAI's input_audio parts, their files under "audios"),
    an assistant's tool calls and thinking (Ollama's `thinking`, OpenAI-compatible
    servers' `reasoning_content`), a tool result's function (Ollama's `tool_name`, OpenAI's `tool_call_id` naming a
    call)."""
    out = []
    pictures = Pictures()
    for where, m in each_message(data):
        role = field(m, "role", str, where=where)
        role = "system" if openai and role == "developer" else role
        if role not in _ROLES:
            raise bad(f"{where}role: {role!r} is not supported; expected one of {', '.join(_ROLES)}")
        content, images, sounds = _content(m, where, openai, placeholder, pictures, audio)
        if images and role not in _IMAGE_ROLES:
            raise bad(f"{where}images: {role} messages carry no images; send them in a user message")
        if sounds and role != "user":
            raise bad(f"{where}content: {role} messages carry no sound; send it in a user message")
        message: Message = {"role": role, "content": content, "images": images, "audios": sounds}
        if role == "assistant":
            calls = field(m, "tool_calls", list, [], where)
            try:
                message.update(tool_calls=[normalize_call(c, f"{where}tool_calls[{j}]") for j, c in enumerate(calls)])
            except ValueError as e:
                raise bad(str(e)) from None
            message.update(thinking=field(m, "reasoning_content" if openai else "thinking", str, "", where))
        elif role == "tool":
            message.update(name=field(m, "name" if openai else "tool_name", str, "", where),
                           tool_call_id=field(m, "tool_call_id", str, "", where))
        out.append(compact(message))
    return out


def tools_of(data: dict[str, Any]) -> list[Tool]:
    tools = field(data, "tools", list, [])
    try:
        return [normalize_tool(tool, f"tools[{i}]") for i, tool in enumerate(tools)]
    except ValueError as e:
        raise bad(str(e)) from None


def check_think(served: ServedModel, think: bool, key: str = "think") -> bool:
    """`think`, if the served model can think (else a 400 naming the request's field `key`)."""
    if think and not served.family.chat.thinking:
        raise bad(f"{key}: {served.name} does not support thinking (the {served.family.name} chat format has no "
                  "thought channel; Gemma 4 models think)")
    return think


def chat_prompt(served: ServedModel, messages: list[Message], tools: list[Tool] | None = None,
                think: bool = False) -> str:
    """The prompt Ollama renders from `messages` for the run's model (ChatFormat.request_prompt): system messages
    anywhere, consecutive turns of one role and empty ones are taken as Ollama takes them. The served system
    prompt is used when the first message is not one; the offered tools ride on the system message, where every
    Gemma rendering places them."""
    if messages[0]["role"] != "system" and served.system:
        messages = [{"role": "system", "content": served.system}, *messages]
    if all(m["role"] == "system" for m in messages):
        raise bad("messages: there is no user or assistant message to answer")
    if tools and not served.tools:
        raise bad(f"tools: {served.name} does not support tools (the official {served.family.name} template has no "
                  "tool format; a run trained on tool-call data, such as LLaMA-Factory's glaive_toolcall demos, "
                  "takes them in LLaMA-Factory's format, and Gemma 4 models take them)")
    if tools:
        messages = ([{**messages[0], "tools": tools}, *messages[1:]] if messages[0]["role"] == "system"
                    else [{"role": "system", "content": "", "tools": tools}, *messages])
    return served.family.chat.request_prompt(messages, think=check_think(served, think))


def generate_prompt(served: ServedModel, data: dict[str, Any],
                    think: bool = False) -> tuple[str, tuple[Any, ...], tuple[tuple[str, bytes], ...]]:
    """/api/generate and /v1/completions: `prompt` in the chat template (with `system`, after Ollama's `images`,
    which may be clips), or as is with `raw` (which then holds a marker for each image and clip); the decoded
    images and the clips' files."""
    prompt = field(data, "prompt", str, "")
    system = field(data, "system", str)
    chat = served.family.chat
    markers, images, sounds = ollama_media(field(data, "images", list, []), "", Pictures(), chat.image, chat.audio)
    if field(data, "raw", bool, False):
        if system or data.get("template") or data.get("context"):
            raise bad("raw mode does not support template, system, or context")
        return (prompt if prompt.startswith(BOS) else BOS + prompt), tuple(images), tuple(sounds)
    if data.get("template"):
        raise bad("template: a per-request template is not supported; the served model's training template is used")
    messages = [{"role": "system", "content": system}] if system else []
    user = {"role": "user", "content": markers + prompt}
    return chat_prompt(served, [*messages, user], think=think), tuple(images), tuple(sounds)


def refuse_unsupported(data: dict[str, Any]) -> None:
    """Fields that would change the answer in ways this server cannot honour: refused, not ignored."""
    if data.get("suffix"):
        raise bad("suffix: fill-in-the-middle is not supported by Gemma chat models")


def json_schema(schema: Any, where: str) -> str:
    """A JSON schema as the grammar's JSON text: an object (a pydantic model's model_json_schema(), say)."""
    if schema is None:
        raise bad(f"{where}: required")
    if not isinstance(schema, dict):
        raise bad(f"{where}: expected a JSON schema object, got {_JSON_NAMES.get(type(schema), type(schema).__name__)}")
    return json.dumps(schema)


def stops(data: dict[str, Any], where: str = "", key: str = "stop") -> tuple[str, ...]:
    """The stop strings under `key` (Ollama's and OpenAI's stop, Anthropic's stop_sequences)."""
    stop = field(data, key, (list, str), [], where)
    stop = [stop] if isinstance(stop, str) else stop
    if not all(isinstance(s, str) for s in stop):
        raise bad(f"{where}{key}: expected a string or an array of strings")
    return tuple(stop)


def sampling_params(c: Completion, limits: Limits, n_prompt: int, num_ctx: int) -> Params:
    """The engine's parameters for a prompt of `n_prompt` tokens: options checked, the answer bounded by the
    context window (a request's num_ctx no larger than the server's), its num_predict and the server's cap."""
    o = c.options
    for key, low, high, low_ok in (("temperature", 0, 100, True), ("top_p", 0, 1, False), ("min_p", 0, 1, True),
                                   ("repeat_penalty", 0, 100, False)):
        if not (low <= o[key] if low_ok else low < o[key]) or o[key] > high:
            raise bad(f"{key}: {o[key]} is out of range {'[' if low_ok else '('}{low}, {high}]")
    seed = o.get("seed")
    if seed is not None and not -(2**63) <= seed < 2**63:
        raise bad(f"seed: {seed} is out of range (a 64-bit integer)")
    context = min(o.get("num_ctx") or num_ctx, num_ctx)
    if n_prompt >= context:
        raise bad(f"the prompt is {n_prompt} tokens, which does not fit the context window of {context} tokens")
    room = context - n_prompt
    predict = o.get("num_predict")
    if predict is None or predict < 0:  # -1: until the end of turn, -2: fill the context
        predict = room
    if predict == 0:
        raise bad("num_predict / max_tokens: must be at least 1")
    return Params(max_tokens=min(predict, room, limits.max_tokens), temperature=o["temperature"], top_p=o["top_p"],
                  top_k=o["top_k"] or 0, min_p=o["min_p"], seed=seed, repeat_penalty=o["repeat_penalty"],
                  repeat_last_n=o["repeat_last_n"], stop=c.stop, grammar=c.grammar, logprobs=c.logprobs)


def logprobs_of(data: dict[str, Any]) -> int | None:
    """Ollama's and OpenAI's chat `logprobs` (true: each answer token's log-probability) with `top_logprobs` (how
    many of the likeliest tokens to add, 0-20): Completion.logprobs."""
    top = field(data, "top_logprobs", int)
    if top is not None and not 0 <= top <= MAX_TOP_LOGPROBS:
        raise bad(f"top_logprobs: {top} is out of range [0, {MAX_TOP_LOGPROBS}]")
    if not field(data, "logprobs", bool, False):
        if top:
            raise bad("top_logprobs: needs logprobs: true")
        return None
    return top or 0


def logprob_json(logprob: TokenLogprob) -> dict[str, Any]:
    """A token's log-probabilities as Ollama and OpenAI's chat completions write them."""
    return {**candidate_json(logprob), "top_logprobs": [candidate_json(c) for c in logprob.top]}


def candidate_json(c: Candidate) -> dict[str, Any]:
    return {"token": c.token, "logprob": c.logprob, "bytes": list(c.raw)}
