"""Where each example starts and ends in a packed batch, known on the host before the batch reaches the device.

The collator knows every example's length when it packs a row, so it hands the lengths along with the batch.
Attention kernels read them from here: the per-example SDPA loop splits by Python ints, FlashAttention takes
`cu_seqlens` and `max_seqlen`, flex_attention a block mask built once per batch and window. None of them asks
the device where a segment ends (`.tolist()` or `.item()` on a device tensor stops the host until every queued
kernel has run, once per layer).
"""

from __future__ import annotations

from typing import Any

import torch


class PackedSegments:
    """The segments of a batch of B packed rows of `width` tokens: each row's examples in order, then its padding
    tail as a segment of its own (the collator gives padding positions 0, 1, ... so nothing attends to it)."""

    def __init__(self, rows: list[list[int]], width: int):
        if any(sum(row) != width or min(row, default=0) < 1 for row in rows):
            raise ValueError(f"each row's segment lengths must be positive and sum to {width}: {rows}")
        self.rows = rows
        self.width = width
        self.lengths = [n for row in rows for n in row]  # over the flattened batch, row after row
        self.max_length = max(self.lengths)
        self._cached: dict[Any, Any] = {}  # device tensors and block masks, built once per batch

    @classmethod
    def of_rows(cls, lengths: list[list[int]], width: int) -> PackedSegments:
        """From each row's example lengths; what a row leaves free of `width` becomes its padding segment."""
        return cls([row + ([width - sum(row)] if sum(row) < width else []) for row in lengths], width)

    @classmethod
    def from_position_ids(cls, position_ids: torch.Tensor) -> PackedSegments:
        """For callers that bring positions only (the memory planner's probe, tests): one read of the positions,
        once per forward rather than once per layer."""
        rows = []
        for positions in position_ids.tolist():
            starts = [i for i, p in enumerate(positions) if p == 0]
            if not starts or starts[0] != 0:
                starts = [0, *starts]
            rows.append([end - start for start, end in zip(starts, [*starts[1:], len(positions)])])
        return cls(rows, position_ids.shape[1])

    def cu_seqlens(self, device: torch.device) -> torch.Tensor:
        """(segments + 1,) int32 offsets of each segment in the flattened batch, as FlashAttention takes them."""
        return self._on(device, "cu_seqlens",
                        lambda: torch.tensor([0, *self.lengths], dtype=torch.int32).cumsum(0, dtype=torch.int32))

    def document_ids(self, device: torch.device) -> torch.Tensor:
        """(B, width) int32: the index of the segment each position belongs to, within its row."""
        return self._on(device, "document_ids", lambda: torch.stack([
            torch.repeat_interleave(torch.arange(len(row), dtype=torch.int32), torch.tensor(row)) for row in self.rows
        ]))

    def cached(self, key: Any, build: Any) -> Any:
        """`build()` once per batch under `key` (a kernel's per-batch state, such as a block mask)."""
        if key not in self._cached:
            self._cached[key] = build()
        return self._cached[key]

    def _on(self, device: torch.device, name: str, build: Any) -> torch.Tensor:
        def move() -> torch.Tensor:
            tensor = build()
            if device.type == "cpu":
                return tensor
            # pinned, then an asynchronous copy: queued behind the step's kernels instead of waiting for them
            return tensor.pin_memory().to(device, non_blocking=True)
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:  # "cuda" and "cuda:0" are one cache entry
            device = torch.device("cuda", torch.cuda.current_device())
        return self.cached((name, device), move)

    def to(self, device: Any, non_blocking: bool = False) -> PackedSegments:
        """What a data loader calls on each batch entry: the offsets go to the device with the batch."""
        if torch.device(device).type != "cpu":
            self.cu_seqlens(torch.device(device))
        return self

    def __repr__(self) -> str:
        return f"PackedSegments({len(self.rows)} rows x {self.width}, {len(self.lengths)} segments)"
