"""Train a few embedding rows (the chat markers) without touching the other 262k.

PEFT's `trainable_token_indices` rebuilds the whole embedding matrix with the trained rows copied
in at every forward, and in the tied output layer that makes autograd compute the gradient of the
full 262,144 x hidden weight. Both give the same result as the base layer plus a correction on
the few trained rows, which is what `_sparse_forward` computes: the base layer's output, then
  * input side:  positions holding a trained token get (delta - base row) * embed scale added,
  * output side: the logits of the trained tokens are recomputed as x @ delta^T.
Same values and gradients (tested against PEFT's own forward), a fraction of the work.
"""

from __future__ import annotations

import types
from typing import Any, cast

import torch
from peft.tuners.trainable_tokens.layer import TrainableTokensLayer


def token_index(layer: TrainableTokensLayer, adapter: str, device: torch.device) -> torch.Tensor:
    """The adapter's trained token ids as a tensor on `device`, made once: a tensor built from a Python list at
    every forward is a copy from pageable memory, which waits for the GPU to finish what it was doing."""
    cache = layer.__dict__.setdefault("_gemmaforge_token_index", {})
    key = (adapter, str(device))
    if key not in cache:
        cache[key] = torch.tensor(layer.token_indices[adapter], device=device)
    return cache[key]


def trained_tokens(layer: TrainableTokensLayer, x: torch.Tensor, result: torch.Tensor, adapter: str,
                   rows: torch.Tensor | None = None) -> torch.Tensor:
    """`result` (the base layer's output for `x`) with `adapter`'s trained rows applied: to every row of the batch,
    or where `rows` (B, 1, 1) is true (serving decodes rows of several adapters in one forward)."""
    weight = cast(torch.Tensor, layer.base_layer.weight)
    index = token_index(layer, adapter, weight.device)
    delta = layer.trainable_tokens_delta[adapter].to(weight)  # (K, H) the trained rows
    if isinstance(layer.base_layer, torch.nn.Embedding):
        scale = layer._get_embed_scale()
        correction = (delta - weight[index]) * (scale.to(weight) if scale is not None else 1.0)  # (K, H)
        hits = (x.unsqueeze(-1) == index).to(result.dtype)  # (..., T, K) one-hot over trained tokens
        update = hits @ correction
        return result + (update if rows is None else update * rows)
    # the tied output layer: recompute the logits of the trained tokens only
    logits = x @ delta.T
    if rows is None:
        return result.index_copy(-1, index, logits)
    # serving, without autograd: written into the base layer's fresh output, not into a copy of all 262k logits
    return result.index_copy_(-1, index, torch.where(rows, logits, result.index_select(-1, index)))


def _sparse_forward(self: TrainableTokensLayer, x: torch.Tensor, active_adapters: Any, *args: Any, **kwargs: Any):
    if self.disable_adapters or not active_adapters or self.merged:
        return TrainableTokensLayer.forward_adapters(self, x, active_adapters, *args, **kwargs)
    result = self.base_layer(x, *args, **kwargs)
    for name in active_adapters:
        result = trained_tokens(self, x, result, name)
    return result


def use_sparse_template_tokens(model: torch.nn.Module) -> int:
    """Switch every PEFT trainable-tokens layer of `model` to the sparse forward; returns how many."""
    layers = [m for m in model.modules() if isinstance(m, TrainableTokensLayer)]
    for layer in layers:
        layer.forward_adapters = types.MethodType(_sparse_forward, layer)  # type: ignore[method-assign]  # per layer
    return len(layers)
