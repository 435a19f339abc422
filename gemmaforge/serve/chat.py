"""`gemmaforge chat`: a terminal chat against any Ollama-compatible server (ours, or Ollama itself), or
against a run served in-process for the session. Answers stream as they are generated."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from typing import Any, TextIO

from gemmaforge.errors import UserError

HELP = "commands: /system TEXT (set the system prompt), /reset (forget the conversation), /exit"


def pick_model(url: str, wanted: str | None, headers: dict[str, str]) -> str:
    import httpx

    try:
        response = httpx.get(f"{url}/api/tags", headers=headers, timeout=10)
    except httpx.HTTPError as e:
        raise UserError(f"{url}: no Ollama-compatible server answers there ({type(e).__name__})") from None
    if response.status_code != 200:
        raise UserError(f"{url}/api/tags answered {response.status_code}: {response.text[:200]}")
    names = [m["name"] for m in response.json().get("models", [])]
    if wanted:
        full = wanted if ":" in wanted else f"{wanted}:latest"
        if full not in names and wanted not in names:
            raise UserError(f"model {wanted!r} is not served at {url}; served: {', '.join(names) or 'none'}")
        return wanted
    if len(names) != 1:
        raise UserError(f"{url} serves {len(names)} models ({', '.join(names) or 'none'}): choose one with --model")
    return names[0]


def chat_loop(url: str, model: str, *, system: str | None = None, options: dict[str, Any] | None = None,
              headers: dict[str, str] | None = None, read: Callable[[str], str] = input,
              out: TextIO | None = None) -> None:
    import httpx

    out = out or sys.stdout  # the stdout of the call, not of the import (a redirect made later still counts)
    history: list[dict[str, str]] = []
    out.write(f"chatting with {model} at {url} ({HELP})\n")
    while True:
        try:
            line = read(">>> ").strip()
        except EOFError:
            out.write("\n")
            return
        if not line:
            continue
        if line in ("/exit", "/bye", "/quit"):
            return
        if line == "/reset":
            history.clear()
            out.write("(conversation forgotten)\n")
            continue
        if line.startswith("/system"):
            system = line.removeprefix("/system").strip() or None
            out.write(f"(system prompt {'set' if system else 'cleared'})\n")
            continue
        if line.startswith("/"):
            out.write(f"unknown command {line.split()[0]}; {HELP}\n")
            continue
        history.append({"role": "user", "content": line})
        messages = ([{"role": "system", "content": system}] if system else []) + history
        body = {"model": model, "messages": messages, "stream": True, "options": options or {}}
        try:
            answer = _stream_answer(url, body, headers, out)
        except (httpx.HTTPError, json.JSONDecodeError) as e:
            answer = None
            out.write(f"\nerror: the server at {url} failed ({type(e).__name__}: {e})")
        out.write("\n")
        if answer is None:  # nothing usable came back: the question is not kept either
            history.pop()
        else:
            history.append({"role": "assistant", "content": answer})


def _stream_answer(url: str, body: dict[str, Any], headers: dict[str, str] | None, out: TextIO) -> str | None:
    """Stream one answer to `out`; None when the server refused or failed it."""
    import httpx

    answer = []
    with httpx.stream("POST", f"{url}/api/chat", json=body, headers=headers, timeout=None) as response:
        if response.status_code != 200:
            out.write(f"error {response.status_code}: {_error_text(response.read())}")
            return None
        for raw in response.iter_lines():
            chunk = json.loads(raw)
            if "error" in chunk:
                out.write(f"\nerror: {chunk['error']}")
                return None
            text = chunk.get("message", {}).get("content", "")
            answer.append(text)
            out.write(text)
            out.flush()
    return "".join(answer)


def _error_text(raw: bytes) -> str:
    try:
        error = json.loads(raw).get("error")
    except (json.JSONDecodeError, AttributeError):
        return raw.decode(errors="replace")[:200]
    return error.get("message", str(error)) if isinstance(error, dict) else str(error)
