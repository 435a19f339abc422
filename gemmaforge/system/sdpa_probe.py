"""Does a fused scaled-dot-product-attention kernel run here, at the model's head size?

On ROCm the fused kernels come from AOTriton, and on archs it marks experimental SDPA silently falls back to
the math kernel, which is slower and keeps the attention probabilities for backward. One tiny forward and
backward per fused backend, each allowed alone, tells which one works.
"""

from __future__ import annotations

from typing import Any

BACKENDS = ("FLASH_ATTENTION", "EFFICIENT_ATTENTION")


def fused_attention_backend(head_dim: int, dtype: Any, device: str) -> tuple[str | None, str]:
    """(the first fused backend that runs a causal forward and backward, or None; the reason when None)."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    reasons = []
    for name in BACKENDS:
        try:
            query = torch.randn(1, 2, 64, head_dim, device=device, dtype=dtype, requires_grad=True)
            with sdpa_kernel([getattr(SDPBackend, name)]):
                F.scaled_dot_product_attention(query, query, query, is_causal=True).sum().backward()
            return name.lower(), ""
        except RuntimeError as exc:  # "No available kernel", or an unsupported head size or dtype
            reasons.append(f"{name.lower()}: {str(exc).strip().splitlines()[0][:160]}")
    return None, "; ".join(reasons)


def attention_finding(head_dim: int, dtype: Any) -> str | None:
    """A slow-step finding when this GPU has no fused kernel at `head_dim`; None when one runs (or no GPU)."""
    import torch

    if not torch.cuda.is_available():
        return None
    backend, reason = fused_attention_backend(head_dim, dtype, "cuda")
    if backend:
        return None
    fix = ("TORCH_ROCM_AOTRITON_ENABLE_EXPERIMENTAL=1 enables AOTriton's kernels for archs it marks experimental"
           if torch.version.hip else "a newer torch build may have a kernel for this GPU")
    return f"attention runs on SDPA's slow math kernel at head_dim {head_dim} ({reason}): {fix}"
