"""What every route of the server reads: the registry of served models, the server's limits, and the request
steps the routes share (a body bounded in size, the named model or a 404, a loaded model, a job's events under
the time limit). One AppState per app, on `app.state.serve`; a route takes it as the `State` dependency, so the
routes are plain functions in routers (gemmaforge/serve/routes/) rather than closures inside the app factory."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Annotated, Any

from fastapi import Depends, Request

from gemmaforge.console import console, escape
from gemmaforge.inference.jobs import Event, Failed, Finished, Job, QueueFull
from gemmaforge.serve import protocol as p
from gemmaforge.serve.protocol import ApiError, Limits
from gemmaforge.serve.registry import Registry, Served

MAX_BODY = 32 * 2**20  # a few camera photos in base64


@dataclass(frozen=True)
class AppState:
    registry: Registry
    limits: Limits
    timeout_s: float  # the longest a generation may run

    async def body(self, request: Request) -> dict[str, Any]:
        raw = bytearray()
        async for chunk in request.stream():  # bounded even without a Content-Length header
            raw += chunk
            if len(raw) > MAX_BODY:
                raise ApiError(413, f"request body larger than {MAX_BODY} bytes")
        return p.parse_json(bytes(raw))

    def served_or_404(self, name: str) -> Served:
        served = self.registry.get(name)
        if served is None:
            raise ApiError(404, f"model '{name}' not found", "not_found_error")
        return served

    async def ready(self, data: dict[str, Any]) -> tuple[Served, float | None]:
        """The request's model, loaded again if keep_alive had unloaded it, and the request's keep_alive."""
        served, keep = self.served_or_404(p.model_name(data)), p.keep_alive(data)
        try:  # on a thread: the registry's lock may be held while another model loads
            served = await asyncio.to_thread(self.registry.ensure_loaded, served.name, keep)
        except KeyError:  # removed meanwhile
            self.served_or_404(served.name)
        return served, keep

    async def events(self, served: Served, job: Job, request: Request) -> AsyncIterator[Event]:
        """Submit a job and yield its events; a disconnected client or the timeout cancels it. The model is
        kept loaded after it as the latest request's keep_alive says (see Registry.keep)."""
        try:
            served.engine.submit(job)
        except QueueFull as e:
            self.registry.keep(served.name)
            raise ApiError(503, f"the server is busy ({e}); retry shortly", "api_error", {"Retry-After": "1"}) from None
        begin = time.monotonic()
        deadline = begin + self.timeout_s
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
            self.registry.keep(served.name)
            # one line a request, as Ollama logs them: what ended it shows a client's stop button working
            console.print(f"[bold]serve[/]: {request.method} {request.url.path} {served.name} "
                          f"({len(job.prompt_ids)} prompt tokens): {outcome}, {time.monotonic() - begin:.2f} s",
                          highlight=False)


def app_state(request: Request) -> AppState:
    state: AppState = request.app.state.serve
    return state


State = Annotated[AppState, Depends(app_state)]
