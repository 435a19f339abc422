"""The HTTP server: Ollama's API under /api, OpenAI's under /v1, vLLM's adapter loading routes.

The four completion routes are one path (`complete`): a dialect (ollama_api.py, openai_api.py) parses the body
into a neutral Completion (protocol.py), the served model's engine generates it, and the dialect renders the
events back; a new API is a new dialect, not new routes' worth of generation code. Ollama's model admin routes
are in admin.py, the embedding routes' requests and answers in embeddings.py.

Errors take each API's own shape ({"error": "..."} on Ollama routes, {"error": {"message", "type", ...}}
on OpenAI routes). A request a client gets wrong is a 4xx; once a stream has started, an error is sent
as the stream's last message. A client that goes away stops its generation.
"""

from __future__ import annotations

import asyncio
import dataclasses
import secrets
import time
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse

from gemmaforge import __version__
from gemmaforge.console import console, escape
from gemmaforge.errors import UserError
from gemmaforge.export.ollama import GEMMA_TERMS
from gemmaforge.inference.jobs import Delta, Event, Failed, Finished, Job, QueueFull
from gemmaforge.serve import embeddings as emb
from gemmaforge.serve import protocol as p
from gemmaforge.serve.admin import admin_routes
from gemmaforge.serve.ollama_api import OllamaDialect
from gemmaforge.serve.openai_api import OpenAIDialect, model_object
from gemmaforge.serve.protocol import ApiError, Dialect, Limits, LoadOnly, bad
from gemmaforge.serve.registry import Registry, Served, check_name

MAX_BODY = 32 * 2**20  # a few camera photos in base64
OLLAMA, OPENAI = OllamaDialect(), OpenAIDialect()


def create_app(registry: Registry, *, api_key: str | None = None, max_tokens: int = 4096,
               timeout_s: float = 600.0) -> FastAPI:
    app = FastAPI(title="gemmaforge serve", version=__version__, docs_url=None, redoc_url=None, openapi_url=None)
    limits = Limits(max_tokens=max_tokens)

    @app.middleware("http")
    async def guard(request: Request, call_next: Any) -> Response:
        try:
            if api_key is not None and request.url.path != "/":
                given = request.headers.get("authorization", "")
                if not secrets.compare_digest(given.encode(), f"Bearer {api_key}".encode()):
                    raise ApiError(401, "missing or wrong API key (Authorization: Bearer ...)", "authentication_error")
            if int(request.headers.get("content-length") or 0) > MAX_BODY:
                raise ApiError(413, f"request body larger than {MAX_BODY} bytes")
            return await call_next(request)
        except ApiError as e:
            return error_response(request, e)

    @app.exception_handler(ApiError)
    async def api_error(request: Request, e: ApiError) -> Response:
        return error_response(request, e)

    @app.exception_handler(Exception)
    async def server_fault(request: Request, e: Exception) -> Response:  # a bug, still in the API's shape
        return error_response(request, ApiError(500, f"internal error: {type(e).__name__}: {e}", "api_error"))

    @app.exception_handler(404)
    async def not_found(request: Request, _e: Exception) -> Response:
        message = f"{request.method} {request.url.path} is not a route of this server"
        return error_response(request, ApiError(404, message, "not_found_error"))

    @app.exception_handler(405)
    async def wrong_method(request: Request, _e: Exception) -> Response:
        return error_response(request, ApiError(405, f"method {request.method} is not allowed on {request.url.path}"))

    async def body(request: Request) -> dict[str, Any]:
        raw = bytearray()
        async for chunk in request.stream():  # bounded even without a Content-Length header
            raw += chunk
            if len(raw) > MAX_BODY:
                raise ApiError(413, f"request body larger than {MAX_BODY} bytes")
        return p.parse_json(bytes(raw))

    def served_or_404(name: str) -> Served:
        served = registry.get(name)
        if served is None:
            raise ApiError(404, f"model '{name}' not found", "not_found_error")
        return served

    async def ready(data: dict[str, Any]) -> tuple[Served, float | None]:
        """The request's model, loaded again if keep_alive had unloaded it, and the request's keep_alive."""
        served, keep = served_or_404(p.model_name(data)), p.keep_alive(data)
        try:  # on a thread: the registry's lock may be held while another model loads
            served = await asyncio.to_thread(registry.ensure_loaded, served.name, keep)
        except KeyError:  # removed meanwhile
            served_or_404(served.name)
        return served, keep

    async def events(served: Served, job: Job, request: Request) -> AsyncIterator[Event]:
        """Submit a job and yield its events; a disconnected client or the timeout cancels it. The model is
        kept loaded after it as the latest request's keep_alive says (see Registry.keep)."""
        try:
            served.engine.submit(job)
        except QueueFull as e:
            registry.keep(served.name)
            raise ApiError(503, f"the server is busy ({e}); retry shortly", "api_error", {"Retry-After": "1"}) from None
        begin = time.monotonic()
        deadline = begin + timeout_s
        next_check = begin + 0.5
        outcome = "cancelled: the client went away"
        try:
            while True:
                try:
                    event = await asyncio.wait_for(job.events.get(), timeout=0.5)
                except TimeoutError:
                    event = None
                if time.monotonic() >= next_check:  # even while tokens flow: a client gone, the time limit
                    next_check = time.monotonic() + 0.5
                    if await request.is_disconnected():
                        return
                    if time.monotonic() > deadline:
                        job.cancelled.set()
                if event is None:
                    continue
                if isinstance(event, Finished) and event.reason == "cancelled":  # cut by the time limit
                    event = dataclasses.replace(event, reason="length")
                if isinstance(event, Finished):
                    outcome = f"{event.reason} after {event.completion_tokens} tokens"
                elif isinstance(event, Failed):
                    outcome = f"failed: {escape(event.message)}"
                yield event
                if isinstance(event, Finished | Failed):
                    return
        finally:
            job.cancelled.set()  # a client gone mid-stream (or any early exit) stops the generation
            registry.keep(served.name)
            # one line a request, as Ollama logs them: what ended it shows a client's stop button working
            console.print(f"[bold]serve[/]: {request.method} {request.url.path} {served.name} "
                          f"({len(job.prompt_ids)} prompt tokens): {outcome}, {time.monotonic() - begin:.2f} s",
                          highlight=False)

    # ------------------------------------------------------------------ Ollama

    @app.api_route("/", methods=["GET", "HEAD"])
    async def root() -> Response:
        return PlainTextResponse("Ollama is running")

    @app.get("/api/version")
    async def version() -> dict[str, str]:
        return {"version": __version__}

    @app.get("/api/tags")
    async def tags() -> dict[str, Any]:
        return {"models": [{"name": m.name, "model": m.name, "modified_at": m.modified_at, "size": m.size,
                            "digest": m.digest, "details": m.details} for m in list(registry.models.values())]}

    @app.get("/api/ps")
    async def ps() -> dict[str, Any]:
        """The loaded models: when keep_alive unloads each (a model kept until the server stops shows Ollama's
        "forever", the longest duration Go has), and how much of its weights sit in GPU memory."""
        forever = datetime.now(UTC) + timedelta(microseconds=2**63 // 1000)
        return {"models": [{"name": m.name, "model": m.name, "size": m.size, "digest": m.digest, "details": m.details,
                            "expires_at": (m.expires_at or forever).isoformat(),
                            "size_vram": m.size if str(m.engine.device).startswith("cuda") else 0,
                            "context_length": registry.num_ctx}
                           for m in list(registry.models.values()) if m.loaded]}

    @app.post("/api/show")
    async def show(request: Request) -> dict[str, Any]:

        served = served_or_404(p.model_name(await body(request)))
        parameters = "\n".join([*(f"{k} {v}" for k, v in served.options.items()),
                                *(f'stop "{s}"' for s in served.family.stop)])
        return {"license": GEMMA_TERMS, "modelfile": f"# served by gemmaforge from {served.source}\n",
                "parameters": parameters, "template": served.family.chat.go_template(), "system": served.system or "",
                "details": served.details, "model_info": {"general.architecture": served.family.gguf_arch},
                "capabilities": ["completion", *(["tools"] if served.tools else []),
                                 *(["thinking"] if served.family.chat.thinking else []),
                                 *(["vision"] if served.engine.vision else [])],
                "modified_at": served.modified_at}

    app.include_router(admin_routes(registry, served_or_404, body))

    async def complete(request: Request, dialect: Dialect, chat: bool) -> Response:
        """Every completion route: the dialect parses the body into a Completion, the served model's engine
        generates it, the dialect renders the events, streamed or whole."""
        data = await body(request)
        served, keep = await ready(data)
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
            images = None
            if completion.images:  # the image processor's work, off the event loop
                try:
                    ids, images = await asyncio.to_thread(served.engine.encode_images, completion.prompt,
                                                          list(completion.images))
                except ValueError as e:
                    raise p.bad(f"images: {served.name}: {e}") from None
            else:
                ids = served.engine.encode(completion.prompt)
            params = p.sampling_params(completion, limits, len(ids), registry.num_ctx)
        except Exception:  # refused (or failed) before it reached the engine: the model is no longer held for it
            registry.keep(served.name)
            raise
        stream = events(served, Job(ids, params, served.adapter, asyncio.get_running_loop(), completion.stream,
                                    images), request)
        if completion.stream:
            first = await first_event(stream)  # a full queue is still a plain 503, before the stream starts
            return StreamingResponse(dialect.stream(completion, prepend(first, stream)), media_type=dialect.media_type)
        text, end = await collect(stream)
        return JSONResponse(dialect.whole(completion, text, end))

    def completion_route(dialect: Dialect, chat: bool) -> Any:
        async def route(request: Request) -> Response:
            return await complete(request, dialect, chat)

        return route

    for path, dialect, chat in (("/api/generate", OLLAMA, False), ("/api/chat", OLLAMA, True),
                                ("/v1/chat/completions", OPENAI, True), ("/v1/completions", OPENAI, False)):
        app.post(path)(completion_route(dialect, chat))

    # ------------------------------------------------------------------ embeddings (embeddings.py)

    async def embed(data: dict[str, Any], request: emb.EmbedRequest) -> tuple[list[list[float]], int]:
        served, _keep = await ready(data)
        try:
            return await embedded(served, request)
        finally:
            registry.keep(served.name)

    async def embedded(served: Served, request: emb.EmbedRequest) -> tuple[list[list[float]], int]:
        if not request.truncate:
            for i, text in enumerate(request.texts):
                if len(served.engine.encode(text)) + 1 > registry.num_ctx:  # and <bos>
                    raise bad(f"input[{i}]: the input length exceeds the context length ({registry.num_ctx} tokens)")
        if not request.texts:  # Ollama's way of loading a model
            return [], 0
        return await asyncio.to_thread(served.engine.embed, request.texts, served.adapter)

    @app.post("/api/embed")
    async def ollama_embed(request: Request) -> dict[str, Any]:
        data = await body(request)
        asked = emb.ollama_request(data, legacy=False)
        return emb.ollama_response(data["model"], asked, *await embed(data, asked), legacy=False)

    @app.post("/api/embeddings")
    async def ollama_embeddings(request: Request) -> dict[str, Any]:
        data = await body(request)
        asked = emb.ollama_request(data, legacy=True)
        return emb.ollama_response(data["model"], asked, *await embed(data, asked), legacy=True)

    @app.post("/v1/embeddings")
    async def openai_embeddings(request: Request) -> dict[str, Any]:
        data = await body(request)
        asked = emb.openai_request(data)
        return emb.openai_response(data["model"], asked, *await embed(data, asked))

    # ------------------------------------------------------------------ OpenAI

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [model_object(m) for m in list(registry.models.values())]}

    @app.get("/v1/models/{name:path}")
    async def model(name: str) -> dict[str, Any]:
        return model_object(served_or_404(name))

    # ------------------------------------------------------------------ adapters at runtime (vLLM's routes)

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(request: Request) -> Response:
        data = await body(request)
        name, path = p.required(data, "lora_name", "lora_path")
        try:
            check_name(name, "lora_name")
            if registry.get(name) is not None:
                raise bad(f"lora_name {name!r} is already served")
            adapter = Path(path).expanduser()
            if not adapter.is_dir():
                raise bad(f"lora_path {path!r} is not a folder")
            await asyncio.to_thread(registry.add_adapter, name, adapter)
        except UserError as e:
            raise bad(str(e)) from None
        except Exception as e:  # noqa: BLE001  (an unreadable or mismatched adapter is the request's fault)
            raise bad(f"lora_path {path!r}: could not load the adapter ({type(e).__name__}: {e})") from None
        return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(request: Request) -> Response:
        (name,) = p.required(await body(request), "lora_name")
        served = served_or_404(name)
        if served.adapter is None:
            raise bad(f"{served.name} is not a LoRA adapter")
        if await asyncio.to_thread(registry.remove, served.name) is None:
            served_or_404(name)
        return PlainTextResponse(f"Success: LoRA adapter '{name}' removed successfully.")

    return app


def error_response(request: Request, e: ApiError) -> Response:
    if request.url.path.startswith("/v1"):
        content: dict[str, Any] = {"error": {"message": e.message, "type": e.kind, "param": None, "code": None}}
    else:
        content = {"error": e.message}
    headers = {**e.headers, "x-should-retry": "true" if e.status == 503 else "false"}  # openai-python's retries
    return JSONResponse(content, status_code=e.status, headers=headers)


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


async def collect(stream: AsyncIterator[Event]) -> tuple[str, Finished]:
    parts = []
    async for event in stream:
        if isinstance(event, Delta):
            parts.append(event.text)
        elif isinstance(event, Failed):
            raise ApiError(500, event.message, "api_error")
        else:
            return "".join(parts), event
    raise ApiError(499, "client closed the request")
