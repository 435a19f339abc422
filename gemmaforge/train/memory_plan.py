"""Peak training memory of a config, predicted before any weight loads, and what to change when it cannot fit.

The peak is the sum of terms that are each counted, not guessed:
* weights: the whole model built on the meta device (no memory) and wrapped as training wraps it; frozen
  weights in the training dtype, or NF4 (~0.52 bytes each) for the linear layers of a 4-bit base;
* trainable: each trainable parameter in fp32 with its gradient and AdamW's two moments (16 bytes);
* activations: what autograd keeps, per token and layer (train/activations.py), for full rows of
  cutoff_len tokens (the worst batch; two rows per DPO pair); with gradient checkpointing, the layers' inputs;
* backward: while a layer's backward runs, its gradients take about what it kept (with gradient
  checkpointing, its recomputed activations as well);
* logits: one chunk of logits_chunk_size supervised positions x the vocabulary, as the fused loss holds it at
  its peak (logit_bytes);
* runtime: on the CPU, this process's resident memory before the model loads (interpreter, libraries,
  tokenizer, data). Loading has its own peak there: the checkpoint file mapped while its weights convert.
  On a GPU, the driver context outside torch's allocator;
* cpu heap: on the CPU, memory freed by activations that glibc keeps fragmented in its heap (measured).

Several ranks (`--nproc N`, or the launcher's own N when `train` plans): each rank trains its own batch, so the
activations, backward and logits stay per rank; what a strategy shares out is the model state:
* ddp: every rank holds all weights and all trainable state, plus DDP's gradient buckets (a copy of the
  trainable gradients in fp32);
* zero2: the trainable parameters stay whole on every rank, their gradients and AdamW moments are sharded;
* fsdp2, zero3: weights and trainable state sharded 1/N, plus what is gathered whole while it computes: two
  decoder layers (the one running and the one prefetched) and the tied embedding / output layer, which FSDP2
  keeps whole from the first layer to the loss (not resharded after forward, as accelerate prepares it).
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from gemmaforge.config import RunConfig
from gemmaforge.distributed import local_rank
from gemmaforge.errors import UserError
from gemmaforge.models import ResolvedModel, load_tokenizer
from gemmaforge.system.memory import available_ram, resident_bytes
from gemmaforge.train.activations import ActivationProfile, profile_activations, text_config
from gemmaforge.train.precision import resolve_precision
from gemmaforge.train.sharding import STRATEGIES
from gemmaforge.train.tower_activations import (
    audio_path_trains,
    bytes_per_audio_token,
    bytes_per_picture,
    image_path_trains,
)
from gemmaforge.units import gib

ADAMW_BYTES_PER_PARAM = 16  # fp32 value, gradient, two moments
NF4_BYTES_PER_PARAM = 0.5 + 1 / 64 + 4 / (64 * 256)  # 4 bits, an 8-bit absmax per 64, an fp32 per 256 absmax
GPU_CONTEXT_BYTES = 512 * 2**20  # CUDA/HIP context and kernels outside torch's allocator (typical; not measured here)
# glibc's heap on the CPU keeps memory that activations freed, fragmented: mallinfo2 shows it growing by about
# half of what a layer's activations take, per layer and token, when packed rows run attention one example at
# a time (many differently sized buffers), by less with gradient checkpointing (fewer buffers alive at once),
# and by a fifth for unpadded rows. Fitted on the rows of benchmarks/memory_plan.py: (packing, checkpointing)
CPU_HEAP_SHARE = {(True, False): 0.5, (True, True): 0.3, (False, False): 0.2, (False, True): 0.2}
# Rows trained per example: a DPO pair is its chosen and its rejected row, both kept for backward. The reference
# passes (and KTO's mismatched rows) run without gradient: they hold one layer's activations at a time, less than
# a layer's backward, so they add nothing to the peak.
ROWS_PER_EXAMPLE = {"dpo": 2, "rm": 2}


@dataclass(frozen=True)
class Device:
    kind: str  # "cpu" or "gpu"
    name: str
    capacity_bytes: int  # what training may use
    runtime_bytes: int  # already used before the model loads (CPU: this process; GPU: the driver context)


@dataclass(frozen=True)
class ModelCounts:
    frozen_bytes: int  # weights that do not train, in their training dtype
    trainable_params: int
    checkpoint_bytes: int  # the checkpoint files on disk (mapped while loading on the CPU)
    vocab_size: int
    layers: int
    largest_layer_bytes: int  # the frozen weights of the largest decoder layer
    embedding_bytes: int  # the (tied) token embedding


@dataclass(frozen=True)
class Plan:
    device: Device
    batch_size: int
    cutoff_len: int
    gradient_checkpointing: bool
    parts: dict[str, int]
    load_peak_bytes: int  # CPU only: the loading peak (0 on a GPU)
    advice: list[str] = field(default_factory=list)
    largest_batch: int = 0  # at this cutoff_len (0: none fits)
    largest_cutoff: int = 0  # at this batch size
    ranks: int = 1
    strategy: str = "ddp"
    smallest_setup: str = ""  # the fewest ranks of this device that fit, for each strategy

    @property
    def peak_bytes(self) -> int:
        return max(sum(self.parts.values()), self.load_peak_bytes)

    @property
    def fits(self) -> bool:
        return self.peak_bytes <= self.device.capacity_bytes

    def as_dict(self) -> dict[str, Any]:
        return {
            "device": vars(self.device), "batch_size": self.batch_size, "cutoff_len": self.cutoff_len,
            "gradient_checkpointing": self.gradient_checkpointing, "parts": self.parts,
            "load_peak_bytes": self.load_peak_bytes, "peak_bytes": self.peak_bytes, "fits": self.fits,
            "largest_batch": self.largest_batch, "largest_cutoff": self.largest_cutoff, "advice": self.advice,
            "ranks": self.ranks, "strategy": self.strategy, "smallest_setup": self.smallest_setup,
        }


@dataclass(frozen=True)
class MediaLoad:
    """The most of each medium one training example holds: what an adapted tower keeps is priced for them."""

    pictures: int = 0
    audio_tokens: int = 0


NO_MEDIA = MediaLoad()


class Planner:
    """Counts once per model and config, then prices any batch size and cutoff_len."""

    def __init__(self, config: RunConfig, base: ResolvedModel, precision: str, device: Device, ranks: int = 1,
                 strategy: str = "ddp", media: MediaLoad = NO_MEDIA):
        import torch
        from transformers import AutoConfig

        if strategy not in STRATEGIES:
            raise UserError(f"strategy {strategy!r}: expected one of {', '.join(STRATEGIES)}")
        if ranks < 1:
            raise UserError(f"--nproc {ranks}: expected 1 or more processes")
        self.config, self.device, self.ranks, self.strategy = config, device, ranks, strategy
        self.dtype = torch.bfloat16 if precision == "bf16" else torch.float32
        model_config = AutoConfig.from_pretrained(base.path)
        self.context = getattr(text_config(model_config), "max_position_embeddings", None) or 8192
        self.counts = count_model(model_config, base, config, self.dtype)
        self.logit_bytes = logit_bytes(model_config, self.dtype)
        self.profile: ActivationProfile = profile_activations(model_config, base.family, config, self.dtype)
        # an adapted tower or projector keeps each picture's and each audio token's activations; a frozen one nothing
        # (tower_activations)
        self.pictures = media.pictures if "vision" in base.spec.towers else 0
        self.picture_bytes = bytes_per_picture(model_config, base.path, base.family, config, self.dtype) \
            if self.pictures and image_path_trains(config) else 0.0
        self.audio_tokens = media.audio_tokens if "audio" in base.spec.towers else 0
        self.audio_token_bytes = bytes_per_audio_token(model_config, base.path, base.family, config, self.dtype) \
            if self.audio_tokens and audio_path_trains(config) else 0.0
        if device.kind == "cpu":  # the probe's memory stays in this process's heap, under the model that loads next
            self.device = replace(device, runtime_bytes=max(device.runtime_bytes, resident_bytes()))

    def parts(self, batch: int, cutoff: int, checkpointing: bool, ranks: int | None = None,
              strategy: str | None = None) -> dict[str, int]:
        tokens = batch * cutoff * ROWS_PER_EXAMPLE.get(self.config.train.method, 1)
        chunk = min(self.config.train.logits_chunk_size, tokens)
        layer = self.profile.largest_layer(tokens, cutoff)
        parts = {
            "runtime": self.device.runtime_bytes,
            **self.model_state(ranks or self.ranks, strategy or self.strategy),
            "activations": round(self.profile.total(tokens, cutoff, checkpointing)),
            "backward": round(layer * (2 if checkpointing else 1)),
            # a reward model never runs the output layer: its head reads one position per row
            "logits": 0 if self.config.train.method == "rm" else chunk * self.counts.vocab_size * self.logit_bytes,
        }
        if self.picture_bytes:
            parts["vision"] = round(batch * self.pictures * self.picture_bytes)
        if self.audio_token_bytes:
            parts["audio"] = round(batch * self.audio_tokens * self.audio_token_bytes)
        if self.device.kind == "cpu":
            share = CPU_HEAP_SHARE[self.config.train.packing, checkpointing]
            parts["cpu heap"] = round(share * self.profile.total(tokens, cutoff, checkpointing=False))
        return parts

    def model_state(self, ranks: int, strategy: str) -> dict[str, int]:
        """Weights and trainable state on one rank of `ranks` under `strategy` (the module docstring)."""
        counts = self.counts
        trainable = counts.trainable_params * ADAMW_BYTES_PER_PARAM
        if ranks == 1:
            return {"weights": counts.frozen_bytes, "trainable": trainable}
        if strategy == "ddp":
            return {"weights": counts.frozen_bytes, "trainable": trainable,
                    "ddp buckets": counts.trainable_params * 4}
        if strategy == "zero2":
            return {"weights": counts.frozen_bytes,
                    "trainable": counts.trainable_params * 4 + math.ceil(counts.trainable_params * 12 / ranks)}
        gathered = 2 * counts.largest_layer_bytes + counts.embedding_bytes
        return {"weights": math.ceil(counts.frozen_bytes / ranks), "trainable": math.ceil(trainable / ranks),
                "gathered": gathered}

    def load_peak(self) -> int:
        if self.device.kind != "cpu":
            return 0
        return self.device.runtime_bytes + self.counts.checkpoint_bytes + self.counts.frozen_bytes

    def fits(self, batch: int, cutoff: int, checkpointing: bool, ranks: int | None = None,
             strategy: str | None = None) -> bool:
        return max(sum(self.parts(batch, cutoff, checkpointing, ranks, strategy).values()),
                   self.load_peak()) <= self.device.capacity_bytes

    def plan(self, checkpointing: bool | None = None) -> Plan:
        """The config's plan; `checkpointing` overrides train.gradient_checkpointing."""
        t = self.config.train
        checkpointing = bool(t.gradient_checkpointing) if checkpointing is None else checkpointing  # auto: off
        plan = Plan(self.device, t.per_device_train_batch_size, t.cutoff_len, checkpointing,
                    self.parts(t.per_device_train_batch_size, t.cutoff_len, checkpointing), self.load_peak(),
                    largest_batch=self.largest_batch(t.cutoff_len, checkpointing),
                    largest_cutoff=self.largest_cutoff(t.per_device_train_batch_size, checkpointing),
                    ranks=self.ranks, strategy=self.strategy, smallest_setup=self.smallest_setup(checkpointing))
        return replace(plan, advice=self.advice(plan))

    def smallest_setup(self, checkpointing: bool) -> str:
        """For each strategy, the fewest ranks (1, 2, 4 or 8 of this device) that fit this config."""
        t = self.config.train
        found = []
        for strategy in STRATEGIES:
            for ranks in (1, 2, 4, 8):
                if self.fits(t.per_device_train_batch_size, t.cutoff_len, checkpointing, ranks, strategy):
                    found.append(f"{strategy} x {ranks}")
                    break
            else:
                found.append(f"{strategy}: not with 8")
        return ", ".join(found)

    def largest_batch(self, cutoff: int, checkpointing: bool) -> int:
        return _largest(lambda b: self.fits(b, cutoff, checkpointing), 1, 4096)

    def largest_cutoff(self, batch: int, checkpointing: bool) -> int:
        # in multiples of 8 tokens, the granularity kernels work in
        return 8 * _largest(lambda c: self.fits(batch, 8 * c, checkpointing), 1, self.context // 8)

    def advice(self, plan: Plan) -> list[str]:
        """What to change, each priced by this planner; empty when the plan fits."""
        if plan.fits:
            return []
        t = self.config.train
        if plan.load_peak_bytes > self.device.capacity_bytes:
            return [(f"loading alone needs {gib(plan.load_peak_bytes)} on this {self.device.kind}: the model is "
                    f"too large for {gib(self.device.capacity_bytes)}; "
                    "use a smaller Gemma or a machine with more memory")]
        hints = []
        if not plan.gradient_checkpointing and self.fits(t.per_device_train_batch_size, t.cutoff_len, True):
            peak = sum(self.parts(t.per_device_train_batch_size, t.cutoff_len, True).values())
            hints.append(f"train.gradient_checkpointing=true: peak {gib(peak)} (about 30% slower steps)")
        if plan.largest_batch:
            b = plan.largest_batch
            accumulation = t.gradient_accumulation_steps * math.ceil(t.per_device_train_batch_size / b)
            hints.append(f"train.per_device_train_batch_size={b} train.gradient_accumulation_steps={accumulation} "
                         f"(the same {t.per_device_train_batch_size * t.gradient_accumulation_steps}-row effective "
                         "batch or more)")
        if plan.largest_cutoff:
            hints.append(f"train.cutoff_len={plan.largest_cutoff} (longer examples are dropped or truncated)")
        if not plan.gradient_checkpointing:
            b = self.largest_batch(t.cutoff_len, True)
            if b and b != plan.largest_batch:
                hints.append(f"train.gradient_checkpointing=true with train.per_device_train_batch_size={b}")
        if self.device.kind == "gpu" and not self.config.model.load_in_4bit:
            hints.append("model.load_in_4bit=true (QLoRA): the frozen linear weights in ~0.52 bytes per parameter")
        return hints or [(f"nothing fits in {gib(self.device.capacity_bytes)}: even a batch of 1 row of 8 tokens "
                         "needs more; use a smaller Gemma or a device with more memory")]


def _largest(fits: Any, low: int, high: int) -> int:
    """The largest n in [low, high] with fits(n), for a monotone fits; 0 when even `low` does not fit."""
    if not fits(low):
        return 0
    while low < high:
        mid = (low + high + 1) // 2
        low, high = (mid, high) if fits(mid) else (low, mid - 1)
    return low


def count_model(model_config: Any, base: ResolvedModel, config: RunConfig, dtype: Any) -> ModelCounts:
    """Parameter bytes of the model wrapped for training, built on the meta device."""
    import torch
    from transformers import AutoModelForCausalLM

    from gemmaforge.train.wrapping import lora_targets, wrap_for_training

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(model_config, dtype=dtype)
        unquantized = config.model_copy(deep=True)
        unquantized.model.load_in_4bit = False  # bitsandbytes cannot quantize meta tensors: priced below
        token_ids = [0, 1] if config.lora.train_template_tokens else None  # two marker rows; ids do not matter here
        model = wrap_for_training(model, unquantized, base.family, lora_targets(config, base), token_ids)
    frozen = trainable = 0
    element = torch.finfo(dtype).bits // 8
    per_layer: dict[str, int] = {}
    for name, param in model.named_parameters():
        if param.requires_grad:
            trainable += param.numel()
            continue
        size = (math.ceil(param.numel() * NF4_BYTES_PER_PARAM)
                if config.model.load_in_4bit and _quantized_by_bitsandbytes(name, param) else param.numel() * element)
        frozen += size
        if layer := _LAYER.search(name):
            per_layer[layer.group(0)] = per_layer.get(layer.group(0), 0) + size
    embedding = model.get_input_embeddings()
    embedding_bytes = sum(p.numel() * element for p in embedding.parameters() if not p.requires_grad)
    cfg = text_config(model_config)
    return ModelCounts(frozen, trainable, checkpoint_bytes(base.path), cfg.vocab_size, cfg.num_hidden_layers,
                       max(per_layer.values(), default=0), embedding_bytes)


_LAYER = re.compile(r"^.*\.layers\.\d+\.")  # a decoder (or tower encoder) layer: FSDP2's unit of gathering


def logit_bytes(model_config: Any, dtype: Any) -> int:
    """Bytes per supervised position and vocabulary entry at the fused loss's peak (train/linear_cross_entropy.py):
    the fp32 logits and, while the product converts, its copy in the training dtype (none in fp32, where the
    product is already fp32); with soft-capping, the capped values and the logits, two fp32 buffers."""
    import torch

    element = torch.finfo(dtype).bits // 8
    converting = 4 + (element if element != 4 else 0)
    return max(converting, 8) if getattr(text_config(model_config), "final_logit_softcapping", None) else converting


def _quantized_by_bitsandbytes(name: str, param: Any) -> bool:
    """bitsandbytes quantizes the linear weights inside the decoder layers (not embeddings, norms or lm_head)."""
    return param.dim() == 2 and ".layers." in name and "lora_" not in name


def checkpoint_bytes(model_dir: Path) -> int:
    return sum(f.stat().st_size for f in model_dir.glob("*.safetensors"))


# ---------------------------------------------------------------------------- devices


def this_device(gpu_memory: int | None = None) -> Device:
    """The device training will use, or a GPU with `gpu_memory` bytes (planning for another machine)."""
    import torch

    if gpu_memory is not None:
        return Device("gpu", f"a GPU with {gib(gpu_memory)}", gpu_memory, GPU_CONTEXT_BYTES)
    if torch.cuda.is_available():
        index = local_rank()  # each rank of a launched run plans for its own GPU
        free, _total = torch.cuda.mem_get_info(index)  # after the context is made: free excludes it
        return Device("gpu", torch.cuda.get_device_name(index), int(free), 0)
    rss = resident_bytes()
    return Device("cpu", "this CPU", available_ram() + rss, rss)


def resolved_plan(planner: Planner) -> Plan:
    """The plan training follows: gradient checkpointing left to auto (null) is on only when the run fits with it
    and not without."""
    plan = planner.plan()
    if not plan.fits and planner.config.train.gradient_checkpointing is None:
        checkpointed = planner.plan(checkpointing=True)
        if checkpointed.fits:
            return checkpointed
    return plan


def plan_config(config: RunConfig, base: ResolvedModel, gpu_memory: int | None = None, ranks: int = 1,
                strategy: str = "ddp", media: MediaLoad = NO_MEDIA) -> Plan:
    """`gemmaforge plan`'s plan: this device's, or a GPU of gpu_memory bytes (where precision auto means bf16,
    which every GPU gemmaforge targets has but RDNA1/2), for one of `ranks` processes under `strategy`, with up to
    `media` in each example."""
    requested = config.train.precision
    precision = "bf16" if gpu_memory is not None and requested == "auto" else resolve_precision(requested, base.family)
    load_tokenizer(base.path)  # resident as it will be in training, for the CPU's runtime part
    return resolved_plan(Planner(config, base, precision, this_device(gpu_memory), ranks, strategy, media))


def plan_summary(plan: Plan) -> str:
    per_rank = f" per rank ({plan.ranks} ranks, {plan.strategy})" if plan.ranks > 1 else ""
    lines = [(f"memory plan{per_rank} for {plan.device.name}: batch {plan.batch_size} x cutoff_len "
             f"{plan.cutoff_len}, gradient checkpointing {'on' if plan.gradient_checkpointing else 'off'}")]
    for name, value in plan.parts.items():
        lines.append(f"  {name:12} {gib(value):>12}")
    if plan.load_peak_bytes:
        lines.append(f"  {'load peak':12} {gib(plan.load_peak_bytes):>12}  (the checkpoint mapped while it converts)")
    verdict = "fits" if plan.fits else "does NOT fit"
    lines.append(f"  {'peak':12} {gib(plan.peak_bytes):>12}  of {gib(plan.device.capacity_bytes)}: {verdict}")
    lines.append(f"  largest batch at cutoff_len {plan.cutoff_len}: {plan.largest_batch or 'none'}; largest "
                 f"cutoff_len at batch {plan.batch_size}: {plan.largest_cutoff or 'none'}")
    lines.append(f"  fewest ranks of this device that fit, per strategy: {plan.smallest_setup}")
    lines.extend(f"  try: {hint}" for hint in plan.advice)
    return "\n".join(lines)


def plan_json(plan: Plan) -> str:
    return json.dumps(plan.as_dict(), indent=2)
