"""Pick the compute precision for a family on this device."""

from __future__ import annotations

from pathlib import Path

from gemmaforge.errors import UserError
from gemmaforge.families import Family

# ROCm archs with bf16 hardware: CDNA (MI100/200/300) and RDNA3/4. RDNA1/2 (gfx10xx) have none,
# although torch.cuda.is_bf16_supported() answers True for every ROCm device.
_ROCM_BF16_PREFIXES = ("gfx908", "gfx90a", "gfx94", "gfx95", "gfx11", "gfx12")


def cpu_has_bf16() -> bool:
    """AVX512-BF16 or AMX: without them bf16 matmuls on the CPU are emulated and slower than fp32."""
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return any(flag in flags for flag in ("avx512_bf16", "amx_bf16"))


def gpu_has_bf16() -> bool:
    import torch

    props = torch.cuda.get_device_properties(0)
    if torch.version.hip:
        arch = getattr(props, "gcnArchName", "").split(":")[0]
        return arch.startswith(_ROCM_BF16_PREFIXES)
    return props.major >= 8  # Ampere and newer


def resolve_precision(requested: str, family: Family) -> str:
    import torch

    if requested == "fp16" and not family.fp16_safe:
        raise UserError(f"train.precision=fp16: {family.name} activations overflow in fp16 (NaN loss); use bf16 or fp32")
    if requested != "auto":
        return requested
    if torch.cuda.is_available():
        return "bf16" if gpu_has_bf16() else "fp32"
    return "bf16" if cpu_has_bf16() else "fp32"
