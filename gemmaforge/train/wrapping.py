"""The PEFT model exactly as training runs it: LoRA on the language model's layers (never a tower or a router),
the chat markers' embedding rows, and the patches training relies on. The memory planner traces the same
wrapping, so it lives here, below the train recipe."""

from __future__ import annotations

from typing import Any

from gemmaforge.config import RunConfig
from gemmaforge.families import Family
from gemmaforge.models import ResolvedModel, load_causal_lm, text_attention
from gemmaforge.train import packed_attention
from gemmaforge.train.dropout import use_byte_mask_dropout
from gemmaforge.train.geglu import use_recomputed_gelu
from gemmaforge.train.lora_targets import adapted_parts, resolve_lora_parameters, resolve_lora_targets, with_towers
from gemmaforge.train.reward_head import REWARD_HEAD, attach_reward_head
from gemmaforge.train.sharding import strategy
from gemmaforge.train.template_tokens import use_sparse_template_tokens


def lora_targets(config: RunConfig, base: ResolvedModel) -> list[str] | str:
    return config.lora.target_modules or list(base.family.default_lora_targets)


def template_token_ids(tokenizer: Any, family: Family) -> list[int]:
    return tokenizer.convert_tokens_to_ids([family.chat.turn_start, family.chat.turn_end])


def build_peft_model(config: RunConfig, base: ResolvedModel, tokenizer: Any, precision: str) -> Any:
    import torch
    from transformers import set_seed

    set_seed(config.train.seed)  # the LoRA initialisation draws from the global RNG: same config, same run
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    model = load_causal_lm(base.path, base.spec, dtype, load_in_4bit=config.model.load_in_4bit,
                           shard_4bit=strategy() == "fsdp2")
    token_ids = template_token_ids(tokenizer, base.family) if config.lora.train_template_tokens else None
    return wrap_for_training(model, config, base.family, lora_targets(config, base), token_ids)


def wrap_for_training(model: Any, config: RunConfig, family: Family, targets: list[str] | str,
                      template_ids: list[int] | None) -> Any:
    """The PEFT model exactly as training runs it (the memory planner traces the same wrapping)."""
    from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training

    if config.train.packing:  # each example attends alone, through the per-example kernel until one is chosen
        multimodal = model.config.get_text_config() is not model.config
        model.set_attn_implementation(text_attention(multimodal, packed_attention.register()))
    targets = resolve_lora_targets(model, targets)  # the language model only, never a tower or router
    targets, projector = with_towers(model, targets, adapted_parts(config.lora))
    parameters = (resolve_lora_parameters(model, config.lora.target_parameters) if config.lora.target_parameters
                  else None)
    trained_whole = (config.lora.modules_to_save or []) + projector
    if config.train.method == "rm":  # the score head, trained whole and saved with the adapter
        attach_reward_head(model)
        trained_whole.append(REWARD_HEAD)
    if config.model.load_in_4bit:
        checkpointing = bool(config.train.gradient_checkpointing)  # null (auto) was resolved by train, or is off
        model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=checkpointing)
    lora = config.lora
    model = get_peft_model(
        model,
        LoraConfig(
            task_type="CAUSAL_LM",
            r=lora.r,
            lora_alpha=lora.lora_alpha,  # type: ignore[arg-type]  # PEFT annotates int; any number scales
            lora_dropout=lora.lora_dropout,
            target_modules=targets,
            target_parameters=parameters,
            bias=lora.bias,
            use_rslora=lora.use_rslora,
            use_dora=lora.use_dora,
            modules_to_save=trained_whole or None,
            trainable_token_indices=template_ids,
        ),
    )
    use_sparse_template_tokens(model)
    use_byte_mask_dropout(model)
    use_recomputed_gelu(model)
    from gemmaforge.train.loss import install_supervised_forward  # loads transformers' Trainer: only when wrapping

    install_supervised_forward(model, config.train.logits_chunk_size)
    return model
