"""Sharded training (FSDP2, DeepSpeed) as `accelerate launch --config_file` sets it up, and what gemmaforge adds
so that a sharded LoRA run saves the same adapter a single process would.

accelerate hands the launcher's choice to every rank through the environment (ACCELERATE_USE_FSDP, FSDP_*,
ACCELERATE_USE_DEEPSPEED); transformers' Trainer then shards the model through accelerate. Three things are ours:
  * accelerate applies FSDP only on an accelerator device; on the CPU (gloo) gemmaforge declares the FSDP state
    itself, so the same recipe runs there (how the tests run it; FSDP2 itself supports the CPU);
  * the chat markers' embedding rows are trained through two PEFT wrappers around one tied weight, which
    accelerate's FSDP2 preparation does not see as tied (it would shard the weight twice): it is shown the tie;
  * the adapter is gathered from its shards before it is checksummed and saved.
"""

from __future__ import annotations

import os
from typing import Any

from gemmaforge.distributed import world_size
from gemmaforge.errors import UserError

# How the memory planner can share the model out among ranks (train/memory_plan.py prices each)
STRATEGIES = ("ddp", "zero2", "fsdp2", "zero3")


def strategy() -> str:
    """The launcher's choice: "single", "ddp", "fsdp2" (or "fsdp1"), or "deepspeed-zero{stage}"."""
    if os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true":
        return f"fsdp{os.environ.get('FSDP_VERSION', '1')}"
    if os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true":
        return f"deepspeed-zero{os.environ.get('ACCELERATE_DEEPSPEED_ZERO_STAGE', '?')}"
    return "ddp" if world_size() > 1 else "single"


def check_strategy(load_in_4bit: bool = False) -> str:
    """The launcher's strategy, refused with the fix when gemmaforge cannot train under it."""
    chosen = strategy()
    if chosen.startswith("fsdp") and chosen != "fsdp2":
        raise UserError(f"the accelerate config asks for FSDP version {chosen[4:]}; gemmaforge trains with FSDP2: "
                        "set fsdp_version: 2 in its fsdp_config (examples/distributed/fsdp2.yaml)")
    if load_in_4bit and chosen == "deepspeed-zero3":
        raise UserError("model.load_in_4bit (QLoRA) with DeepSpeed ZeRO-3: gemmaforge loads the 4-bit model on each "
                        "rank's GPU before DeepSpeed starts, and ZeRO-3 would have to partition it while it loads; "
                        "use examples/distributed/fsdp2.yaml (it shards the 4-bit weights) or deepspeed_zero2.yaml")
    return chosen


def planned_as(chosen: str) -> str:
    """The memory planner's name (one of STRATEGIES) for a launcher strategy."""
    if chosen.startswith("deepspeed-zero"):
        return "zero3" if chosen.endswith("3") else "zero2"  # ZeRO-1 shards less than ZeRO-2: planned as it
    return "fsdp2" if chosen == "fsdp2" else "ddp"


def fsdp_plugin(mixed_precision: str) -> Any:
    """accelerate's FSDP plugin as the launcher configured it (it reads the FSDP_* environment)."""
    from accelerate.utils import FullyShardedDataParallelPlugin

    plugin = FullyShardedDataParallelPlugin()
    if mixed_precision in ("bf16", "fp16"):
        plugin.set_mixed_precision(mixed_precision)
    return plugin


def declare_fsdp_on_cpu(mixed_precision: str) -> None:
    """Make accelerate's shared state FSDP on a CPU-only run launched with an FSDP config; accelerate itself would
    fall back to DDP there. Called before the Trainer's Accelerator is built, which then joins this state."""
    import torch
    from accelerate.state import AcceleratorState, PartialState
    from accelerate.utils import DistributedType, TorchDynamoPlugin

    if torch.cuda.is_available() or not strategy().startswith("fsdp") or world_size() == 1:
        return
    state = AcceleratorState(mixed_precision=mixed_precision, cpu=True, dynamo_plugin=TorchDynamoPlugin(),
                             _from_accelerator=True)
    if state.distributed_type == DistributedType.MULTI_CPU:
        state.distributed_type = DistributedType.FSDP
        state.fsdp_plugin = fsdp_plugin(mixed_precision)
        PartialState._shared_state["distributed_type"] = DistributedType.FSDP  # as AcceleratorState does on GPUs


def show_tied_embedding(model: Any) -> bool:
    """Let accelerate's FSDP2 preparation see that the trained chat-marker rows' two wrappers (input embedding,
    output layer) hold one tied weight: PEFT answers `.weight` with a freshly merged copy, which accelerate takes
    for two weights and shards twice (a parameter in two FSDP units is refused). Answered with the shared frozen
    weight instead, the pair and the final norm become one FSDP unit, as for any tied model. The forward and the
    loss never read `.weight` of a wrapper (both add the trained rows themselves). Returns whether there was a pair."""
    from peft.utils.other import TrainableTokensWrapper

    embed, head = model.get_input_embeddings(), model.get_output_embeddings()
    if not (isinstance(embed, TrainableTokensWrapper) and isinstance(head, TrainableTokensWrapper)):
        return False
    weight = embed.token_adapter.base_layer.weight
    if head.token_adapter.base_layer.weight is not weight:
        return False
    for wrapper in (embed, head):
        wrapped = wrapper._getattr_wrapped

        def frozen_weight(name: str, modules: Any, wrapped: Any = wrapped, wrapper: Any = wrapper) -> Any:
            return wrapper.token_adapter.base_layer.weight if name == "weight" else wrapped(name, modules)

        wrapper._getattr_wrapped = frozen_weight  # type: ignore[method-assign]  # this wrapper's alone
    return True


def full_trainable_state(model: Any) -> dict[str, Any]:
    """Every trainable tensor in full, on the CPU, by name. A sharded one (an FSDP2 DTensor, a DeepSpeed ZeRO-3
    partition) is gathered from all ranks, so every rank calls this; named_parameters' order is the same on all."""
    from torch.distributed.tensor import DTensor

    state = {}
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        if isinstance(param, DTensor):
            state[name] = param.full_tensor().detach().cpu()
        elif hasattr(param, "ds_id"):  # ZeRO-3: DeepSpeed's documented way to see a partitioned parameter whole
            import deepspeed

            with deepspeed.zero.GatheredParameters([param]):
                state[name] = param.detach().cpu().clone()
        else:
            state[name] = param.detach().cpu()
    return state


def rank_model_state(model: Any, optimizer: Any) -> dict[str, int]:
    """The model state this rank holds, in bytes, measured from its own tensors: what the memory plan's `weights`
    and `trainable` terms predict for one rank of a strategy. weights: the frozen parameters' local shards;
    trainable: each trainable parameter's local shard, its optimizer state (AdamW's two moments), and its gradient,
    which has the parameter's size and sharding at a step's peak (freed by the time training returns)."""
    from torch.distributed.tensor import DTensor

    def local_bytes(tensor: Any) -> int:
        tensor = tensor.to_local() if isinstance(tensor, DTensor) else tensor
        return tensor.numel() * tensor.element_size()

    weights = trainable = 0
    for param in model.parameters():
        if not param.requires_grad:
            weights += local_bytes(param)
            continue
        moments = optimizer.state.get(param, {}).values()
        trainable += 2 * local_bytes(param) + sum(local_bytes(m) for m in moments if m.dim() > 0)
    return {"weights": weights, "trainable": trainable}
