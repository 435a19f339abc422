"""Multi-process runs (`torchrun`, `accelerate launch`): one process writes the run directory.

Every rank runs the same command. The process that writes the run directory (`RunDir.writes`: rank 0, or each
node's first process when the nodes do not share the directory, which `RunDir.create` probes) prepares data and
writes run files; the others wait at a barrier and only train. transformers' Trainer does the gradient
synchronisation itself.
"""

from __future__ import annotations

import os
from typing import Any, TypeVar

T = TypeVar("T")

def world_size() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def rank() -> int:
    """This process's rank among all (0 when not launched)."""
    return int(os.environ.get("RANK", "0"))


def local_rank() -> int:
    """This process's rank on its node (0 when not launched): its GPU's index."""
    return int(os.environ.get("LOCAL_RANK", "0"))


def node_count() -> int:
    return world_size() // int(os.environ.get("LOCAL_WORLD_SIZE", str(world_size())))


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


def gather(value: T) -> list[T]:
    """`value` from every rank (a one-element list when not distributed)."""
    if world_size() == 1:
        return [value]
    import torch.distributed as dist

    values: list[Any] = [None] * world_size()
    dist.all_gather_object(values, value)
    return values
