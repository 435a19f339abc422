"""The completion routes, one path (`complete`): a dialect (ollama_api.py, openai_api.py for chat completions and
completions, responses_api.py for OpenAI's Responses, anthropic_api.py for Anthropic's Messages) parses the body
into a neutral Completion (protocol.py), the served model's engine generates it, and the dialect renders the
events back, streamed or whole; a new API is a new dialect, not new routes' worth of generation code."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from gemmaforge.audio import LONGEST_CLIP_SECONDS
from gemmaforge.errors import UserError
from gemmaforge.inference.jobs import Delta, Engine, Event, Failed, Finished, Job, TokenLogprob
from gemmaforge.intake import decode_sound
from gemmaforge.serve import protocol as p
from gemmaforge.serve.anthropic_api import AnthropicDialect
from gemmaforge.serve.ollama_api import OllamaDialect
from gemmaforge.serve.openai_api import OpenAIDialect
from gemmaforge.serve.protocol import ApiError, Dialect, LoadOnly, bad
from gemmaforge.serve.responses_api import ResponsesDialect
from gemmaforge.serve.state import AppState, State

OLLAMA, OPENAI, RESPONSES, ANTHROPIC = OllamaDialect(), OpenAIDialect(), ResponsesDialect(), AnthropicDialect()

router = APIRouter()


async def complete(request: Request, state: AppState, dialect: Dialect, chat: bool) -> Response:
    data = await state.body(request)
    served, keep = await state.ready(data)
    registry = state.registry
    try:  # images are decoded while parsing: off the event loop
        completion = await asyncio.to_thread(dialect.parse, data, served, chat)
        if isinstance(completion, LoadOnly):  # with keep_alive 0 it unloads the model
            registry.keep(served.name)
            answer = completion.answer
            return JSONResponse({**answer, "done_reason": "unload"} if keep == 0 else answer)
        if completion.grammar:
            try:
                await asyncio.to_thread(served.engine.compile_grammar, completion.grammar)
            except ValueError as e:
                raise bad(f"format / response_format: this JSON schema cannot be enforced: {e}") from None
        media = None
        if completion.images or completion.sounds:  # the processors' work, off the event loop
            ids, media = await asyncio.to_thread(encode_media, served.engine, served.name, completion.prompt,
                                                 completion.images, completion.sounds)
        else:
            ids = served.engine.encode(completion.prompt)
        params = p.sampling_params(completion, state.limits, len(ids), registry.num_ctx)
        completion = dataclasses.replace(completion, prompt_tokens=len(ids))
    except Exception:  # refused (or failed) before it reached the engine: the model is no longer held for it
        registry.keep(served.name)
        raise
    stream = state.events(served, Job(ids, params, served.adapter, asyncio.get_running_loop(), completion.stream,
                                      media), request)
    if completion.stream:
        first = await first_event(stream)  # a full queue is still a plain 503, before the stream starts
        return StreamingResponse(dialect.stream(completion, prepend(first, stream)), media_type=dialect.media_type)
    text, end, logprobs = await collect(stream)
    return JSONResponse(dialect.whole(completion, text, end, logprobs))


def encode_media(engine: Engine, name: str, prompt: str, images: Sequence[Any],
                 sounds: Sequence[tuple[str, bytes]] = ()) -> tuple[list[int], dict[str, Any]]:
    """The prompt's ids and its media inputs (Job.media): its clips decoded at the engine's rate by the intake
    every clip goes through (`sounds`: each clip's file and where the request held it). A 400 naming the field when
    the model takes no pictures or no sound, or a clip does not decode."""
    field = "images" if images and engine.vision is None or not sounds else "input_audio"
    if sounds and engine.audio_rate is None:
        raise bad(f"input_audio: {name}: {getattr(engine, 'no_audio', 'the model takes no sound')}")
    try:
        clips = [decode_sound(data, where, engine.audio_rate, LONGEST_CLIP_SECONDS)
                 for where, data in sounds] if engine.audio_rate else []
        return engine.encode_media(prompt, list(images), clips)
    except UserError as e:
        raise bad(str(e)) from None
    except ValueError as e:
        raise bad(f"{field}: {name}: {e}") from None


# each completion route: the dialect that reads and answers it, and whether it is a chat
ROUTES: dict[str, tuple[Dialect, bool]] = {
    "/api/generate": (OLLAMA, False), "/api/chat": (OLLAMA, True), "/v1/chat/completions": (OPENAI, True),
    "/v1/completions": (OPENAI, False), "/v1/responses": (RESPONSES, True), "/v1/messages": (ANTHROPIC, True)}


def completion_route(dialect: Dialect, chat: bool) -> Callable[[Request, AppState], Awaitable[Response]]:
    async def route(request: Request, state: State) -> Response:
        return await complete(request, state, dialect, chat)

    return route


for path, (dialect, chat) in ROUTES.items():
    router.add_api_route(path, completion_route(dialect, chat), methods=["POST"])


@router.post("/v1/messages/count_tokens")
async def anthropic_count_tokens(request: Request, state: State) -> dict[str, int]:
    """The tokens of the prompt a /v1/messages request would send, its images as the model reads them."""
    data = await state.body(request)
    served, _keep = await state.ready(data)
    try:
        prompt, images, _tools = await asyncio.to_thread(ANTHROPIC.prompt, data, served)
        if not images:
            return {"input_tokens": len(served.engine.encode(prompt))}
        # a model without vision refuses them here, as it does a completion's
        ids, _inputs = await asyncio.to_thread(encode_media, served.engine, served.name, prompt, images)
        return {"input_tokens": len(ids)}
    finally:
        state.registry.keep(served.name)


async def first_event(stream: AsyncIterator[Event]) -> Event:
    try:
        event = await anext(stream)
    except StopAsyncIteration:  # the client went away before the first token
        raise ApiError(499, "client closed the request") from None
    if isinstance(event, Failed):  # nothing sent yet: a plain error response rather than a broken stream
        raise ApiError(500, event.message, "api_error")
    return event


async def prepend(first: Event, rest: AsyncIterator[Event]) -> AsyncIterator[Event]:
    yield first
    if not isinstance(first, Finished | Failed):
        async for event in rest:
            yield event


async def collect(stream: AsyncIterator[Event]) -> tuple[str, Finished, tuple[TokenLogprob, ...]]:
    parts: list[str] = []
    logprobs: list[TokenLogprob] = []
    async for event in stream:
        if isinstance(event, Delta):
            parts.append(event.text)
            logprobs += event.logprobs
        elif isinstance(event, Failed):
            raise ApiError(500, event.message, "api_error")
        else:
            return "".join(parts), event, tuple(logprobs)
    raise ApiError(499, "client closed the request")
