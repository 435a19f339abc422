"""The embedding routes: Ollama's /api/embed and legacy /api/embeddings, OpenAI's /v1/embeddings. Their requests
and answers are read and written in gemmaforge/serve/embeddings.py; here they meet the served model."""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import APIRouter, Request

from gemmaforge.serve import embeddings as emb
from gemmaforge.serve.protocol import bad
from gemmaforge.serve.registry import Served
from gemmaforge.serve.state import AppState, State

router = APIRouter()


async def embed(state: AppState, data: dict[str, Any], request: emb.EmbedRequest) -> tuple[list[list[float]], int]:
    served, _keep = await state.ready(data)
    try:
        return await _embedded(state, served, request)
    finally:
        state.registry.keep(served.name)


async def _embedded(state: AppState, served: Served, request: emb.EmbedRequest) -> tuple[list[list[float]], int]:
    num_ctx = state.registry.num_ctx
    if not request.truncate:
        for i, text in enumerate(request.texts):
            if len(served.engine.encode(text)) + 1 > num_ctx:  # and <bos>
                raise bad(f"input[{i}]: the input length exceeds the context length ({num_ctx} tokens)")
    if not request.texts:  # Ollama's way of loading a model
        return [], 0
    return await asyncio.to_thread(served.engine.embed, request.texts, served.adapter)


@router.post("/api/embed")
async def ollama_embed(request: Request, state: State) -> dict[str, Any]:
    data = await state.body(request)
    asked = emb.ollama_request(data, legacy=False)
    return emb.ollama_response(data["model"], asked, *await embed(state, data, asked), legacy=False)


@router.post("/api/embeddings")
async def ollama_embeddings(request: Request, state: State) -> dict[str, Any]:
    data = await state.body(request)
    asked = emb.ollama_request(data, legacy=True)
    return emb.ollama_response(data["model"], asked, *await embed(state, data, asked), legacy=True)


@router.post("/v1/embeddings")
async def openai_embeddings(request: Request, state: State) -> dict[str, Any]:
    data = await state.body(request)
    asked = emb.openai_request(data)
    return emb.openai_response(data["model"], asked, *await embed(state, data, asked))
