"""The device monitor of a training run: GPU tools polled in the background, torch's counters at each log.

A thread runs `amd-smi` / `rocm-smi` / `nvidia-smi` (as programs: system/gpu_tools.py) every few seconds and
keeps the latest reading of the GPU this process trains on; `fields()` adds torch's own counters and returns
what goes into metrics.jsonl and the progress line. A tool that fails or prints something unreadable never
stops training: its fields become None and each distinct reason is logged once.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from typing import Any

from gemmaforge.console import console, escape
from gemmaforge.distributed import local_rank
from gemmaforge.system.gpu_tools import TOOLS, GpuQuery, GpuReading, query_gpus
from gemmaforge.system.memory import resident_bytes
from gemmaforge.system.rocm import visible_order

GPU_FIELDS = ("utilization_pct", "memory_used_bytes", "memory_total_bytes", "temperature_c", "power_w")
INTERVAL_S = 5.0
MAX_GPUS = 64  # visible_order needs a count; indices past the real one simply never match a reading
MONITOR_KEYS = ("gpu_name", *(f"gpu_{name}" for name in GPU_FIELDS), "torch_allocated_bytes", "torch_reserved_bytes",
                "rss_bytes")


def visible_index(local_rank: int) -> int | None:
    """The index the tools give the GPU this process uses: the rank's entry of *_VISIBLE_DEVICES when set (ROCm
    applies ROCR_VISIBLE_DEVICES, then HIP_/CUDA_VISIBLE_DEVICES); None when they name GPUs by UUID."""
    names = ("ROCR_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES", "CUDA_VISIBLE_DEVICES")
    if any(not entry.strip().isdigit() for name in names for entry in os.environ.get(name, "").split(",") if entry):
        return None
    order = visible_order(MAX_GPUS)
    return order[local_rank] if local_rank < len(order) else local_rank


def tools_for_this_torch() -> tuple[str, ...]:
    """The tools that describe the GPUs this torch build trains on: an AMD APU's GPU beside an NVIDIA card (or
    the reverse) must not stand in for it. A CPU build reads whichever tool answers."""
    import torch

    return ("amd-smi", "rocm-smi") if torch.version.hip else ("nvidia-smi",) if torch.version.cuda else TOOLS


class DeviceMonitor:
    def __init__(self, interval_s: float = INTERVAL_S, query: Callable[[], GpuQuery] | None = None,
                 index: int | None = None):
        self.interval_s = interval_s
        self.query = query or (lambda: query_gpus(tools_for_this_torch()))
        self.index = visible_index(local_rank()) if index is None else index
        self.reading: GpuReading | None = None
        self.reported: set[str] = set()
        self.problems: list[str] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def poll(self) -> None:
        """One reading (the thread calls this; tests call it directly)."""
        try:
            result = self.query()
        except Exception as exc:  # noqa: BLE001 - a monitor must never take training down
            result = GpuQuery([], [f"GPU monitor: {type(exc).__name__}: {exc}"])
        mine = [g for g in result.gpus if g.index == self.index]
        self.reading = mine[0] if mine else None
        if result.gpus and not mine:  # another GPU's numbers would be logged as this run's
            wanted = "named by UUID in *_VISIBLE_DEVICES" if self.index is None else f"index {self.index}"
            listed = ", ".join(str(g.index) for g in result.gpus)
            result.problems.append(f"GPU monitor: the tools report GPU(s) {listed}, not this process's GPU ({wanted})")
        for line in result.problems:
            if line not in self.reported:
                self.reported.add(line)
                self.problems.append(line)
                console.print(f"[yellow]monitor[/]: {escape(line)} (shown as unknown)")

    def start(self) -> DeviceMonitor:
        self.poll()  # the first reading before the first step, and no thread at all without any GPU tool
        if self.reading is not None:
            self._thread = threading.Thread(target=self._run, name="gemmaforge-monitor", daemon=True)
            self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.poll()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self.interval_s + 10)

    def fields(self) -> dict[str, Any]:
        """The latest GPU reading (None where unknown) and torch's memory counters, for one metrics row."""
        row: dict[str, Any] = torch_memory()
        if self.reading is not None:
            row["gpu_name"] = self.reading.name
            row.update({f"gpu_{name}": getattr(self.reading, name) for name in GPU_FIELDS})
        return row


def torch_memory() -> dict[str, int]:
    """torch's allocator counters on a GPU; the process's resident memory on the CPU."""
    import torch

    if torch.cuda.is_available():
        return {"torch_allocated_bytes": int(torch.cuda.memory_allocated()),
                "torch_reserved_bytes": int(torch.cuda.memory_reserved())}
    return {"rss_bytes": resident_bytes()}


def status_line(row: dict[str, Any]) -> str:
    """'gpu Radeon RX 7900 XTX 97% 18.20/23.98 GiB 61°C 302 W', '?' for unknown fields; '' without a GPU."""
    if "gpu_utilization_pct" not in row:
        rss = row.get("rss_bytes")
        return f"rss {rss / 2**30:.2f} GiB" if rss else ""

    def shown(key: str, fmt: str) -> str:
        value = row.get(key)
        return "?" if value is None else fmt.format(value)

    used, total = row.get("gpu_memory_used_bytes"), row.get("gpu_memory_total_bytes")
    memory = "/".join("?" if v is None else f"{v / 2**30:.2f}" for v in (used, total)) + " GiB"
    return " ".join((f"gpu {row.get('gpu_name') or '?'}", shown("gpu_utilization_pct", "{:.0f}%"), memory,
                     shown("gpu_temperature_c", "{:.0f}°C"), shown("gpu_power_w", "{:.0f} W")))
