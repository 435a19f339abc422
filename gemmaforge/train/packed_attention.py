"""Attention over packed rows: each example attends within itself, through the kernel chosen for its layer.

A packed row of cutoff_len tokens holds several examples (train/packing.py), each with position ids restarting
at 0. transformers would turn that into a block-diagonal mask (reading the positions back from the device to find
the examples) and compute the whole cutoff_len x cutoff_len score matrix, most of which the mask throws away.
Here the collator's segment lengths (train/segments.py) go to a kernel that computes only the examples' own
blocks (train/attention_kernels.py): per-example SDPA, FlashAttention's varlen kernel or flex_attention, chosen
per layer (train/kernel_choice.py). No mask is built and nothing is read back from the device.

Registered in transformers' AttentionInterface as `gemmaforge_packed`, and never as a mask function: the model
then builds no mask at all, which a packed batch does not need.
"""

from __future__ import annotations

from typing import Any, cast

import torch
from transformers import AttentionInterface

from gemmaforge.train.attention_kernels import attend
from gemmaforge.train.segments import PackedSegments

NAME = "gemmaforge_packed"
DEFAULT_KERNEL = "segments"


def packed_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                             attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                             sliding_window: int | None = None, softcap: float | None = None,
                             segments: PackedSegments | None = None, position_ids: torch.Tensor | None = None,
                             **kwargs: Any) -> tuple[torch.Tensor, None]:
    """query (B, Hq, T, D), key/value (B, Hkv, T, D) -> (B, T, Hq, D), like transformers' attention functions."""
    if segments is None:
        if position_ids is None or attention_mask is not None or query.shape[2] != key.shape[2]:
            raise RuntimeError(f"{NAME} attention is for packed training batches: it needs their segments (or "
                               "per-example position ids) and takes no attention mask or cache")
        segments = PackedSegments.from_position_ids(position_ids.expand(query.shape[0], -1))
    kernel = getattr(module, "packed_kernel", DEFAULT_KERNEL)
    return attend(kernel, module, query, key, value, segments, scaling, sliding_window, softcap, dropout), None


def register() -> str:
    """Make `gemmaforge_packed` known to transformers' attention functions."""
    AttentionInterface.register(NAME, packed_attention_forward)
    return NAME


def attention_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The language model's self-attention modules (towers keep their own attention)."""
    return [m for m in model.modules()
            if hasattr(m, "q_proj") and hasattr(m, "head_dim") and hasattr(m, "layer_idx")
            and "vision" not in type(m).__name__.lower() and "audio" not in type(m).__name__.lower()]


def head_size(module: torch.nn.Module) -> int:
    """An attention module's head size (an int attribute, which torch's Module typing cannot see)."""
    return cast(int, module.head_dim)


def use_kernels(model: torch.nn.Module, kernels: dict[int, str]) -> None:
    """Send each attention layer through the kernel chosen for its head size."""
    for module in attention_modules(model):
        module.packed_kernel = kernels.get(head_size(module), DEFAULT_KERNEL)  # type: ignore[assignment]  # a str attribute
