"""Gemma's gated MLP, gelu(gate) * up, keeping two tensors for backward instead of three.

Autograd keeps `gate` for the GELU's backward and both factors, gelu(gate) and `up`, for the product's:
three tensors of the MLP's width (2048 in Gemma 3 270M, 8x the hidden size) per token and layer.
gelu(gate) is cheap to recompute from `gate`, so `GatedGelu` keeps only `gate` and `up` and recomputes
it in backward: 302 MiB less for the benchmark's 4 packed rows of 512, for one extra GELU per layer.
Values and gradients are those of the original module (tested).
"""

from __future__ import annotations

import functools
import types
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from transformers.activations import GELUTanh


class GatedGelu(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(gate, up)
        return F.gelu(gate, approximate="tanh").mul_(up)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        gate, up = ctx.saved_tensors
        grad_up = grad * F.gelu(gate, approximate="tanh")
        grad_gate = torch.ops.aten.gelu_backward(grad * up, gate, approximate="tanh")
        return grad_gate, grad_up


class _GatedMLP(Protocol):  # Gemma's MLP: down(gelu_tanh(gate(x)) * up(x))
    def gate_proj(self, x: torch.Tensor) -> torch.Tensor: ...

    def up_proj(self, x: torch.Tensor) -> torch.Tensor: ...

    def down_proj(self, x: torch.Tensor) -> torch.Tensor: ...


def _forward(self: _GatedMLP, x: torch.Tensor) -> torch.Tensor:
    return self.down_proj(GatedGelu.apply(self.gate_proj(x), self.up_proj(x)))


def _is_tanh_gelu(act: Any) -> bool:
    inner = getattr(act, "act", None)  # transformers' GELUTanh holds partial(F.gelu, approximate="tanh")
    return (isinstance(act, GELUTanh) and isinstance(inner, functools.partial) and inner.func is F.gelu
            and inner.keywords == {"approximate": "tanh"})


def use_recomputed_gelu(model: torch.nn.Module) -> int:
    """Switch every gated tanh-GELU MLP of `model` to GatedGelu; returns how many."""
    mlps = [m for m in model.modules()
            if all(hasattr(m, name) for name in ("gate_proj", "up_proj", "down_proj"))
            and _is_tanh_gelu(getattr(m, "act_fn", None))]
    for mlp in mlps:
        mlp.forward = types.MethodType(_forward, mlp)
    return len(mlps)
