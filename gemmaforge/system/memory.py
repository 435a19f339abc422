"""This machine's memory: what the process holds, what is free, what is installed."""

from __future__ import annotations

import os
import resource
from pathlib import Path


def resident_bytes() -> int:
    """This process's resident memory now."""
    try:
        pages = int(Path("/proc/self/statm").read_text().split()[1])
    except (OSError, IndexError, ValueError):
        return 0
    return pages * os.sysconf("SC_PAGE_SIZE")


def return_freed_memory() -> None:
    """Hand the heap's free pages back to the system (glibc's malloc_trim). After many tensors of a few MB are
    freed, glibc keeps their pages for reuse (its mmap threshold rises to the largest block freed), so a loop
    that allocates one weight at a time grows by the model's size without ever holding it; a no-op elsewhere."""
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    try:
        ctypes.CDLL(name).malloc_trim(0)
    except (OSError, AttributeError, TypeError):  # not glibc (musl, macOS, Windows)
        pass


def available_ram() -> int:
    """MemAvailable from /proc/meminfo (what can be used without swapping), else total memory."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        pass
    return total_ram()


def total_ram() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def reset_peak_memory() -> None:
    """Start the peak that peak_memory_bytes reads from now. On the CPU the kernel's high-water mark of this
    process's resident memory (VmHWM) is reset through /proc/self/clear_refs (Linux 4.0+): without it a training
    peak would also count what the data stage held before, which the memory plan (measured from this point) does
    not plan for."""
    import torch

    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
        return
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:  # not Linux, or a kernel that refuses: the peak then counts from the process's start
        pass


def peak_memory_bytes() -> int:
    """Peak accelerator memory allocated by torch, or the process's peak resident memory on the CPU (since the
    last reset_peak_memory)."""
    import torch

    if torch.cuda.is_available():
        return int(torch.cuda.max_memory_allocated())
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB
