"""Embeddings on both APIs, from the served model itself: Ollama's /api/embed (one text or many, `truncate`,
`dimensions`) and its legacy /api/embeddings (one `prompt`), OpenAI's /v1/embeddings (`float` or `base64`).

The vector is the mean of the model's final hidden states over <bos> and the text's tokens (llama.cpp's MEAN
pooling, which the llama.cpp engine uses), with the served adapter. /api/embed and /v1/embeddings scale it to
unit length as Ollama does (cut to `dimensions` first, then scaled again); /api/embeddings returns it as it is,
as Ollama's legacy route does."""

from __future__ import annotations

import base64
import math
import struct
import time
from dataclasses import dataclass
from typing import Any

from gemmaforge.serve.protocol import bad, field


@dataclass(frozen=True)
class EmbedRequest:
    texts: list[str]
    truncate: bool  # False: a text longer than the context is refused rather than cut
    normalize: bool
    dimensions: int | None = None
    base64: bool = False  # OpenAI's encoding_format "base64": little-endian float32, base64-encoded
    started_ns: int = 0


def ollama_request(data: dict[str, Any], legacy: bool) -> EmbedRequest:
    started = time.perf_counter_ns()
    if legacy:  # /api/embeddings: {"prompt": "..."}; an empty prompt only loads the model
        prompt = field(data, "prompt", str, "")
        return EmbedRequest([prompt] if prompt else [], truncate=True, normalize=False, started_ns=started)
    texts = _texts(data.get("input"), "input")
    return EmbedRequest(texts, truncate=field(data, "truncate", bool, True), normalize=True,
                        dimensions=_dimensions(data), started_ns=started)


def openai_request(data: dict[str, Any]) -> EmbedRequest:
    encoding = field(data, "encoding_format", str, "float")
    if encoding not in ("float", "base64"):
        raise bad(f"encoding_format: {encoding!r} is not supported; expected 'float' or 'base64'")
    texts = _texts(data.get("input"), "input")
    if not texts:
        raise bad("input: at least one text is required")
    if any(not text for text in texts):
        raise bad("input: texts must not be empty")
    return EmbedRequest(texts, truncate=True, normalize=True, dimensions=_dimensions(data),
                        base64=encoding == "base64", started_ns=time.perf_counter_ns())


def vectors(request: EmbedRequest, pooled: list[list[float]]) -> list[list[float]]:
    if not request.normalize:
        return pooled
    out = []
    for vector in pooled:
        vector = _unit(vector)
        if request.dimensions and request.dimensions < len(vector):
            vector = _unit(vector[:request.dimensions])
        out.append(vector)
    return out


def ollama_response(model: str, request: EmbedRequest, pooled: list[list[float]], tokens: int,
                    legacy: bool) -> dict[str, Any]:
    if legacy:
        return {"embedding": pooled[0] if pooled else []}
    return {"model": model, "embeddings": vectors(request, pooled),
            "total_duration": time.perf_counter_ns() - request.started_ns, "load_duration": 0,
            "prompt_eval_count": tokens}


def openai_response(model: str, request: EmbedRequest, pooled: list[list[float]], tokens: int) -> dict[str, Any]:
    data = []
    for i, vector in enumerate(vectors(request, pooled)):
        encoded: Any = (base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode() if request.base64
                        else vector)
        data.append({"object": "embedding", "index": i, "embedding": encoded})
    return {"object": "list", "data": data, "model": model,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}


def _texts(value: Any, key: str) -> list[str]:
    if value is None:
        return []
    if isinstance(value, str):
        return [value] if value else []
    if isinstance(value, list) and all(isinstance(v, str) for v in value):
        return list(value)
    if isinstance(value, list) and all(isinstance(v, (int, list)) for v in value):
        raise bad(f"{key}: token ids are not supported; send the text")
    raise bad(f"{key}: expected a string or an array of strings")


def _dimensions(data: dict[str, Any]) -> int | None:
    dimensions = field(data, "dimensions", int)
    if dimensions is not None and dimensions < 1:
        raise bad(f"dimensions: expected a positive number, got {dimensions}")
    return dimensions


def _unit(vector: list[float]) -> list[float]:
    if any(math.isnan(v) or math.isinf(v) for v in vector):
        raise bad("the embedding contains NaN or Inf values")
    norm = max(math.sqrt(sum(v * v for v in vector)), 1e-12)
    return [v / norm for v in vector]
