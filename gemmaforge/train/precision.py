"""Pick the compute precision for a family on this device."""

from __future__ import annotations

from pathlib import Path

from gemmaforge.errors import UserError
from gemmaforge.families import Family


def cpu_has_bf16() -> bool:
    """AVX512-BF16 or AMX: without them bf16 matmuls on the CPU are emulated and slower than fp32."""
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return any(flag in flags for flag in ("avx512_bf16", "amx_bf16"))


def resolve_precision(requested: str, family: Family) -> str:
    import torch

    if requested == "fp16" and not family.fp16_safe:
        raise UserError(f"train.precision=fp16: {family.name} activations overflow in fp16 (NaN loss); use bf16 or fp32")
    if requested != "auto":
        return requested
    if torch.cuda.is_available():
        return "bf16" if torch.cuda.is_bf16_supported() else "fp32"
    return "bf16" if cpu_has_bf16() else "fp32"
