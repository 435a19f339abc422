"""Ollama's model admin routes (what Open WebUI's admin pages call): delete, copy and create change what this
server serves; pull and push answer in Ollama's shape why this server does not, and what to do instead.

/api/create makes a model `FROM` a served model (another name with its own system prompt and parameters, as a
Modelfile over an existing model does) or from a run directory, model folder or .gguf file on the server's disk.
What would need uploaded blobs (files, adapters) or a conversion (quantize) is refused with the command to use,
and a TEMPLATE is refused unless it is the family's own: the prompt format is the one the model was trained on.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response

from gemmaforge.errors import UserError
from gemmaforge.serve import protocol as p
from gemmaforge.serve.ollama_api import ndjson, options_of
from gemmaforge.serve.protocol import bad
from gemmaforge.serve.registry import Served, check_name
from gemmaforge.serve.state import State

# the Modelfile PARAMETERs a created model may set: the sampling defaults its requests start from
PARAMETERS = ("temperature", "top_p", "top_k", "min_p", "repeat_penalty", "repeat_last_n", "seed", "num_predict",
              "num_ctx")
_REFUSED = {
    "files": "uploaded blobs are not supported; name a run directory, model folder or .gguf file in `from`",
    "adapters": "uploaded adapters are not supported; serve the run directory (from: RUN_DIR) or load the "
                "adapter with POST /v1/load_lora_adapter",
    "quantize": "quantizing is not done here; export the quant with `gemmaforge export gguf RUN_DIR --quant Q` and "
                "create from that file",
    "messages": "a preset conversation is not supported; send it with each request",
}
SUCCESS = ndjson({"status": "success"})  # one status line: Ollama's last, read alike streamed or not


router = APIRouter()


@router.delete("/api/delete")
async def delete(request: Request, state: State) -> Response:
    name = p.model_name(await state.body(request))
    if await asyncio.to_thread(state.registry.remove, state.served_or_404(name).name) is None:
        state.served_or_404(name)  # removed meanwhile by another request: 404 as for any unknown model
    return Response(status_code=200)


@router.post("/api/copy")
async def copy(request: Request, state: State) -> Response:
    data = await state.body(request)
    source, destination = p.required(data, "source", "destination")
    state.served_or_404(source)
    await _changing(asyncio.to_thread(state.registry.copy, source, destination), lambda: state.served_or_404(source))
    return Response(status_code=200)


@router.post("/api/create")
async def create(request: Request, state: State) -> Response:
    data = await state.body(request)
    name, source = p.model_name(data), p.field(data, "from", str)
    for key, why in _REFUSED.items():
        if data.get(key):
            raise bad(f"{key}: {why}")
    if not source:
        raise bad("from: required (a served model, or a run directory, model folder or .gguf file)")
    system, parameters = p.field(data, "system", str), p.field(data, "parameters", dict, {})
    template = p.field(data, "template", str)

    def make() -> Served:
        if state.registry.get(source) is not None:
            served = state.registry.copy(source, name)
        else:
            served = state.registry.add(f"{check_name(name)}={source}")
        try:
            _customize(served, system, parameters, template)
        except BaseException:
            state.registry.remove(served.name)
            raise
        return served

    await _changing(asyncio.to_thread(make), lambda: state.served_or_404(source))
    return Response(SUCCESS, media_type="application/x-ndjson")


@router.post("/api/pull")
async def pull(request: Request, state: State) -> Response:
    name = p.model_name(await state.body(request))
    if state.registry.get(name) is not None:  # nothing to fetch: it is here (Ollama's answer once it has it)
        return Response(SUCCESS, media_type="application/x-ndjson")
    raise bad(f"{name}: gemmaforge serve does not pull from a model registry; it serves the run directories, "
              "model folders and .gguf files named on its command line (gemmaforge serve runs/NAME), those "
              "given to POST /api/create, and adapters loaded with POST /v1/load_lora_adapter")


@router.post("/api/push")
async def push(request: Request, state: State) -> Response:
    served = state.served_or_404(p.model_name(await state.body(request)))
    modelfile = served.source / "ollama" / "Modelfile"
    how = (f"ollama create {served.name} -f {modelfile} && ollama push NAMESPACE/{served.name}"
           if modelfile.is_file() else "gemmaforge export ollama RUN_DIR, then ollama create and ollama push")
    raise bad(f"{served.name}: gemmaforge serve does not push to a model registry; publish the exported "
              f"model with Ollama itself: {how}")


async def _changing(change: Awaitable[Any], missing: Callable[[], Any]) -> None:
    """Await a registry change: a user's mistake is a 400; a model removed meanwhile is a 404."""
    try:
        await change
    except UserError as e:
        raise bad(str(e)) from None
    except KeyError:
        missing()
        raise


def _customize(served: Served, system: str | None, parameters: dict[str, Any], template: str | None) -> None:

    if template is not None and template != served.family.chat.go_template():
        raise UserError("template: only the family's own TEMPLATE is served (the format the model was trained on; "
                        "see /api/show); leave it out")
    unknown = sorted(set(parameters) - set(PARAMETERS))
    if unknown:
        raise UserError(f"parameters: {', '.join(unknown)} not supported; expected some of {', '.join(PARAMETERS)}")
    options_of(served, parameters)  # each value's type, as a request's options are checked
    served.options = {**served.options, **parameters}
    if system is not None:
        served.system = system
