"""The chat playground: a run's base and tuned models answering the same prompt side by side, streamed.

Both are served by `gemmaforge serve`'s own stack (its registry and transformers engine, on a loopback port of
this process): the run's adapter over its base, and the base alone, one engine holding the base weights for both
(so the two answers are computed in one batch). The page asks over Ollama's /api/chat, as any client would, so
what it shows is what `gemmaforge serve RUN` answers with the same system prompt and options.
"""

from __future__ import annotations

import asyncio
import json
import re
import threading
from collections.abc import AsyncIterator
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from gemmaforge.errors import UserError
from gemmaforge.serve.app import create_app
from gemmaforge.serve.registry import Registry
from gemmaforge.serve.server import app_in_background
from gemmaforge.ui.overview import read_json

Message = dict[str, str]


@dataclass(frozen=True)
class Pair:
    base: str  # the served names
    tuned: str
    system: str | None  # the run's deployed system prompt


@dataclass(frozen=True)
class Settings:
    system: str
    temperature: float
    top_p: float
    max_tokens: int
    seed: int | None

    def options(self) -> dict[str, Any]:
        chosen = {"temperature": self.temperature, "top_p": self.top_p, "num_predict": self.max_tokens}
        return {**chosen, **({"seed": self.seed} if self.seed is not None else {})}


class Playground:
    """One serve registry for the dashboard, started at the first chat; each run is added to it once."""

    def __init__(self, home: Path, num_ctx: int = 4096):
        self.home, self.num_ctx = home, num_ctx
        self._pairs: dict[Path, Pair] = {}
        self._lock = threading.Lock()
        self._stack = ExitStack()
        self._url: str | None = None
        self._registry: Registry | None = None

    def pair(self, root: Path) -> tuple[str, Pair]:
        """The server's URL and the run's two served names, loading them the first time (slow: call off the
        event loop)."""
        with self._lock:
            if self._registry is None:
                self._registry = Registry(self.home, num_ctx=self.num_ctx)
                self._stack.callback(self._registry.close)
                self._url = self._stack.enter_context(app_in_background(create_app(self._registry)))
            if root not in self._pairs:
                self._pairs[root] = self._add(self._registry, root)
            assert self._url is not None
            return self._url, self._pairs[root]

    def _add(self, registry: Registry, root: Path) -> Pair:
        """The run served under its folder's name (runs often share an Ollama name), its base beside it."""
        base_path = ((read_json(root / "manifest.json") or {}).get("base_model") or {}).get("path")
        if not base_path:
            raise UserError(f"{root}: the manifest names no base model yet (the run has not started)")
        stem = re.sub(r"[^A-Za-z0-9._-]+", "-", root.name).strip("-._")[:50] or "run"
        name = next(n for n in (stem, *(f"{stem}-{i}" for i in range(2, 1000)))
                    if registry.get(n) is None and registry.get(f"{n}-base") is None)
        tuned = registry.add(f"{name}={root}")
        try:
            base = registry.add(f"{name}-base={base_path}")
        except BaseException:
            registry.remove(tuned.name)
            raise
        return Pair(base.name, tuned.name, tuned.system)

    def close(self) -> None:
        self._stack.close()


def plain(history: list[dict[str, Any]]) -> list[Message]:
    """A chat history with text content: the page hands its turns back as lists of parts ({"type": "text",
    "text": ...}), as Gradio's chatbot normalizes them."""
    def text(content: Any) -> str:
        if isinstance(content, str):
            return content
        parts = [part for part in content if isinstance(part, dict) and part.get("type") == "text"]
        return "".join(part.get("text", "") for part in parts)

    return [{"role": m["role"], "content": text(m["content"])} for m in history if m["role"] in ("user", "assistant")]


def conversation(history: list[Message], prompt: str, system: str) -> list[Message]:
    """What one side is asked: the system prompt, that side's own earlier turns, the new prompt."""
    turns = plain(history)
    return [*([{"role": "system", "content": system}] if system.strip() else []), *turns,
            {"role": "user", "content": prompt}]


async def stream_chat(client: httpx.AsyncClient, model: str, messages: list[Message],
                      options: dict[str, Any]) -> AsyncIterator[str]:
    """The answer's text pieces from Ollama's /api/chat (NDJSON); an error answer raises UserError."""
    body = {"model": model, "messages": messages, "options": options, "stream": True}
    async with client.stream("POST", "/api/chat", json=body, timeout=None) as response:
        if response.status_code != 200:
            detail = (await response.aread()).decode("utf-8", errors="replace")
            raise UserError(f"{model}: {json.loads(detail).get('error', detail) if detail.startswith('{') else detail}")
        async for line in response.aiter_lines():
            if line.strip():
                event = json.loads(line)
                if "error" in event:
                    raise UserError(f"{model}: {event['error']}")
                yield event.get("message", {}).get("content", "")


async def side_by_side(url: str, pair: Pair, histories: tuple[list[Message], list[Message]], prompt: str,
                       settings: Settings, every_s: float = 0.1) -> AsyncIterator[tuple[list[Message], ...]]:
    """Both answers as they stream: the two chat histories (base, tuned), each with the prompt and the answer so
    far, every every_s seconds and once more at the end."""
    sent = [plain(h) for h in histories]
    shown = tuple([*h, {"role": "user", "content": prompt}, {"role": "assistant", "content": ""}] for h in sent)

    async def answer(client: httpx.AsyncClient, model: str, history: list[Message], into: list[Message]) -> None:
        async for piece in stream_chat(client, model, conversation(history, prompt, settings.system),
                                       settings.options()):
            into[-1]["content"] += piece

    async with httpx.AsyncClient(base_url=url) as client:
        tasks = [asyncio.create_task(answer(client, model, history, into))
                 for model, history, into in zip((pair.base, pair.tuned), sent, shown)]
        try:
            while not all(task.done() for task in tasks):
                await asyncio.wait(tasks, timeout=every_s)
                yield shown
            for task in tasks:
                task.result()  # an answer's error, raised here
        finally:
            for task in tasks:
                task.cancel()
    yield shown
