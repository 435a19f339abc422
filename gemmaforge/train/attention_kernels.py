"""The attention kernels a packed batch can go through, each computing causal attention within each example.

- `segments`: each example's span alone through SDPA (math with soft-capping, for Gemma 2), split by the lengths
  the collator gave: the work follows the sum of the squared example lengths, not the squared row length.
  Runs everywhere; the CPU's fastest (benchmarks/train_ablation.py). On a GPU it launches one kernel per example.
- `flash`: FlashAttention 2's varlen kernel over the flattened batch (`flash_attn`: CUDA, and ROCm's CK and
  Triton builds), with `cu_seqlens` from the host; soft-capping and sliding windows built in; head sizes <= 256.
- `flex`: torch's flex_attention, compiled, with one block mask per batch and window; soft-capping as a score
  modifier.

Every kernel takes query (B, Hq, T, D), key and value (B, Hkv, T, D) and returns (B, T, Hq, D), as transformers'
attention functions do.
"""

from __future__ import annotations

import functools
import importlib.util
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from transformers.integrations.sdpa_attention import repeat_kv, sdpa_attention_forward

from gemmaforge.train.segments import PackedSegments

KERNELS = ("segments", "flash", "flex")
FLASH_MAX_HEAD_DIM = 256  # FlashAttention 2's largest head size (Gemma 4's global layers have 512)


def unavailable(kernel: str, device: torch.device) -> str | None:
    """Why `kernel` cannot run on `device` in this environment; None when it can."""
    if kernel == "segments":
        return None
    if device.type != "cuda":  # ROCm builds of torch use the cuda device type too
        return f"{kernel} needs a GPU (this run trains on the {device.type})"
    if kernel == "flash" and importlib.util.find_spec("flash_attn") is None:
        return "flash needs FlashAttention 2 (pip install flash-attn; on ROCm the build for the GPU's arch)"
    if kernel == "flex" and not hasattr(torch.nn.attention, "flex_attention"):
        return f"flex needs torch >= 2.5 (this is {torch.__version__})"
    return None


def supports(kernel: str, head_dim: int, dtype: torch.dtype) -> str | None:
    """Why `kernel` cannot take layers of this head size and dtype; None when it can."""
    if kernel == "flash" and head_dim > FLASH_MAX_HEAD_DIM:
        return f"flash takes head sizes up to {FLASH_MAX_HEAD_DIM}, not {head_dim}"
    if kernel == "flash" and dtype not in (torch.bfloat16, torch.float16):
        return f"flash computes in bf16 or fp16, not {dtype}"
    return None


def attend(kernel: str, module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
           segments: PackedSegments, scaling: float | None, window: int | None, softcap: float | None,
           dropout: float) -> torch.Tensor:
    return _FORWARDS[kernel](module, query, key, value, segments, scaling, window, softcap, dropout)


def _segments(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, segments: PackedSegments,
              scaling: float | None, window: int | None, softcap: float | None, dropout: float) -> torch.Tensor:
    rows = []
    # unbind/split/cat rather than indexing: their backward is one stack/cat, where each index's backward
    # would allocate a zero gradient of the whole tensor
    for q, k, v, lengths in zip(query.unbind(0), key.unbind(0), value.unbind(0), segments.rows):
        spans = zip(q.split(lengths, dim=1), k.split(lengths, dim=1), v.split(lengths, dim=1))  # (H, n, D) each
        rows.append(torch.cat([_one_example(module, *span, scaling, window, softcap, dropout) for span in spans],
                              dim=1))
    return torch.cat(rows)


def _one_example(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scaling: float | None,
                 window: int | None, softcap: float | None, dropout: float) -> torch.Tensor:
    """One example's causal attention: (H, n, D) each -> (1, n, H, D)."""
    n = query.shape[1]
    band = None
    if window and n > window:  # the window cuts into this example
        i = torch.arange(n, device=query.device)
        distance = i[:, None] - i[None, :]
        band = (distance >= 0) & (distance < window)  # (n, n), True = attend
    if softcap:
        return _capped(module, query[None], key[None], value[None], band, scaling, softcap, dropout)
    return sdpa_attention_forward(module, query[None], key[None], value[None], band, dropout=dropout, scaling=scaling,
                                  is_causal=band is None)[0]


def _capped(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, band: torch.Tensor | None,
            scaling: float | None, softcap: float, dropout: float) -> torch.Tensor:
    """Soft-capped attention as transformers' eager path computes it (SDPA has no soft-cap): (1, n, H, D)."""
    n = query.shape[2]
    key, value = (repeat_kv(t, module.num_key_value_groups) for t in (key, value))
    scores = query @ key.transpose(2, 3) * (scaling if scaling is not None else query.shape[-1] ** -0.5)
    scores = torch.tanh(scores / softcap) * softcap
    allowed = band if band is not None else torch.ones(n, n, dtype=torch.bool, device=query.device).tril()
    scores = scores.masked_fill(~allowed, torch.finfo(scores.dtype).min)
    probs = F.dropout(scores.softmax(dim=-1, dtype=torch.float32).to(query.dtype), p=dropout, training=dropout > 0)
    return (probs @ value).transpose(1, 2)


def _flash(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, segments: PackedSegments,
           scaling: float | None, window: int | None, softcap: float | None, dropout: float) -> torch.Tensor:
    from flash_attn import flash_attn_varlen_func

    batch, heads, tokens, head_dim = query.shape
    q, k, v = (t.transpose(1, 2).reshape(batch * tokens, t.shape[1], head_dim) for t in (query, key, value))
    cu = segments.cu_seqlens(query.device)
    out = flash_attn_varlen_func(q, k, v, cu, cu, segments.max_length, segments.max_length, dropout_p=dropout,
                                 softmax_scale=scaling, causal=True,
                                 window_size=(window - 1, 0) if window else (-1, -1), softcap=softcap or 0.0)
    return out.view(batch, tokens, heads, head_dim)


def _flex(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, segments: PackedSegments,
          scaling: float | None, window: int | None, softcap: float | None, dropout: float) -> torch.Tensor:
    if dropout:
        raise ValueError("flex attention here has no attention dropout (Gemma trains without it)")
    block_mask = segments.cached(("flex_block_mask", window, query.device),
                                 lambda: _block_mask(segments, window, query.device))
    out = _flex_attention(query.device.type)(query, key, value, score_mod=_soft_cap(softcap), block_mask=block_mask,
                                             scale=scaling, enable_gqa=key.shape[1] != query.shape[1])
    return out.transpose(1, 2)


def _block_mask(segments: PackedSegments, window: int | None, device: torch.device) -> Any:
    from torch.nn.attention.flex_attention import create_block_mask

    documents = segments.document_ids(device)

    def within_example(b: Any, h: Any, q: Any, kv: Any) -> Any:
        allowed = (documents[b, q] == documents[b, kv]) & (q >= kv)
        return allowed & (q - kv < window) if window else allowed

    return create_block_mask(within_example, len(segments.rows), None, segments.width, segments.width, device=device)


@functools.cache
def _soft_cap(softcap: float | None) -> Callable[..., Any] | None:
    if not softcap:
        return None

    def capped(score: Any, b: Any, h: Any, q: Any, kv: Any) -> Any:
        return torch.tanh(score / softcap) * softcap

    return capped


@functools.cache
def _flex_attention(device_type: str) -> Callable[..., Any]:
    """Compiled on a GPU (flex_attention's speed comes from the kernel inductor writes); eager elsewhere (tests)."""
    from torch.nn.attention.flex_attention import flex_attention

    eager: Callable[..., Any] = flex_attention
    return torch.compile(eager, dynamic=False) if device_type == "cuda" else eager


_FORWARDS: dict[str, Callable[..., torch.Tensor]] = {"segments": _segments, "flash": _flash, "flex": _flex}
