"""ROCm facts that torch cannot be trusted with: the real GPU arch, the HSA override, bf16 hardware.

`gcnArchName` shows the arch HSA_OVERRIDE_GFX_VERSION pretends to be; the kernel driver's topology
(/sys/class/kfd/kfd/topology/nodes/*/properties, gfx_target_version = major*10000 + minor*100 + stepping)
is what the silicon is, and no environment variable changes it.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

AMD_VENDOR_ID = 4098
KFD_NODES = Path("class/kfd/kfd/topology/nodes")
# archs with bf16 hardware: CDNA (MI100/200/300/350) and RDNA3/4; RDNA1/2 (gfx10xx) have none, although
# torch.cuda.is_bf16_supported() answers True for every ROCm device
BF16_ARCH_PREFIXES = ("gfx908", "gfx90a", "gfx94", "gfx95", "gfx11", "gfx12")
# what HSA_OVERRIDE_GFX_VERSION to use where the wheels ship no kernels for the real arch (rocm.md)
OVERRIDE_FOR = {"gfx1031": "10.3.0", "gfx1032": "10.3.0", "gfx1033": "10.3.0", "gfx1034": "10.3.0",
                "gfx1035": "10.3.0", "gfx1036": "10.3.0", "gfx1101": "11.0.0", "gfx1102": "11.0.0",
                "gfx1103": "11.0.0"}


@dataclass(frozen=True)
class KfdNode:
    node: int
    arch: str  # gfx1100
    vendor_id: int


def arch_from_target_version(version: int) -> str:
    """110000 -> gfx1100, 90010 -> gfx90a, 100300 -> gfx1030 (the stepping is one hex digit)."""
    major, minor, stepping = version // 10000, version // 100 % 100, version % 100
    return f"gfx{major}{minor}{stepping:x}"


def kfd_gpus(sysfs: Path = Path("/sys")) -> list[KfdNode]:
    """The GPU nodes the amdgpu driver exposes (CPU nodes have gfx_target_version 0); [] without the driver."""
    nodes = []
    root = sysfs / KFD_NODES
    for folder in sorted(root.glob("*"), key=lambda p: int(p.name) if p.name.isdigit() else -1):
        try:
            text = (folder / "properties").read_text()
        except OSError:
            continue
        props = dict(line.split(maxsplit=1) for line in text.splitlines() if len(line.split(maxsplit=1)) == 2)
        version, vendor = props.get("gfx_target_version", "0"), props.get("vendor_id", "0")
        if version.isdigit() and int(version) > 0 and folder.name.isdigit():
            nodes.append(KfdNode(int(folder.name), arch_from_target_version(int(version)),
                                 int(vendor) if vendor.isdigit() else 0))
    return nodes


def override_arch(value: str) -> str | None:
    """HSA_OVERRIDE_GFX_VERSION '11.0.0' -> gfx1100, '9.0.10' -> gfx90a; None when malformed."""
    match = re.fullmatch(r"\s*(\d+)\.(\d+)\.(\d+)\s*", value)
    if not match:
        return None
    major, minor, stepping = (int(g) for g in match.groups())
    return arch_from_target_version(major * 10000 + minor * 100 + stepping) if stepping < 16 and minor < 10 else None


def has_bf16(arch: str) -> bool:
    return arch.startswith(BF16_ARCH_PREFIXES)


def visible_order(count: int, env: Mapping[str, str] | None = None) -> list[int]:
    """Which of `count` AMD GPUs (in the driver's order) the ROCm runtime shows, in the order it numbers them:
    ROCR_VISIBLE_DEVICES selects first, then HIP_VISIBLE_DEVICES (else CUDA_VISIBLE_DEVICES, which HIP also
    honours) selects among those. An empty value hides every GPU, as it does for the runtime."""
    env = os.environ if env is None else env
    order = list(range(count))
    for names in (("ROCR_VISIBLE_DEVICES",), ("HIP_VISIBLE_DEVICES", "CUDA_VISIBLE_DEVICES")):
        value = next((env[name] for name in names if env.get(name) is not None), None)
        if value is not None:
            picks = [int(entry) for entry in value.split(",") if entry.strip().isdigit()]
            order = [order[i] for i in picks if i < len(order)]
    return order


def visible_amd_gpus(sysfs: Path = Path("/sys"), env: Mapping[str, str] | None = None) -> list[KfdNode]:
    """The AMD GPU nodes this process's ROCm runtime uses, as torch numbers them."""
    gpus = [n for n in kfd_gpus(sysfs) if n.vendor_id == AMD_VENDOR_ID]
    return [gpus[i] for i in visible_order(len(gpus), env)]


def real_arch(device_index: int = 0, sysfs: Path = Path("/sys")) -> str | None:
    """The real arch of the index-th visible AMD GPU, from the driver; None without the KFD topology."""
    gpus = visible_amd_gpus(sysfs)
    return gpus[device_index].arch if device_index < len(gpus) else None
