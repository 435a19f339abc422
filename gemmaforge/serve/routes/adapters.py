"""Adapters added and removed while the server runs, on vLLM's routes (/v1/load_lora_adapter and
/v1/unload_lora_adapter), so clients written for vLLM's LoRA serving work unchanged."""

from __future__ import annotations

import asyncio
from pathlib import Path

from fastapi import APIRouter, Request
from fastapi.responses import PlainTextResponse, Response

from gemmaforge.errors import UserError
from gemmaforge.serve import protocol as p
from gemmaforge.serve.protocol import ApiError, bad
from gemmaforge.serve.registry import check_name
from gemmaforge.serve.state import State

router = APIRouter()


@router.post("/v1/load_lora_adapter")
async def load_lora_adapter(request: Request, state: State) -> Response:
    name, path = p.required(await state.body(request), "lora_name", "lora_path")
    try:
        check_name(name, "lora_name")
        if state.registry.get(name) is not None:
            raise bad(f"lora_name {name!r} is already served")
        adapter = Path(path).expanduser()
        if not adapter.is_dir():
            raise bad(f"lora_path {path!r} is not a folder")
        await asyncio.to_thread(state.registry.add_adapter, name, adapter)
    except ApiError:
        raise
    except UserError as e:
        raise bad(str(e)) from None
    except Exception as e:  # noqa: BLE001  (an unreadable or mismatched adapter is the request's fault)
        raise bad(f"lora_path {path!r}: could not load the adapter ({type(e).__name__}: {e})") from None
    return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")


@router.post("/v1/unload_lora_adapter")
async def unload_lora_adapter(request: Request, state: State) -> Response:
    (name,) = p.required(await state.body(request), "lora_name")
    served = state.served_or_404(name)
    if served.adapter is None:
        raise bad(f"{served.name} is not a LoRA adapter")
    if await asyncio.to_thread(state.registry.remove, served.name) is None:
        state.served_or_404(name)
    return PlainTextResponse(f"Success: LoRA adapter '{name}' removed successfully.")
