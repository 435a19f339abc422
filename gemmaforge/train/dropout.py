"""LoRA dropout that keeps a one-byte mask.

PEFT puts an `nn.Dropout` before every LoRA layer. On the CPU, torch draws that mask with bernoulli_
into a tensor of the input's dtype and keeps it for backward: 4 bytes per element in fp32, for each of
q, k, v and o in every layer, as much as all attention activations at Gemma's sizes. Here the mask is drawn as
`rand >= p` and kept as bool: the same distribution in a quarter of the memory (measured in benchmarks/README.md,
the byte_mask_dropout row).
"""

from __future__ import annotations

from typing import Any

import torch


class _KeepAndScale(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, keep: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.save_for_backward(keep)
        ctx.scale = scale
        return x.mul(keep).mul_(scale)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        (keep,) = ctx.saved_tensors
        return grad.mul(keep).mul_(ctx.scale), None, None


class ByteMaskDropout(torch.nn.Module):
    """Inverted dropout like nn.Dropout, with its mask saved as bool."""

    def __init__(self, p: float):
        super().__init__()
        self.p = p

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.p == 0:
            return x
        keep = torch.rand_like(x) >= self.p
        return _KeepAndScale.apply(x, keep, 1.0 / (1.0 - self.p))

    def extra_repr(self) -> str:
        return f"p={self.p}"


def use_byte_mask_dropout(model: torch.nn.Module) -> int:
    """Replace the nn.Dropout of every PEFT LoRA layer in `model`; returns how many were replaced."""
    replaced = 0
    for module in model.modules():
        dropouts = getattr(module, "lora_dropout", None)
        if not isinstance(dropouts, torch.nn.ModuleDict):
            continue
        for name, layer in dropouts.items():
            if type(layer) is torch.nn.Dropout:
                dropouts[name] = ByteMaskDropout(layer.p)
                replaced += 1
    return replaced
