"""`gemmaforge serve`: load the models, then run the app under uvicorn (or in a background thread, for
`gemmaforge chat RUN_DIR` and tests)."""

from __future__ import annotations

import ipaddress
import os
import socket
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gemmaforge.console import console
from gemmaforge.errors import UserError
from gemmaforge.serve.registry import Registry


@dataclass(frozen=True)
class ServeOptions:
    host: str = "127.0.0.1"
    port: int = 11434
    engine: str = "transformers"  # for run directories: transformers (adapters) or llamacpp (their GGUF)
    dtype: str = "auto"  # the transformers engine's weights: auto (bf16 where the hardware has it), bf16, fp32
    api_key: str | None = None
    num_ctx: int = 4096
    max_batch: int = 16
    max_queue: int = 64
    max_tokens: int = 4096
    timeout_s: float = 600.0
    keep_alive: float = -1.0  # seconds a model stays loaded after its last request; < 0: until the server stops


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_exposure(options: ServeOptions) -> None:
    if not is_loopback(options.host) and not options.api_key:
        raise UserError(f"--host {options.host} exposes the server beyond this machine: give --api-key KEY "
                        "(or GEMMAFORGE_API_KEY) so that clients must send Authorization: Bearer KEY")


def load_registry(specs: list[str], options: ServeOptions, home: Path) -> Registry:
    if not specs:
        raise UserError("name at least one run directory, model folder, .gguf file or 'gemma3-270m' to serve")
    registry = Registry(home, num_ctx=options.num_ctx, max_batch=options.max_batch, max_queue=options.max_queue,
                        dtype=options.dtype, keep_alive=options.keep_alive)
    try:
        for spec in specs:
            served = registry.add(spec, options.engine)
            console.print(f"[bold]serve[/]: {served.name} <- {served.source} ({served.engine.kind}"
                          f"{f', adapter on {served.parent}' if served.adapter else ''})")
    except BaseException:
        registry.close()
        raise
    return registry


def serve(specs: list[str], options: ServeOptions, home: Path) -> None:
    import uvicorn

    from gemmaforge.serve.app import create_app

    check_exposure(options)
    registry = load_registry(specs, options, home)
    app = create_app(registry, api_key=options.api_key, max_tokens=options.max_tokens, timeout_s=options.timeout_s)
    console.print(f"[bold]serve[/]: http://{options.host}:{options.port} (Ollama API under /api, OpenAI under /v1)")
    try:
        uvicorn.run(app, host=options.host, port=options.port, log_level="warning", timeout_graceful_shutdown=5)
    finally:
        registry.close()


@contextmanager
def background_server(registry: Registry, options: ServeOptions) -> Iterator[str]:
    """The app on a free loopback port in a daemon thread; yields its base URL."""
    from gemmaforge.serve.app import create_app

    app = create_app(registry, api_key=options.api_key, max_tokens=options.max_tokens, timeout_s=options.timeout_s)
    with app_in_background(app) as url:
        yield url


@contextmanager
def app_in_background(app: Any) -> Iterator[str]:
    """Any ASGI app on a free loopback port in a daemon thread (uvicorn); yields its base URL."""
    import uvicorn

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=2))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    while not server.started:
        if not thread.is_alive():
            raise RuntimeError("the server thread stopped before it started")
        threading.Event().wait(0.02)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        sock.close()


def api_key_from_env(given: str | None) -> str | None:
    return given or os.environ.get("GEMMAFORGE_API_KEY") or None
