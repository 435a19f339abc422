"""The train stage: read data/ from the run directory, LoRA-tune the base model, write adapter/."""

from __future__ import annotations

import time
from typing import Any

from gemmaforge.config import RunConfig
from gemmaforge.console import console
from gemmaforge.data.prepare import read_prepared
from gemmaforge.errors import UserError
from gemmaforge.families import Family
from gemmaforge.models import ResolvedModel, load_causal_lm, load_tokenizer
from gemmaforge.runs import RunDir, atomic_dir
from gemmaforge.templates import hf_chat_template
from gemmaforge.train.callbacks import MetricsCallback
from gemmaforge.train.collate import RightPadCollator, tokenize_conversations
from gemmaforge.train.loss import SupervisedLossTrainer
from gemmaforge.train.precision import resolve_precision
from gemmaforge.train.template_tokens import use_sparse_template_tokens


def lora_targets(config: RunConfig, base: ResolvedModel) -> list[str]:
    return list(config.lora.target_modules or base.family.default_lora_targets)


def template_token_ids(tokenizer: Any, family: Family) -> list[int]:
    return tokenizer.convert_tokens_to_ids([family.chat.turn_start, family.chat.turn_end])


def build_peft_model(config: RunConfig, base: ResolvedModel, tokenizer: Any, precision: str) -> Any:
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import set_seed

    set_seed(config.train.seed)  # the LoRA initialisation draws from the global RNG: same config, same run
    model = load_causal_lm(base.path, base.family, torch.bfloat16 if precision == "bf16" else torch.float32)
    model = get_peft_model(
        model,
        LoraConfig(
            task_type="CAUSAL_LM",
            r=config.lora.r,
            lora_alpha=config.lora.lora_alpha,
            lora_dropout=config.lora.lora_dropout,
            target_modules=lora_targets(config, base),
            bias=config.lora.bias,
            trainable_token_indices=template_token_ids(tokenizer, base.family) if config.lora.train_template_tokens else None,
        ),
    )
    use_sparse_template_tokens(model)
    return model


def training_arguments(config: RunConfig, run: RunDir, precision: str, has_val: bool) -> Any:
    import torch
    from transformers import TrainingArguments

    t = config.train
    return TrainingArguments(
        output_dir=str(run.checkpoints_dir),
        num_train_epochs=t.num_train_epochs,
        max_steps=t.max_steps,
        per_device_train_batch_size=t.per_device_train_batch_size,
        per_device_eval_batch_size=t.per_device_train_batch_size,
        gradient_accumulation_steps=t.gradient_accumulation_steps,
        learning_rate=t.learning_rate,
        lr_scheduler_type=t.lr_scheduler_type,
        warmup_steps=t.warmup_steps,
        weight_decay=t.weight_decay,
        max_grad_norm=t.max_grad_norm,
        logging_steps=t.logging_steps,
        save_strategy="steps",
        save_steps=t.save_steps,
        save_total_limit=t.save_total_limit,
        eval_strategy="steps" if has_val else "no",
        eval_steps=t.save_steps,
        bf16=precision == "bf16",
        fp16=precision == "fp16",
        seed=t.seed,
        data_seed=t.seed,
        report_to="none",
        remove_unused_columns=False,
        prediction_loss_only=True,
        dataloader_pin_memory=False,
        use_cpu=not torch.cuda.is_available(),
    )


def train(run: RunDir, config: RunConfig, base: ResolvedModel) -> dict[str, Any]:
    """Train and save the adapter (with the tokenizer and its chat template) into run.adapter_dir."""
    import torch
    from transformers.trainer_utils import get_last_checkpoint

    family = base.family
    precision = resolve_precision(config.train.precision, family)
    tokenizer = load_tokenizer(base.path)
    tokenizer.chat_template = hf_chat_template(family)
    cutoff = config.train.cutoff_len
    options = {"train_on_prompt": config.data.train_on_prompt, "mask_history": config.data.mask_history}
    train_rows, dropped = tokenize_conversations(
        read_prepared(run.require(run.data_dir / "train.jsonl", "data")), tokenizer, family, cutoff,
        "data/train.jsonl", **options,
    )
    val_rows, _ = tokenize_conversations(
        read_prepared(run.require(run.data_dir / "val.jsonl", "data")), tokenizer, family, cutoff,
        "data/val.jsonl", **options,
    )
    if not train_rows:
        raise UserError(f"no training example keeps a supervised token within train.cutoff_len={cutoff}")
    if dropped:
        console.print(f"[yellow]gemmaforge[/]: {dropped} training examples dropped: prompt alone exceeds cutoff_len={cutoff}")

    model = build_peft_model(config, base, tokenizer, precision)
    args = training_arguments(config, run, precision, has_val=bool(val_rows))
    resume = get_last_checkpoint(str(run.checkpoints_dir)) if run.checkpoints_dir.is_dir() else None
    if resume:
        console.print(f"[bold]gemmaforge[/]: resuming from {resume}")
    else:
        run.metrics_path.unlink(missing_ok=True)
    trainer = SupervisedLossTrainer(
        model=model,
        args=args,
        train_dataset=train_rows,
        eval_dataset=val_rows or None,
        data_collator=RightPadCollator(tokenizer.pad_token_id),
        processing_class=tokenizer,
        callbacks=[MetricsCallback(run.metrics_path, run.loss_plot_path)],
    )
    start = time.perf_counter()
    result = trainer.train(resume_from_checkpoint=resume)
    runtime = time.perf_counter() - start
    evals = [log for log in trainer.state.log_history if "eval_loss" in log]
    if val_rows and (not evals or evals[-1]["step"] != result.global_step):
        evals.append(trainer.evaluate())
    final_eval = evals[-1] if evals else {}
    with atomic_dir(run.adapter_dir) as tmp:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
    supervised = sum(sum(1 for label in ex["labels"] if label != -100) for ex in train_rows)
    epochs = result.metrics.get("epoch", config.train.num_train_epochs)
    return {
        "device": "cuda" if torch.cuda.is_available() else "cpu",
        "precision": precision,
        "steps": result.global_step,
        "train_examples": len(train_rows),
        "dropped_examples": dropped,
        "train_loss": round(result.training_loss, 4),
        "eval_loss": round(final_eval["eval_loss"], 4) if "eval_loss" in final_eval else None,
        "train_runtime_s": round(runtime, 2),
        "samples_per_second": round(len(train_rows) * epochs / runtime, 3),
        "supervised_tokens_per_second": round(supervised * epochs / runtime, 1),
        "lora_targets": lora_targets(config, base),
    }

