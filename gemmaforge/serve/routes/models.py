"""What is served: Ollama's root, version, model list, loaded models and model card (/api/show), and OpenAI's
model list and model object."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import PlainTextResponse, Response

from gemmaforge import __version__
from gemmaforge.export.ollama import GEMMA_TERMS
from gemmaforge.serve import protocol as p
from gemmaforge.serve.registry import Served
from gemmaforge.serve.state import State

router = APIRouter()


@router.api_route("/", methods=["GET", "HEAD"])
async def root() -> Response:
    return PlainTextResponse("Ollama is running")


@router.get("/api/version")
async def version() -> dict[str, str]:
    return {"version": __version__}


@router.get("/api/tags")
async def tags(state: State) -> dict[str, Any]:
    return {"models": [{"name": m.name, "model": m.name, "modified_at": m.modified_at, "size": m.size,
                        "digest": m.digest, "details": m.details} for m in list(state.registry.models.values())]}


@router.get("/api/ps")
async def ps(state: State) -> dict[str, Any]:
    """The loaded models: when keep_alive unloads each (a model kept until the server stops shows Ollama's
    "forever", the longest duration Go has), and how much of its weights sit in GPU memory."""
    forever = datetime.now(UTC) + timedelta(microseconds=2**63 // 1000)
    return {"models": [{"name": m.name, "model": m.name, "size": m.size, "digest": m.digest, "details": m.details,
                        "expires_at": (m.expires_at or forever).isoformat(),
                        "size_vram": m.size if str(m.engine.device).startswith("cuda") else 0,
                        "context_length": state.registry.num_ctx}
                       for m in list(state.registry.models.values()) if m.loaded]}


@router.post("/api/show")
async def show(request: Request, state: State) -> dict[str, Any]:
    served = state.served_or_404(p.model_name(await state.body(request)))
    parameters = "\n".join([*(f"{k} {v}" for k, v in served.options.items()),
                            *(f'stop "{s}"' for s in served.family.stop)])
    return {"license": GEMMA_TERMS, "modelfile": f"# served by gemmaforge from {served.source}\n",
            "parameters": parameters, "template": served.family.chat.go_template(), "system": served.system or "",
            "details": served.details, "model_info": {"general.architecture": served.family.gguf_arch},
            "capabilities": ["completion", *(["tools"] if served.tools else []),
                             *(["thinking"] if served.family.chat.thinking else []),
                             *(["vision"] if served.engine.vision else []),
                             *(["audio"] if served.engine.audio_rate else [])],
            "modified_at": served.modified_at}


@router.get("/v1/models")
async def models(state: State) -> dict[str, Any]:
    return {"object": "list", "data": [model_object(m) for m in list(state.registry.models.values())]}


@router.get("/v1/models/{name:path}")
async def model(name: str, state: State) -> dict[str, Any]:
    return model_object(state.served_or_404(name))


def model_object(m: Served) -> dict[str, Any]:
    created = int(datetime.fromisoformat(m.modified_at).timestamp()) if m.modified_at else 0
    return {"id": m.name, "object": "model", "created": created, "owned_by": "gemmaforge",
            **({"parent": m.parent} if m.parent else {})}
