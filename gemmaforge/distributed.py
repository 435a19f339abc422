"""Multi-process runs (`torchrun`, `accelerate launch`): one process writes the run directory.

Every rank runs the same command. The main rank prepares data and writes run files; the others wait
at a barrier and only train. transformers' Trainer does the gradient synchronisation itself.
"""

from __future__ import annotations

import os


def world_size() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def is_main_process() -> bool:
    return int(os.environ.get("RANK", "0")) == 0


def init_if_launched() -> None:
    """Join the process group a launcher set up (gloo on the CPU, nccl on GPUs, which ROCm maps to RCCL)."""
    if world_size() == 1:
        return
    import torch
    import torch.distributed as dist

    if not dist.is_initialized():
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")


def barrier() -> None:
    if world_size() > 1:
        import torch.distributed as dist

        dist.barrier()


def gather(value: object) -> list[object]:
    """`value` from every rank (a one-element list when not distributed)."""
    if world_size() == 1:
        return [value]
    import torch.distributed as dist

    values: list[object] = [None] * world_size()
    dist.all_gather_object(values, value)
    return values
