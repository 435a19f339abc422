"""The train stage: read data/ from the run directory, LoRA-tune the base model with the run's training method
(`train.method`, recipe/method.py), write adapter/. Everything here is the same for every method."""

from __future__ import annotations

import os
import time
from typing import Any

from gemmaforge.config import RunConfig
from gemmaforge.console import console, escape
from gemmaforge.distributed import gather, local_rank, world_size
from gemmaforge.errors import StageError, UserError
from gemmaforge.families import Family
from gemmaforge.models import ResolvedModel, default_home, load_tokenizer, save_tokenizer_once
from gemmaforge.recipe.dpo import DPO
from gemmaforge.recipe.kto import KTO
from gemmaforge.recipe.method import Method
from gemmaforge.recipe.pt import PT
from gemmaforge.recipe.rm import RM
from gemmaforge.recipe.sft import SFT
from gemmaforge.recipe.troubleshoot import (
    StepClock,
    diagnose_non_finite,
    diagnose_out_of_memory,
    is_out_of_memory,
    slow_step_findings,
)
from gemmaforge.runs import RunDir, atomic_dir
from gemmaforge.senses import Senses
from gemmaforge.system.memory import peak_memory_bytes, reset_peak_memory
from gemmaforge.system.monitor import DeviceMonitor
from gemmaforge.system.sdpa_probe import attention_finding
from gemmaforge.train.callbacks import MetricsCallback, TrainingProgress, plot_losses
from gemmaforge.train.checkpoints import (
    CompleteMarker,
    complete_steps,
    keep_metrics_until,
    last_complete_checkpoint,
)
from gemmaforge.train.kernel_choice import KernelChoice, choose_kernels
from gemmaforge.train.loss import NonFiniteLoss
from gemmaforge.train.memory_plan import (
    NO_MEDIA,
    MediaLoad,
    Plan,
    Planner,
    plan_summary,
    resolved_plan,
    this_device,
)
from gemmaforge.train.packed_attention import use_kernels
from gemmaforge.train.preflight import preflight
from gemmaforge.train.sharding import (
    check_strategy,
    full_trainable_state,
    planned_as,
    rank_model_state,
    show_tied_embedding,
)
from gemmaforge.train.wrapping import build_peft_model, lora_targets
from gemmaforge.units import gib

METHODS: dict[str, Method] = {method.name: method for method in (SFT, PT, DPO, KTO, RM)}


def training_arguments(config: RunConfig, run: RunDir, precision: str, has_val: bool) -> Any:
    import torch
    from transformers import TrainingArguments

    t = config.train
    evaluate = t.eval_strategy if has_val else "no"
    if t.report_to == "tensorboard":  # transformers' TensorBoard callback reads its folder from the environment
        os.environ["TENSORBOARD_LOGGING_DIR"] = str(run.root / "tensorboard")
    return TrainingArguments(
        output_dir=str(run.checkpoints_dir),
        num_train_epochs=t.num_train_epochs,
        max_steps=t.max_steps,
        per_device_train_batch_size=t.per_device_train_batch_size,
        per_device_eval_batch_size=t.per_device_train_batch_size,
        gradient_accumulation_steps=t.gradient_accumulation_steps,
        learning_rate=t.learning_rate,
        lr_scheduler_type=t.lr_scheduler_type,
        warmup_steps=t.warmup_steps or t.warmup_ratio,  # transformers reads a float < 1 as a ratio
        weight_decay=t.weight_decay,
        max_grad_norm=t.max_grad_norm,
        logging_steps=t.logging_steps,
        logging_nan_inf_filter=False,  # a NaN must reach the guard, not be averaged away
        save_strategy=t.save_strategy,
        save_steps=t.save_steps,
        save_total_limit=t.save_total_limit,
        eval_strategy=evaluate,
        eval_steps=t.eval_steps or t.save_steps,
        load_best_model_at_end=t.load_best_model_at_end and evaluate != "no",
        metric_for_best_model=t.metric_for_best_model,
        greater_is_better=False,  # both accepted metrics are the loss
        **checkpointing_arguments(bool(t.gradient_checkpointing)),
        dataloader_num_workers=t.dataloader_num_workers,
        bf16=precision == "bf16",
        fp16=precision == "fp16",
        seed=t.seed,
        data_seed=t.seed,
        report_to=[] if t.report_to == "none" else [t.report_to],
        remove_unused_columns=False,
        prediction_loss_only=True,
        # on a GPU, batches are copied from pinned memory without waiting (a copy from pageable memory, or a
        # blocking one, stops the host until the GPU has finished the step before)
        dataloader_pin_memory=torch.cuda.is_available(),
        accelerator_config={"non_blocking": torch.cuda.is_available()},
        use_cpu=not torch.cuda.is_available(),
        save_on_each_node=run.per_node,  # nodes that do not share the run directory each keep checkpoints
    )


def checkpointing_arguments(enabled: bool) -> dict[str, Any]:
    """transformers renamed gradient_checkpointing to activation_checkpointing; pass the name it knows."""
    from dataclasses import fields

    from transformers import TrainingArguments

    name = ("activation_checkpointing" if "activation_checkpointing" in {f.name for f in fields(TrainingArguments)}
            else "gradient_checkpointing")
    return {name: enabled, f"{name}_kwargs": {"use_reentrant": False}}


# oneDNN, which runs the CPU's matmuls, keeps a compiled kernel for every shape it meets, up to 1024, and
# PyTorch's ideep layer above it keeps its own cache of matmul objects per shape and thread (LRU_CACHE_CAPACITY,
# also 1024). Packed batches bring new shapes at every step (each example's attention has its own length), so a
# packed CPU run's memory grew for as long as it trained; bounded caches give the same step time and memory that
# levels off (benchmarks/README.md, the memory planner's section).
CPU_KERNEL_CACHES = {"ONEDNN_PRIMITIVE_CACHE_CAPACITY": "128", "LRU_CACHE_CAPACITY": "16"}


def train(run: RunDir, config: RunConfig, base: ResolvedModel) -> dict[str, Any]:
    """Train and save the adapter (with the tokenizer and its chat template) into run.adapter_dir."""
    for name, capacity in CPU_KERNEL_CACHES.items():  # read at the first matmul
        os.environ.setdefault(name, capacity)
    import torch
    from transformers import EarlyStoppingCallback
    from transformers.trainer_callback import ProgressCallback

    family = base.family
    precision = preflight(config, base)
    sharding = check_strategy(config.model.load_in_4bit)
    if run.per_node and sharding not in ("single", "ddp"):
        raise UserError(f"{sharding} writes each checkpoint as shards from every rank, which one node alone cannot "
                        f"resume from, and the nodes do not share {run.root}: give every node the same run "
                        "directory (a shared filesystem), or train with DDP (examples/distributed/ddp.yaml)")
    tokenizer = load_tokenizer(base.path)
    tokenizer.chat_template = family.chat.jinja()
    save_tokenizer_once(tokenizer)  # into every checkpoint and the adapter, unchanged
    senses = Senses.of(base.path, base.spec, tokenizer)  # data with media was refused without their tower
    method = METHODS[config.train.method]
    data = method.datasets(run, config, tokenizer, base, senses)
    config = data.config
    reset_peak_memory()  # the plan counts from here (what this process holds now), so does the measured peak
    plan, config = check_memory(config, base, precision, sharding, data.media)
    model = build_peft_model(config, base, tokenizer, precision)
    kernels = None
    if config.train.packing:
        kernels = attention_kernels(config, model, data.collator(data.train[:config.train.per_device_train_batch_size]))
    args = training_arguments(config, run, precision, has_val=bool(data.val))
    if sharding == "fsdp2":
        show_tied_embedding(model)
    resume = common_checkpoint(run)
    resumed_step: int | None = None
    if resume:
        resumed_step = int(resume.name.split("-")[1])
        console.print(f"[bold]train[/]: resuming from {resume.name} (step {resumed_step}), "
                      "the last complete checkpoint")
        if run.writes:
            keep_metrics_until(run.metrics_path, resumed_step)
    elif run.writes:
        run.metrics_path.unlink(missing_ok=True)
    clock = StepClock()
    callbacks: list[Any] = [MetricsCallback(run.metrics_path, run.writes), CompleteMarker(run.writes), clock]
    if config.train.early_stopping_patience and data.val:
        callbacks.append(EarlyStoppingCallback(early_stopping_patience=config.train.early_stopping_patience))
    trainer = method.trainer(
        model=model,
        args=args,
        train_dataset=data.train,
        eval_dataset=data.val or None,
        data_collator=data.collator,
        processing_class=tokenizer,
        callbacks=callbacks,
        **data.trainer_options,
    )
    if trainer.pop_callback(ProgressCallback):  # absent when the progress bar is disabled
        trainer.add_callback(TrainingProgress())
    trainer.monitor = DeviceMonitor().start()
    start = time.perf_counter()
    try:
        result = trainer.train(resume_from_checkpoint=str(resume) if resume else None)
        trainer.check_finite()  # the steps after the last log
    except NonFiniteLoss as exc:
        raise StageError(diagnose_non_finite(exc, config, precision, family)) from None
    except (RuntimeError, MemoryError) as exc:
        if not is_out_of_memory(exc):
            raise
        raise StageError(diagnose_out_of_memory(exc, plan, config)) from None
    finally:
        trainer.monitor.stop()
    runtime = time.perf_counter() - start
    # the training loop's peak, read before what follows it (the last evaluation, drawing the loss curve) can raise
    # the process's high-water mark on the CPU: what the memory plan is compared with
    training_peak = peak_memory_bytes()
    findings = slow_steps(clock, trainer.padding_share, config, base, family, model.dtype, data.unpackable)
    for line in findings:
        console.print(f"[yellow]train: slow steps[/]: {escape(line)}")
    evals = [log for log in trainer.state.log_history if "eval_loss" in log]
    if data.val and (not evals or evals[-1]["step"] != result.global_step or config.train.load_best_model_at_end):
        evals.append(trainer.evaluate())  # of the restored best model when load_best_model_at_end
    final_eval = evals[-1] if evals else {}
    if run.writes:  # after training: never a cost inside a step
        plot_losses(run.metrics_path, run.loss_plot_path)
    adapter = full_trainable_state(model)  # gathered from the shards of a sharded run
    checksums = gather(adapter_checksum(adapter))
    if len(set(checksums)) != 1:
        raise StageError(f"the {len(checksums)} ranks finished with different adapters ({checksums}): "
                         "gradients were not synchronised")
    if run.writes:
        with atomic_dir(run.adapter_dir) as tmp:
            model.save_pretrained(tmp, state_dict=adapter)
            tokenizer.save_pretrained(tmp)
    # what this process's loop trained (a resumed run trained only the steps after its checkpoint), all ranks
    examples, supervised = (sum(counts)
                            for counts in zip(*gather((trainer.examples_trained, trainer.supervised_trained))))
    train_loss: float | None = result.training_loss
    if not examples:  # resumed from the final checkpoint: nothing trained now, so the logged losses tell
        logged = [log["loss"] for log in trainer.state.log_history if "loss" in log]
        train_loss = sum(logged) / len(logged) if logged else None
    return {
        "device": "cuda" if torch.cuda.is_available() else "cpu",
        "method": method.name,
        "precision": precision,
        "packing": config.train.packing,
        "steps": result.global_step,
        "resumed_from_step": resumed_step,
        "best_checkpoint": trainer.state.best_model_checkpoint,
        "samples": data.examples,
        "dropped_examples": data.dropped,
        "train_loss": round(train_loss, 4) if train_loss is not None else None,
        "eval_loss": round(final_eval["eval_loss"], 4) if "eval_loss" in final_eval else None,
        "train_runtime_s": round(runtime, 2),  # the training loop; the stage's runtime_s includes loading
        "samples_per_second": round(examples / runtime, 3),
        "supervised_tokens_per_second": round(supervised / runtime, 1),
        "peak_memory_bytes": training_peak,
        "planned_peak_bytes": plan.peak_bytes if plan else None,
        "planned_parts": plan.parts if plan else None,
        "model_state_bytes": rank_model_state(model, trainer.optimizer),  # this rank's, against the planned parts
        "data_wait_share": round(clock.data_wait_share, 3),
        "padding_share": round(trainer.padding_share, 3),
        "gradient_checkpointing": config.train.gradient_checkpointing,
        "attention_kernels": kernels.kernels if kernels else None,
        "attention_timings_ms": kernels.timings_ms if kernels else None,
        "slow_step_findings": findings,
        "monitor_problems": trainer.monitor.problems,
        "lora_targets": lora_targets(config, base),
        "world_size": len(checksums),
        "strategy": sharding,
        "adapter_checksum": checksums[0],
    }


def attention_kernels(config: RunConfig, model: Any, first_batch: dict[str, Any]) -> KernelChoice:
    """The attention kernel of each layer (train.attention; `auto` measures on a GPU), said and applied."""
    import torch

    device = (torch.device("cuda", local_rank()) if torch.cuda.is_available()
              else torch.device("cpu"))
    choice = choose_kernels(config.train.attention, model, device, model.dtype, first_batch["segments"],
                            default_home())
    use_kernels(model, choice.kernels)
    for note in choice.notes:
        console.print(f"[bold]train[/]: attention: {escape(note)}")
    return choice


def common_checkpoint(run: RunDir) -> Any:
    """The newest complete checkpoint every rank can resume from: the same folder when the run directory is
    shared; with one run directory per node, a node killed mid-save may lack the others' newest one."""
    resume = last_complete_checkpoint(run.checkpoints_dir, delete_incomplete=run.writes)
    if not run.per_node:
        return resume
    steps = [set(found) for found in gather(complete_steps(run.checkpoints_dir))]
    common = set.intersection(*steps)
    return run.checkpoints_dir / f"checkpoint-{max(common)}" if common else None


def slow_steps(clock: StepClock, padding_share: float, config: RunConfig, base: ResolvedModel, family: Family,
               dtype: Any, unpackable: str) -> list[str]:
    """The slow-step findings; a diagnostic that fails is reported as such, after a training that succeeded."""
    try:
        attention = attention_finding(head_dim(base), dtype) if family.attn_implementation == "sdpa" else None
        return slow_step_findings(clock, padding_share, config, attention, unpackable)
    except Exception as exc:  # noqa: BLE001 - the adapter is not saved yet: a diagnostic must not lose it
        return [f"the slow-step diagnosis failed ({type(exc).__name__}: {exc})"]


def check_memory(config: RunConfig, base: ResolvedModel, precision: str, sharding: str,
                 media: MediaLoad = NO_MEDIA) -> tuple[Plan | None, RunConfig]:
    """The memory plan for one rank on this device, and the config to train: a config that cannot fit is refused
    before the model loads, unless gradient checkpointing, left to auto (null), makes it fit (then it is turned on,
    and said); the config returned has it on or off. With train.check_memory=false a planner that fails only costs
    the plan (None)."""
    config = config.model_copy(deep=True)
    auto = config.train.gradient_checkpointing is None
    try:
        planner = Planner(config, base, precision, this_device(), world_size(), planned_as(sharding), media)
        plan = resolved_plan(planner)
    except Exception as exc:  # re-raised unless the user asked to train regardless of the plan
        if config.train.check_memory:
            raise
        console.print(f"[yellow]train[/]: no memory plan ({escape(f'{type(exc).__name__}: {exc}')}); training anyway")
        config.train.gradient_checkpointing = bool(config.train.gradient_checkpointing)
        return None, config
    config.train.gradient_checkpointing = plan.gradient_checkpointing
    if auto and plan.gradient_checkpointing:
        without = planner.plan(checkpointing=False)
        console.print(f"[bold]train[/]: gradient checkpointing on: without it this run needs "
                      f"{gib(without.peak_bytes)} of {gib(plan.device.capacity_bytes)}, with it "
                      f"{gib(plan.peak_bytes)} (slower steps; train.gradient_checkpointing=false refuses instead)")
    if not plan.fits and config.train.check_memory:
        raise UserError(f"this config cannot fit: {plan_summary(plan)}\n(train.check_memory=false trains anyway)")
    if not plan.fits:
        console.print(f"[yellow]train[/]: the memory plan says this does not fit; training anyway "
                      f"(train.check_memory=false)\n{escape(plan_summary(plan))}")
    return plan, config


def head_dim(base: ResolvedModel) -> int:
    """The (sliding layers') head size: what SDPA's kernel choice depends on."""
    text = base.spec.text
    return text.get("head_dim") or text["hidden_size"] // text["num_attention_heads"]


def adapter_checksum(adapter: dict[str, Any]) -> str:
    """A digest of every trainable tensor: equal on every rank when data-parallel training synchronised."""
    import hashlib

    digest = hashlib.sha256()
    for name, tensor in sorted(adapter.items()):
        digest.update(name.encode())
        digest.update(tensor.float().numpy().tobytes())
    return digest.hexdigest()[:16]
