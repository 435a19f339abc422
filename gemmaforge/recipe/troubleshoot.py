"""What the training stage says when it hits the walkthroughs' three walls: out of memory, slow steps, NaN.

Each message names the likely cause for this run (its config, family, device and arch) and the fix, most
likely first, instead of a stack trace and a forum search.
"""

from __future__ import annotations

import os
import time
from typing import Any

from transformers import TrainerCallback

from gemmaforge.config import RunConfig
from gemmaforge.families import Family
from gemmaforge.train.loss import NonFiniteLoss
from gemmaforge.train.memory_plan import Plan
from gemmaforge.units import gib

DATA_WAIT_LIMIT = 0.10  # of each step spent waiting for the next batch
PADDING_LIMIT = 0.25  # of the positions in a batch
OUT_OF_MEMORY_SIGNS = ("can't allocate memory", "out of memory", "ALLOC_FAILED", "hipErrorOutOfMemory")


def is_out_of_memory(exc: BaseException) -> bool:
    import torch

    if isinstance(exc, (torch.OutOfMemoryError, MemoryError)):
        return True
    # the CPU allocator's message, and HIP/CUDA errors raised as plain RuntimeErrors by kernels and libraries
    text = str(exc)
    return isinstance(exc, RuntimeError) and any(sign in text for sign in OUT_OF_MEMORY_SIGNS)


def diagnose_out_of_memory(exc: BaseException, plan: Plan | None, config: RunConfig) -> str:
    """The planner's view of the failed config and a smaller one, with some margin: the plan was too tight.
    Without a plan (train.check_memory=false and the planner failed) the smaller batch is three quarters."""
    import torch

    t = config.train
    hints = []
    largest = plan.largest_batch if plan else t.per_device_train_batch_size
    smaller = max(1, min(largest, t.per_device_train_batch_size) * 3 // 4)
    if smaller < t.per_device_train_batch_size:
        steps = t.gradient_accumulation_steps * -(-t.per_device_train_batch_size // smaller)
        hints.append(f"train.per_device_train_batch_size={smaller} train.gradient_accumulation_steps={steps} "
                     "(the same effective batch)")
    if not t.gradient_checkpointing:
        hints.append("train.gradient_checkpointing=true")
    if t.cutoff_len > 64:
        hints.append(f"train.cutoff_len={max(64, t.cutoff_len // 2)} if your examples allow it")
    on_gpu = plan.device.kind == "gpu" if plan else torch.cuda.is_available()
    if on_gpu:
        variable = "PYTORCH_HIP_ALLOC_CONF" if _hip() else "PYTORCH_CUDA_ALLOC_CONF"
        hints.append(f"{variable}=expandable_segments:True (less fragmentation); close other programs using the GPU "
                     "(see `rocm-smi` / `nvidia-smi`)")
        if not config.model.load_in_4bit:
            hints.append("model.load_in_4bit=true (QLoRA)")
    if not hints:
        hints.append("more memory or a smaller model: batch 1, cutoff_len 64 and gradient checkpointing are the floor")
    first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    if plan is None:
        return f"out of memory ({first_line}). Try: " + "; ".join(hints)
    return (f"out of memory on {plan.device.name} ({first_line}). The plan for batch {plan.batch_size} x cutoff_len "
            f"{plan.cutoff_len} was {gib(plan.peak_bytes)} of {gib(plan.device.capacity_bytes)}; something else held "
            f"memory or the plan was too tight. `gemmaforge plan CONFIG` shows the parts. Try: " + "; ".join(hints))


def diagnose_non_finite(exc: NonFiniteLoss, config: RunConfig, precision: str, family: Family) -> str:
    """What to change after a NaN/inf loss, most likely cause first, for this family and device."""
    t = config.train
    hints = []
    arch = _rocm_arch()
    if precision == "fp16":
        hints.append(f"fp16 overflows in {family.name}'s activations: set train.precision=bf16 (fp32 where the "
                     "hardware has no bf16)")
    if precision == "bf16" and arch and arch.startswith("gfx10"):
        hints.append(f"{arch} (RDNA1/2) has no bf16 hardware: set train.precision=fp32")
    if arch and os.environ.get("HSA_OVERRIDE_GFX_VERSION"):
        hints.append(f"HSA_OVERRIDE_GFX_VERSION={os.environ['HSA_OVERRIDE_GFX_VERSION']} "
                     "runs kernels built for another "
                     "arch, which can compute garbage: run `gemmaforge doctor`")
    if t.learning_rate > 5e-4:
        hints.append(f"train.learning_rate={t.learning_rate} is high for LoRA: try {t.learning_rate / 10:g}")
    if t.warmup_steps == 0 and t.warmup_ratio == 0:
        hints.append("add warmup: train.warmup_ratio=0.03")
    if precision == "bf16":
        hints.append("if it persists, train.precision=fp32 rules precision out")
    hints.append("check the data around this step: `gemmaforge data inspect RUN_DIR/data/train.jsonl`")
    return (
        f"training stopped: the loss became {exc.loss} at step {exc.step} (precision {precision}); "
        "nothing was trained on it. Likely fixes: " + "; ".join(hints)
    )


def _hip() -> bool:
    import torch

    return bool(torch.version.hip)


def _rocm_arch() -> str | None:
    import torch

    if not (torch.cuda.is_available() and torch.version.hip):
        return None
    return torch.cuda.get_device_properties(0).gcnArchName.split(":")[0]


class StepClock(TrainerCallback):
    """Time spent waiting for batches (between one step's end and the next step's start: data loading and
    collation) against time computing, and the padding share of the batches the trainer counts."""

    def __init__(self) -> None:
        self.waiting = self.computing = 0.0
        self._mark: float | None = None
        self._began: float | None = None

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        now = time.perf_counter()
        if self._mark is not None:
            self.waiting += now - self._mark
        self._began = now

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        now = time.perf_counter()
        if self._began is not None:
            self.computing += now - self._began
        self._mark = now

    def on_log(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._mark = None  # logging and evaluation are not waiting for data

    on_evaluate = on_save = on_log

    @property
    def data_wait_share(self) -> float:
        total = self.waiting + self.computing
        return self.waiting / total if total else 0.0


def slow_step_findings(clock: StepClock, padding_share: float, config: RunConfig, sdpa: str | None,
                       unpackable: str) -> list[str]:
    """Why steps were slower than they need to be, from what this run measured (`unpackable`: why its batches are
    padded whatever train.packing says, or "")."""
    t = config.train
    findings = []
    if clock.data_wait_share > DATA_WAIT_LIMIT:
        findings.append(f"{clock.data_wait_share:.0%} of training time waited for batches: set "
                        f"train.dataloader_num_workers={max(2, t.dataloader_num_workers * 2)}")
    if padding_share > PADDING_LIMIT:
        fix = (f"padded batches ({unpackable}): a smaller train.per_device_train_batch_size with more "
               "gradient_accumulation_steps pads less") if unpackable else \
            "train.packing=true packs examples into full rows" if not t.packing else "more data fills rows better"
        findings.append(f"{padding_share:.0%} of the positions in each batch were padding: {fix}")
    if sdpa:
        findings.append(sdpa)
    return findings
