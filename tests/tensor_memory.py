"""The peak bytes of live tensor storage in a block of code: on the CPU, what a GPU's max_memory_allocated
measures (no allocator caches, no heap fragmentation), so the memory planner's counted terms can be held
against a measured peak without a GPU."""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


class PeakTensorMemory(TorchDispatchMode):
    """Every storage an operator returns inside the block (and the `existing` tensors given) is counted from
    its creation until its last reference dies; `peak` is the largest sum reached."""

    def __init__(self, *existing: torch.Tensor):
        super().__init__()
        self._bytes: dict[int, int] = {}  # storage id -> its size
        self._refs: dict[int, weakref.ref] = {}  # the callbacks that uncount a storage when it dies
        self.current = self.peak = 0
        for tensor in existing:
            self._count(tensor)

    def _count(self, tensor: torch.Tensor) -> None:
        storage = tensor.untyped_storage()
        key = storage._cdata  # one per storage, shared by its views
        if key in self._bytes:
            return
        self._bytes[key] = storage.nbytes()
        self.current += storage.nbytes()
        self.peak = max(self.peak, self.current)
        self._refs[key] = weakref.ref(storage, lambda _, key=key: self._uncount(key))

    def _uncount(self, key: int) -> None:
        self.current -= self._bytes.pop(key)
        del self._refs[key]

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for leaf in tree_leaves(out):
            if isinstance(leaf, torch.Tensor):
                self._count(leaf)
        return out


BF16_MATMULS = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default,
                torch.ops.aten.baddbmm.default}


class Fp32Matmuls(TorchDispatchMode):
    """bf16 matrix products computed in fp32 and rounded back to bf16: the same output shapes and dtypes, so the
    same live memory, at fp32 speed on CPUs without avx512_bf16/AMX, where bf16 matmuls are emulated (a
    1024x512 @ 512x2048 product: 7.5 s in bf16, 0.06 s in fp32 on the 2-core CI machine). Enter it outside a
    PeakTensorMemory: the fp32 copies are made below the tracker and never counted."""

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func in BF16_MATMULS and any(isinstance(a, torch.Tensor) and a.dtype == torch.bfloat16 for a in args):
            widened = [a.float() if isinstance(a, torch.Tensor) else a for a in args]
            return func(*widened, **kwargs).to(torch.bfloat16)
        return func(*args, **kwargs)


def saved_bytes(model, batch: dict) -> int:
    """What autograd keeps in one training forward (distinct storages, parameters not counted)."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}
    held: list = []

    def keep(tensor):
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in params:
            seen.setdefault(storage.data_ptr(), storage.nbytes())
        held.append(tensor)
        return len(held) - 1

    with torch.autograd.graph.saved_tensors_hooks(keep, held.__getitem__):
        model(**batch)
    held.clear()
    return sum(seen.values())
