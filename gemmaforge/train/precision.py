"""Pick the compute precision for a family on this device, and say why."""

from __future__ import annotations

import os
from pathlib import Path

from gemmaforge.errors import UserError
from gemmaforge.families import Family
from gemmaforge.system.rocm import has_bf16, real_arch

CPU_BF16_FLAGS = ("avx512_bf16", "amx_bf16")


def cpu_bf16_flags() -> list[str]:
    """AVX512-BF16 or AMX: without them bf16 matmuls on the CPU are emulated and slower than fp32."""
    try:
        flags = Path("/proc/cpuinfo").read_text().split()
    except OSError:
        return []
    return [flag for flag in CPU_BF16_FLAGS if flag in flags]


def bf16_decision() -> tuple[bool, str]:
    """Whether `precision: auto` trains in bf16 on this device, and the reason in words."""
    import torch

    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        if torch.version.hip:
            spoofed = getattr(props, "gcnArchName", "").split(":")[0]
            # an HSA override changes only gcnArchName: then the driver's arch says what the silicon is
            arch = (real_arch(0) if os.environ.get("HSA_OVERRIDE_GFX_VERSION") else None) or spoofed
            if has_bf16(arch):
                return True, f"{props.name} ({arch}) has bf16 hardware"
            return False, (f"{props.name} ({arch}) has no bf16 hardware (RDNA1/2); torch.cuda.is_bf16_supported() "
                           "says True on every ROCm device, so the arch decides: fp32")
        if props.major >= 8:
            return True, f"{props.name} (compute capability {props.major}.{props.minor}) has bf16 hardware"
        return False, f"{props.name} (compute capability {props.major}.{props.minor}) has no bf16 hardware: fp32"
    flags = cpu_bf16_flags()
    if flags:
        return True, f"this CPU has {' and '.join(flags)}: bf16 matmuls run in hardware"
    return False, "this CPU has neither avx512_bf16 nor amx_bf16: bf16 would be emulated, slower than fp32"


def resolve_precision(requested: str, family: Family) -> str:
    if requested == "fp16" and not family.fp16_safe:
        raise UserError(f"train.precision=fp16: {family.name} activations overflow in fp16 (NaN loss); "
                        "use bf16 or fp32")
    if requested != "auto":
        return requested
    return "bf16" if bf16_decision()[0] else "fp32"
