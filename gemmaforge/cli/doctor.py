"""`gemmaforge doctor`: can this machine train, export and serve (the checks are gemmaforge/doctor.py's)."""

from __future__ import annotations

import argparse
from pathlib import Path

from gemmaforge.cli.common import Verbs


def add(verbs: Verbs) -> None:
    p = verbs.add_parser(
        "doctor", help="Check this machine: torch build, GPUs, ROCm access and arch, bf16, attention kernels, tools.",
        description="Check whether this machine can train, export and serve: OS and Python, the torch build, "
        "every GPU (torch, the driver's real arch, rocm-smi/amd-smi/nvidia-smi readings), /dev/kfd access and "
        "groups, the arch in torch's kernels, HSA_OVERRIDE_GFX_VERSION, the bf16 decision, a fused-attention probe, "
        "flash-attn, bitsandbytes, conflicting packages, free disk, the HF token, llama.cpp and ollama. Each "
        "check says PASS, WARN, FAIL or SKIP with a one-line fix; exit 1 when one fails.",
    )
    p.add_argument("--json", action="store_true",
                   help='the report as JSON (schema "gemmaforge-doctor/1", see docs/gpu-setup.md)')
    p.set_defaults(handler=doctor)


def doctor(args: argparse.Namespace, home: Path) -> int:
    from gemmaforge.doctor import doctor as check_machine

    return check_machine(args.json)
