"""The HTTP server: Ollama's API under /api, OpenAI's under /v1, Anthropic's Messages API at /v1/messages, vLLM's
adapter loading routes.

The app is its routers (gemmaforge/serve/routes/) over one AppState (state.py: the registry, the limits and the
request steps they share), an API key guard, a bound on the body, and the errors each API expects: {"error":
"..."} on Ollama routes, {"error": {"message", "type", ...}} on OpenAI routes, {"type": "error", "error": {"type",
"message"}} on Anthropic's. A request a client gets wrong is a 4xx; once a stream has started, an error is sent as
the stream's last message. A client that goes away stops its generation.
"""

from __future__ import annotations

import secrets
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from gemmaforge import __version__
from gemmaforge.serve.anthropic_api import error_body as anthropic_error
from gemmaforge.serve.protocol import ApiError, Limits
from gemmaforge.serve.registry import Registry
from gemmaforge.serve.routes import adapters, admin, audio, completions, embeddings, models
from gemmaforge.serve.state import MAX_BODY, AppState


def create_app(registry: Registry, *, api_key: str | None = None, max_tokens: int = 4096,
               timeout_s: float = 600.0) -> FastAPI:
    app = FastAPI(title="gemmaforge serve", version=__version__, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.serve = AppState(registry, Limits(max_tokens=max_tokens), timeout_s)
    for routes in (models, completions, audio, embeddings, admin, adapters):
        app.include_router(routes.router)

    @app.middleware("http")
    async def guard(request: Request, call_next: Any) -> Response:
        try:
            if api_key is not None and request.url.path != "/" and not authorized(request, api_key):
                raise ApiError(401, "missing or wrong API key (Authorization: Bearer ..., or x-api-key)",
                               "authentication_error")
            if int(request.headers.get("content-length") or 0) > MAX_BODY:
                raise ApiError(413, f"request body larger than {MAX_BODY} bytes")
            return await call_next(request)
        except ApiError as e:
            return error_response(request, e)

    app.add_exception_handler(ApiError, api_error)
    app.add_exception_handler(Exception, server_fault)
    app.add_exception_handler(404, not_found)
    app.add_exception_handler(405, wrong_method)
    return app


async def api_error(request: Request, e: Exception) -> Response:
    assert isinstance(e, ApiError)
    return error_response(request, e)


async def server_fault(request: Request, e: Exception) -> Response:  # a bug, still in the API's shape
    return error_response(request, ApiError(500, f"internal error: {type(e).__name__}: {e}", "api_error"))


async def not_found(request: Request, _e: Exception) -> Response:
    message = f"{request.method} {request.url.path} is not a route of this server"
    return error_response(request, ApiError(404, message, "not_found_error"))


async def wrong_method(request: Request, _e: Exception) -> Response:
    return error_response(request, ApiError(405, f"method {request.method} is not allowed on {request.url.path}"))


def authorized(request: Request, api_key: str) -> bool:
    """The key as OpenAI and Ollama clients send it (Authorization: Bearer), or as Anthropic's do (x-api-key)."""
    bearer = request.headers.get("authorization", "").encode()
    header = request.headers.get("x-api-key")
    return (secrets.compare_digest(bearer, f"Bearer {api_key}".encode())
            or header is not None and secrets.compare_digest(header.encode(), api_key.encode()))


def error_response(request: Request, e: ApiError) -> Response:
    path = request.url.path
    if path == "/v1/messages" or path.startswith("/v1/messages/"):
        content: dict[str, Any] = anthropic_error(e.status, e.message)
    elif path.startswith("/v1"):
        content = {"error": {"message": e.message, "type": e.kind, "param": None, "code": None}}
    else:
        content = {"error": e.message}
    headers = {**e.headers, "x-should-retry": "true" if e.status == 503 else "false"}  # openai-python's retries
    return JSONResponse(content, status_code=e.status, headers=headers)
