"""Which attention kernel each layer of a packed run goes through: `train.attention`, or measured on the device.

`auto` on a CPU is per-example SDPA (`segments`), the fastest there (benchmarks/train_ablation.py). On a GPU,
`auto` times one forward and backward of every kernel this environment has (train/attention_kernels.py) on the
run's own shape (its heads, head size, window, soft-cap, and the first batch's example lengths) and keeps the
fastest: which kernel wins depends on the GPU, the library builds and the lengths, so it is measured, not assumed.
A measurement is kept in GEMMAFORGE_HOME/attention_kernels.json under the device, the library versions and the
shape, so the next run of the same shape takes it without measuring again. Layers whose head size a kernel cannot
take (Gemma 4's global layers, head size 512, beyond FlashAttention 2) get the best kernel that can.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from gemmaforge.errors import UserError
from gemmaforge.runs import atomic_write_text
from gemmaforge.train.attention_kernels import KERNELS, attend, supports, unavailable
from gemmaforge.train.packed_attention import attention_modules, head_size
from gemmaforge.train.segments import PackedSegments

CACHE_NAME = "attention_kernels.json"
WARMUP, REPEATS = 2, 5


@dataclass(frozen=True)
class LayerShape:
    """What an attention kernel's speed depends on, for the layers of one head size."""

    head_dim: int
    heads: int
    kv_heads: int
    window: int | None
    softcap: float | None
    scaling: float | None

    @classmethod
    def of(cls, module: Any) -> LayerShape:
        groups = getattr(module, "num_key_value_groups", 1)
        heads = module.config.num_attention_heads
        return cls(head_size(module), heads, heads // groups, getattr(module, "sliding_window", None),
                   getattr(module, "attn_logit_softcapping", None), getattr(module, "scaling", None))


@dataclass
class KernelChoice:
    kernels: dict[int, str]  # head size -> kernel
    notes: list[str] = field(default_factory=list)  # why, one line each
    timings_ms: dict[int, dict[str, float]] = field(default_factory=dict)  # measured forward + backward, per kernel


Measure = Callable[[str, LayerShape, PackedSegments, torch.device, torch.dtype], float]


def choose_kernels(requested: str, model: torch.nn.Module, device: torch.device, dtype: torch.dtype,
                   sample: PackedSegments, cache_dir: Path, measure: Measure | None = None) -> KernelChoice:
    """The kernel for each head size of `model`'s attention layers (see the module docstring)."""
    shapes: dict[int, LayerShape] = {}
    for module in attention_modules(model):
        shapes.setdefault(head_size(module), LayerShape.of(module))
    if requested != "auto":
        reason = unavailable(requested, device)
        if reason:
            raise UserError(f"train.attention={requested}: {reason}")
    choice = KernelChoice({})
    for head_dim, shape in sorted(shapes.items()):
        wanted = KERNELS if requested == "auto" else (requested,)
        fitting = [k for k in wanted if not unavailable(k, device) and not supports(k, head_dim, dtype)]
        if requested != "auto" and not fitting:
            choice.notes.append(f"head size {head_dim}: {supports(requested, head_dim, dtype)}; those layers use "
                                "segments")
            fitting = ["segments"]
        if len(fitting) == 1:
            choice.kernels[head_dim] = fitting[0]
            why = "as asked" if requested != "auto" else f"the only kernel available on the {device.type}"
            if requested == "auto" and device.type == "cpu":
                why = "the CPU's fastest"
            choice.notes.append(f"head size {head_dim}: {fitting[0]} ({why})")
            continue
        timings = measured(fitting, shape, sample, device, dtype, cache_dir, measure or time_kernel)
        if not timings:
            raise RuntimeError(f"no attention kernel ran on the {device} at head size {head_dim}")
        best = min(timings, key=timings.__getitem__)
        choice.kernels[head_dim] = best
        choice.timings_ms[head_dim] = timings
        shown = ", ".join(f"{k} {ms:.3g} ms" for k, ms in sorted(timings.items(), key=lambda item: item[1]))
        choice.notes.append(f"head size {head_dim}: {best}, the fastest measured on this device ({shown})")
    return choice


def measured(kernels: list[str], shape: LayerShape, sample: PackedSegments, device: torch.device,
             dtype: torch.dtype, cache_dir: Path, measure: Measure) -> dict[str, float]:
    """ms per forward + backward of each kernel that runs, from the cache when this device measured this shape."""
    path = cache_dir / CACHE_NAME
    key = cache_key(kernels, shape, sample, device, dtype)
    try:
        cache = json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}
    except (OSError, ValueError):  # a damaged cache only costs a measurement
        cache = {}
    if key in cache:
        return cache[key]
    timings = {}
    for kernel in kernels:
        try:
            timings[kernel] = round(measure(kernel, shape, sample, device, dtype) * 1000, 4)
        except Exception:  # noqa: BLE001 - a kernel that fails on this shape (a compiler limit) is not chosen
            continue
    cache[key] = timings
    cache_dir.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, json.dumps(cache, indent=1, sort_keys=True))
    return timings


def cache_key(kernels: list[str], shape: LayerShape, sample: PackedSegments, device: torch.device,
              dtype: torch.dtype) -> str:
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    versions = [f"torch {torch.__version__}"]
    if "flash" in kernels:
        import flash_attn

        versions.append(f"flash_attn {flash_attn.__version__}")
    lengths = "+".join(str(n) for n in sorted(sample.lengths, reverse=True))
    return (f"{name} | {', '.join(versions)} | {str(dtype).removeprefix('torch.')} | {'/'.join(kernels)} | "
            f"head {shape.head_dim} x {shape.heads}/{shape.kv_heads} window {shape.window} softcap {shape.softcap} | "
            f"{len(sample.rows)} x {sample.width}: {lengths}")


class _Layer(torch.nn.Module):
    """What the kernels read from an attention module."""

    def __init__(self, shape: LayerShape):
        super().__init__()
        self.num_key_value_groups = shape.heads // shape.kv_heads
        self.is_causal = True


def time_kernel(kernel: str, shape: LayerShape, sample: PackedSegments, device: torch.device,
                dtype: torch.dtype) -> float:
    """Seconds per forward and backward of one layer's attention on random inputs of the sample's shape."""
    rows, tokens = len(sample.rows), sample.width
    query = torch.randn(rows, shape.heads, tokens, shape.head_dim, device=device, dtype=dtype, requires_grad=True)
    key, value = (torch.randn(rows, shape.kv_heads, tokens, shape.head_dim, device=device, dtype=dtype,
                              requires_grad=True) for _ in range(2))
    layer = _Layer(shape)

    def step() -> None:
        out = attend(kernel, layer, query, key, value, sample, shape.scaling, shape.window, shape.softcap, 0.0)
        out.backward(torch.ones_like(out))

    for _ in range(WARMUP):  # the first calls compile (flex) and fill the allocator
        step()
    _synchronize(device)
    start = time.perf_counter()
    for _ in range(REPEATS):
        step()
    _synchronize(device)
    return (time.perf_counter() - start) / REPEATS


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
