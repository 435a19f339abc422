"""LLaMA-Factory training configs, read as gemmaforge configs.

An LLaMA-Factory SFT YAML (`examples/train_lora/*.yaml`: flat keys such as `model_name_or_path`, `lora_rank`,
`dataset`) or the walkthrough's nested variant (`lora_config:` with PEFT's names, `training_args:` with
TrainingArguments' names) is translated key by key into gemmaforge's sections. Every LLaMA-Factory key is in one
of three tables: TRANSLATED (its gemmaforge key, with the value converted where the meaning differs), IGNORED
(it tunes LLaMA-Factory's own machinery; the reason is printed) or REFUSED (it changes what is trained and has no
equivalent: allowed only at LLaMA-Factory's default). A key in none of them is an error, so nothing a user wrote
is silently dropped. Keys left out take LLaMA-Factory's defaults where these differ from gemmaforge's and change
the trained weights (lora_alpha = 2 x rank, lora_dropout 0, every linear layer, cutoff_len 2048, 3 epochs ...).
"""

from __future__ import annotations

import difflib
import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gemmaforge.errors import UserError
from gemmaforge.model_spec import read_spec

# keys only LLaMA-Factory configs have: one of them makes a config LLaMA-Factory's
MARKERS = {"model_name_or_path", "stage", "finetuning_type", "lora_config", "training_args", "template",
           "lora_rank", "lora_target", "dataset", "adapter_name_or_path", "export_dir"}
SECTIONS = ("model", "data", "lora", "train", "eval", "export")

# LLaMA-Factory template -> the gemmaforge families whose turn format it writes (src/llamafactory/data/template.py;
# its model groups in extras/constants.py pair gemma with Gemma 1, gemma2 with Gemma 2 and the text-only Gemma 3
# 270M/1B, gemma3 with Gemma 3 4B+, gemma4 with 26B-A4B/31B, gemma4n with E2B/E4B/12B). gemma, gemma2 and gemma3
# write the same <start_of_turn> turns (they differ in stop words and image plugin), gemma4 and gemma4n <|turn>.
# LLaMA-Factory's stages that are gemmaforge methods (train.method, the same names; config.METHODS: checked equal)
STAGES = ("sft", "pt", "dpo", "kto", "rm")
_TURNS = ("gemma", "gemma2", "gemma3")
TEMPLATES = {"gemma": _TURNS, "gemma2": _TURNS, "gemma3": _TURNS, "gemma4": ("gemma4",), "gemma4n": ("gemma4",)}
NOT_YET = {"gemma3n": "Gemma 3n checkpoints are not supported yet"}
EXPONENT_FLOAT = re.compile(r"^[-+]?(\d+\.?\d*|\.\d+)[eE][-+]?\d+$")
OTHER_MODELS = re.compile(r"qwen|llama|mistral|mixtral|phi-?\d|deepseek|glm|baichuan|internlm|yi-|moss|falcon|"
                          r"olmo|minicpm|granite|ernie|kimi|hunyuan", re.IGNORECASE)


@dataclass
class Translation:
    """A gemmaforge raw config and what became of each key."""

    raw: dict[str, Any] = field(default_factory=dict)
    translated: list[tuple[str, str]] = field(default_factory=list)  # (LLaMA-Factory key, what it became)
    ignored: list[tuple[str, str]] = field(default_factory=list)  # (key, why)
    notes: list[str] = field(default_factory=list)
    origin: dict[str, str] = field(default_factory=dict)  # gemmaforge dotted key -> the key it came from

    def set(self, key: str, value: Any, source: str) -> None:
        if key in self.origin and self._get(key) != value:
            raise UserError(f"{self.origin[key]} and {source} disagree (both set {key})")
        section, _, name = key.rpartition(".")
        node = self.raw
        for part in section.split(".") if section else ():
            node = node.setdefault(part, {})
        node[name] = value
        self.origin[key] = source

    def has(self, key: str) -> bool:
        return key in self.origin

    def _get(self, key: str) -> Any:
        node: Any = self.raw
        for part in key.split("."):
            node = node[part]
        return node

    def report(self) -> str:
        """The translation as YAML comments, for the top of the written config."""
        lines = ["# translated from an LLaMA-Factory config:"]
        lines += [f"#   {key} -> {became}" for key, became in self.translated]
        if self.ignored:
            lines.append("# ignored (they tune LLaMA-Factory's own machinery):")
            lines += [f"#   {key}: {why}" for key, why in self.ignored]
        if self.notes:
            lines.append("# notes:")
            lines += [f"#   {note}" for note in self.notes]
        return "\n".join(lines) + "\n"


Convert = Callable[[Any, str, Translation], Any]


def _same(value: Any, key: str, t: Translation) -> Any:
    return value


def _names(value: Any, key: str, t: Translation) -> list[str]:
    """LLaMA-Factory's comma-separated names (or a YAML list)."""
    if isinstance(value, str):
        return [n.strip() for n in value.split(",") if n.strip()]
    if isinstance(value, list) and all(isinstance(n, str) for n in value):
        return value
    raise UserError(f"{key}: expected names separated by commas, got {value!r}")


def _one_adapter(value: Any, key: str, t: Translation) -> str:
    """The adapter a training run starts from (merged into the base first): one."""
    names = _names(value, key, t)
    if len(names) != 1:
        raise UserError(f"{key}: {value!r}: gemmaforge starts a run from one adapter (merge several first)")
    return names[0]


def _target(value: Any, key: str, t: Translation) -> Any:
    names = _names(value, key, t)
    return "all-linear" if names == ["all"] else names


def _stage(value: Any, key: str, t: Translation) -> str:
    if value not in STAGES:
        what = {"ppo": "PPO"}.get(value, repr(value))
        raise UserError(f"{key}: {value}: gemmaforge trains supervised fine-tuning (stage: sft), continued "
                        f"pretraining (stage: pt), preference tuning (stage: dpo or kto) and reward models (stage: "
                        f"rm), not {what} yet")
    return str(value)


def _finetuning_type(value: Any, key: str, t: Translation) -> str:
    if value != "lora":
        raise UserError(f"{key}: {value}: gemmaforge trains LoRA adapters only (finetuning_type: lora); "
                        "full and freeze tuning rewrite the base weights")
    return "a LoRA adapter"


def _do_train(value: Any, key: str, t: Translation) -> str:
    if value is not True:
        raise UserError(f"{key}: {value!r}: gemmaforge configs train; for evaluation or prediction alone run "
                        "`gemmaforge eval RUN_DIR` on a trained run")
    return "train"


def _template(value: Any, key: str, t: Translation) -> str:
    if value in NOT_YET:
        raise UserError(f"{key}: {value}: {NOT_YET[value]}")
    if value not in TEMPLATES:
        raise UserError(f"{key}: {value} is not a Gemma template (expected one of: {', '.join(TEMPLATES)}); "
                        "gemmaforge trains Gemma checkpoints and renders each family's own chat format")
    return "checked against the model's family (its official chat format is rendered)"


def _precision(name: str) -> Convert:
    def convert(value: Any, key: str, t: Translation) -> str:
        if value:
            t.set("train.precision", name, key)
            return f"train.precision: {name}"
        return "off"
    return convert


def _quantization_bit(value: Any, key: str, t: Translation) -> str:
    if value is None:
        return "off"
    if value != 4:
        raise UserError(f"{key}: {value!r}: gemmaforge quantizes the base for QLoRA in 4 bits only "
                        "(bitsandbytes NF4 with double quantization)")
    t.set("model.load_in_4bit", True, key)
    return "model.load_in_4bit: true (QLoRA)"


def _report_to(value: Any, key: str, t: Translation) -> str:
    wanted = [value] if isinstance(value, str) else list(value or [])
    kept = "tensorboard" if {"tensorboard", "all"} & set(wanted) else "none"
    dropped = [w for w in wanted if w not in ("none", "tensorboard", "all")]
    if dropped:
        t.notes.append(f"report_to: {', '.join(dropped)} not supported: metrics go to RUN_DIR/metrics.jsonl, "
                       "loss.png and, with tensorboard, RUN_DIR/tensorboard")
    t.set("train.report_to", kept, key)
    return f"train.report_to: {kept}"


def _eval_strategy(value: Any, key: str, t: Translation) -> Any:
    return value.lower() if isinstance(value, str) else value


def _metric(value: Any, key: str, t: Translation) -> Any:
    return {"eval_loss": "eval_loss", "loss": "loss"}.get(value, value)


def _resume(value: Any, key: str, t: Translation) -> str:
    if value in (None, False):
        return "off"
    run = Path(str(t.raw.get("output_dir", "")))
    if value is True or (isinstance(value, str) and Path(value).parent in (run, run / "checkpoints")):
        return "the run's last complete checkpoint, whichever step (gemmaforge train resumes by itself)"
    raise UserError(f"{key}: {value}: gemmaforge resumes from the last checkpoint in output_dir by itself; a "
                    "checkpoint of another directory cannot be resumed (copy it into output_dir, or leave the key out)")


def _deepspeed(value: Any, key: str, t: Translation) -> str:
    stage = _zero_stage(value)
    recipe = {0: "ddp.yaml", 3: "deepspeed_zero3.yaml"}.get(stage, "deepspeed_zero2.yaml")
    return (f"a launcher's choice in gemmaforge: `accelerate launch --config_file examples/distributed/{recipe} "
            f"-m gemmaforge train CONFIG` (ZeRO-{stage})")


def _zero_stage(value: Any) -> int:
    """The ZeRO stage of a DeepSpeed config (a file, its name, or the dict itself): 0, 3, or 2 for 1 and 2 (the
    ZeRO-2 recipe shards what ZeRO-1 shards and more) and when it does not say."""
    config = value
    if isinstance(value, str):
        try:
            config = json.loads(Path(value).read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError):
            found = re.search(r"z(?:ero)?_?([0-3])", Path(value).name)
            return int(found.group(1)) if found else 2
    stage = (config or {}).get("zero_optimization", {}).get("stage", 2) if isinstance(config, dict) else 2
    return stage if stage in (0, 3) else 2


def _packing(value: Any, key: str, t: Translation) -> str:
    """LLaMA-Factory packs with packing or neat_packing (which implies packing); gemmaforge's packed rows always keep
    attention within each example, as neat_packing does."""
    if not value:
        return "off"
    t.set("train.packing", True, "packing / neat_packing")
    return "train.packing: true (attention kept within each example, as neat_packing)"


def _checkpointing(value: Any, key: str, t: Translation) -> str:
    """transformers' flag turns checkpointing on; off, LLaMA-Factory's own switch still decides."""
    if not value:
        return "off here; disable_gradient_checkpointing decides, as in LLaMA-Factory"
    t.set("train.gradient_checkpointing", True, key)
    return "train.gradient_checkpointing: true"


def _warmup_steps(value: Any, key: str, t: Translation) -> str:
    """transformers 5 reads a warmup_steps below 1 as a fraction of the steps."""
    target = "train.warmup_ratio" if 0 < float(value) < 1 else "train.warmup_steps"
    t.set(target, value if target.endswith("ratio") else int(value), key)
    return f"{target}: {value}"


def _lora_alpha(value: Any, key: str, t: Translation) -> str:
    if not value:  # LLaMA-Factory: lora_alpha or 2 x rank
        return "twice the rank (unset)"
    t.set("lora.lora_alpha", value, key)
    return f"lora.lora_alpha: {value}"


def _projector(value: Any, key: str, t: Translation) -> str:
    if not value:
        raise UserError(f"{key}: false means another thing here: LLaMA-Factory's LoRA leaves the projector out of "
                        "lora_target all (nothing more trains), while gemmaforge's lora.freeze_multi_modal_projector: "
                        "false trains it in full; remove the key, or set gemmaforge's in the converted config "
                        "(`gemmaforge config convert`)")
    return "the projector stays frozen (lora.freeze_multi_modal_projector: true)"


def _no_checkpointing(value: Any, key: str, t: Translation) -> str:
    t.set("train.gradient_checkpointing", not value, key)
    return f"train.gradient_checkpointing: {str(not value).lower()}"


def _dataset_dir(value: Any, key: str, t: Translation) -> str:
    t.set("data.path", value, key)
    return f"data.path: {value}"


# LLaMA-Factory key (flat, or inside training_args) -> (gemmaforge key, or "" when the converter sets it, converter)
TRANSLATED: dict[str, tuple[str, Convert]] = {
    "model_name_or_path": ("model.name_or_path", _same),
    "model_revision": ("model.revision", _same),
    "adapter_name_or_path": ("model.adapter", _one_adapter),
    "quantization_bit": ("", _quantization_bit),
    "template": ("", _template),
    "stage": ("train.method", _stage),
    "finetuning_type": ("", _finetuning_type),
    "do_train": ("", _do_train),
    "dataset": ("data.dataset", _names),
    "dataset_dir": ("", _dataset_dir),
    "max_samples": ("data.max_samples", _same),
    "val_size": ("data.val_size", _same),
    "default_system": ("data.system", _same),
    "train_on_prompt": ("data.train_on_prompt", _same),
    "mask_history": ("data.mask_history", _same),
    "cutoff_len": ("train.cutoff_len", _same),
    "packing": ("", _packing),
    "neat_packing": ("", _packing),
    "lora_rank": ("lora.r", _same),
    "lora_alpha": ("", _lora_alpha),
    "lora_dropout": ("lora.lora_dropout", _same),
    "lora_target": ("lora.target_modules", _target),
    "additional_target": ("lora.modules_to_save", _names),
    "use_rslora": ("lora.use_rslora", _same),
    "use_dora": ("lora.use_dora", _same),
    "freeze_vision_tower": ("lora.freeze_vision_tower", _same),
    "freeze_multi_modal_projector": ("", _projector),
    "output_dir": ("output_dir", _same),
    "num_train_epochs": ("train.num_train_epochs", _same),
    "max_steps": ("train.max_steps", _same),
    "per_device_train_batch_size": ("train.per_device_train_batch_size", _same),
    "per_device_eval_batch_size": ("eval.batch_size", _same),
    "gradient_accumulation_steps": ("train.gradient_accumulation_steps", _same),
    "learning_rate": ("train.learning_rate", _same),
    "pref_loss": ("train.pref_loss", _same),
    "pref_beta": ("train.pref_beta", _same),
    "pref_ftx": ("train.pref_ftx", _same),
    "simpo_gamma": ("train.simpo_gamma", _same),
    "kto_chosen_weight": ("train.kto_chosen_weight", _same),
    "kto_rejected_weight": ("train.kto_rejected_weight", _same),
    "lr_scheduler_type": ("train.lr_scheduler_type", _same),
    "warmup_ratio": ("train.warmup_ratio", _same),
    "warmup_steps": ("", _warmup_steps),
    "weight_decay": ("train.weight_decay", _same),
    "max_grad_norm": ("train.max_grad_norm", _same),
    "logging_steps": ("train.logging_steps", _same),
    "save_steps": ("train.save_steps", _same),
    "save_strategy": ("train.save_strategy", _eval_strategy),
    "save_total_limit": ("train.save_total_limit", _same),
    "eval_strategy": ("train.eval_strategy", _eval_strategy),
    "evaluation_strategy": ("train.eval_strategy", _eval_strategy),  # its name before transformers 4.46
    "eval_steps": ("train.eval_steps", _same),
    "load_best_model_at_end": ("train.load_best_model_at_end", _same),
    "metric_for_best_model": ("train.metric_for_best_model", _metric),
    "early_stopping_steps": ("train.early_stopping_patience", _same),
    "gradient_checkpointing": ("", _checkpointing),
    "disable_gradient_checkpointing": ("", _no_checkpointing),
    "bf16": ("", _precision("bf16")),
    "pure_bf16": ("", _precision("bf16")),
    "fp16": ("", _precision("fp16")),
    "dataloader_num_workers": ("train.dataloader_num_workers", _same),
    "report_to": ("", _report_to),
    "seed": ("train.seed", _same),
    "resume_from_checkpoint": ("", _resume),
    "deepspeed": ("", _deepspeed),
    # generating arguments: LLaMA-Factory's predictions, gemmaforge's eval answers
    "do_sample": ("eval.do_sample", _same),
    "temperature": ("eval.temperature", _same),
    "top_p": ("eval.top_p", _same),
    "max_new_tokens": ("eval.max_new_tokens", _same),
}

# PEFT LoraConfig names inside the walkthrough's `lora_config:` block
PEFT_KEYS = {"r": "lora.r", "lora_alpha": "lora.lora_alpha", "lora_dropout": "lora.lora_dropout",
             "target_modules": "lora.target_modules", "bias": "lora.bias", "use_rslora": "lora.use_rslora",
             "use_dora": "lora.use_dora", "modules_to_save": "lora.modules_to_save"}
PEFT_IGNORED = {"task_type": "always a causal language model", "inference_mode": "training sets it"}

_MACHINERY = "LLaMA-Factory's own data pipeline; gemmaforge prepares the data once into RUN_DIR/data"
IGNORED: dict[str, str] = {
    "trust_remote_code": "Gemma checkpoints need no remote code (transformers' own classes)",
    "overwrite_output_dir": "the run directory is reused: training resumes from its last complete checkpoint, "
                            "where LLaMA-Factory would start over (delete the folder to start over)",
    "overwrite_cache": _MACHINERY,
    "preprocessing_num_workers": _MACHINERY,
    "preprocessing_batch_size": _MACHINERY,
    "tokenized_path": _MACHINERY,
    "buffer_size": _MACHINERY,
    "data_shared_file_system": "nodes check whether they share the run directory themselves",
    "ignore_pad_token_for_loss": "padding never carries loss",
    "plot_loss": "always on: RUN_DIR/loss.png",
    "ddp_timeout": "the launcher's (torchrun / accelerate) timeouts apply",
    "ddp_find_unused_parameters": "set by the distributed recipe",
    "save_only_model": "checkpoints always keep the optimizer state, so a run resumes exactly",
    "logging_dir": "logs go to the run directory",
    "run_name": "the run is named by output_dir",
    "do_eval": "eval_strategy decides evaluation during training; `gemmaforge run` evaluates after it",
    "flash_attn": "train.attention chooses the packed rows' kernel (auto: measured on a GPU)",
    "use_unsloth": "gemmaforge's own kernels: packed rows, chunked loss",
    "use_unsloth_gc": "gemmaforge's own kernels: packed rows, chunked loss",
    "enable_liger_kernel": "gemmaforge's own kernels: packed rows, chunked loss",
    "upcast_layernorm": "the precision policy decides (train.precision)",
    "upcast_lmhead_output": "the loss is computed in fp32, chunk by chunk of supervised positions",
    "tf32": "the precision policy decides (train.precision)",
    "low_cpu_mem_usage": "transformers' loading default",
    "use_fast_tokenizer": "the checkpoint's tokenizer.json is used",
    "cache_dir": "models come from the Hugging Face cache as transformers puts them",
    "hf_hub_token": "log in with `hf auth login` (HF_TOKEN)",
    "image_max_pixels": "each picture goes to the checkpoint's own image processor at its own size (LLaMA-Factory "
                        "first shrinks pictures above image_max_pixels, 768x768 by default)",
    "image_min_pixels": "each picture goes to the checkpoint's own image processor at its own size",
    "video_max_pixels": "video data is refused at prepare time",
    "video_min_pixels": "video data is refused at prepare time",
    "video_fps": "video data is refused at prepare time",
    "video_maxlen": "video data is refused at prepare time",
    "compute_accuracy": "eval reports loss, perplexity and the suite's scores",
    "include_effective_tokens_per_second": "the manifest records supervised tokens per second",
    "include_num_input_tokens_seen": "the manifest records supervised tokens per second",
    "print_param_status": "a debugging print of LLaMA-Factory's",
    "ray_num_workers": "several GPUs: the recipes in examples/distributed (accelerate or torchrun)",
    "dataloader_pin_memory": "set by the trainer",
    "remove_unused_columns": "the prepared rows hold only what training reads",
    "predict_with_generate": "eval generates answers for its cases",
    "infer_backend": "serve and eval choose their engine (eval.engine)",
    "model_max_length": "train.cutoff_len bounds the rows",
    "create_new_adapter": "one adapter per run",
}
_EVAL_DECODING = "eval decodes greedily, or samples with temperature and top_p"
_OFF = "applies to {}, which is refused when on"
IGNORED.update({
    "use_reentrant_gc": "gemmaforge chooses how checkpointed layers recompute",
    "gradient_checkpointing_kwargs": "gemmaforge chooses how checkpointed layers recompute",
    "offload_folder": "nothing is offloaded to disk",
    "use_kv_cache": "generation always uses the KV cache",
    "use_v1_kernels": "gemmaforge's own kernels: packed rows, chunked loss",
    "infer_dtype": "serve and eval choose their dtype",
    "ms_hub_token": "models come from the Hugging Face hub or a local folder",
    "om_hub_token": "models come from the Hugging Face hub or a local folder",
    "init_special_tokens": "no tokens are added",
    "quantization_device_map": "QLoRA loads the base on this rank's GPU",
    "use_audio_in_video": "video data is refused at prepare time",
    "audio_sampling_rate": "clips are resampled to the rate of the model's feature extractor (16 kHz for Gemma 4)",
    "eval_num_beams": _EVAL_DECODING,
    "top_k": _EVAL_DECODING, "num_beams": _EVAL_DECODING, "repetition_penalty": _EVAL_DECODING,
    "length_penalty": _EVAL_DECODING, "max_length": "eval.max_new_tokens bounds the answers",
    "skip_special_tokens": "answers are decoded without special tokens",
    "loraplus_lr_embedding": _OFF.format("loraplus_lr_ratio"),
    "pissa_iter": _OFF.format("pissa_init"),
    "freeze_trainable_layers": _OFF.format("finetuning_type: freeze"),
    "freeze_trainable_modules": _OFF.format("finetuning_type: freeze"),
    "freeze_extra_modules": _OFF.format("finetuning_type: freeze"),
    "module_dropout": _OFF.format("finetuning_type: oft"),
    "asft_alpha": _OFF.format("use_asft_loss"), "eaft_alpha": _OFF.format("use_eaft_loss"),
    "megatron_bridge_args": _OFF.format("use_megatron_bridge"),
    "hyper_parallel_args": _OFF.format("use_hyper_parallel"),
    "hyper_parallel_cp_size": _OFF.format("use_hyper_parallel"),
    "reward_model": _OFF.format("stage: ppo"), "reward_model_adapters": _OFF.format("stage: ppo"),
    "reward_model_quantization_bit": _OFF.format("stage: ppo"), "reward_model_type": _OFF.format("stage: ppo"),
    "master_addr": "several machines: examples/distributed/multinode.sh (torchrun)",
    "master_port": "several machines: examples/distributed/multinode.sh (torchrun)",
    "ray_init_kwargs": "several GPUs: the recipes in examples/distributed (accelerate or torchrun)",
    "enable_torch_profiler": "no torch profiler in gemmaforge",
    "profile_modules": "no torch profiler in gemmaforge",
    "fp8_backend": _OFF.format("fp8"), "fp8_enable_fsdp_float8_all_gather": _OFF.format("fp8"),
    "kt_config": _OFF.format("use_kt"),
    "fsdp_transformer_layer_cls_to_wrap": "the fsdp2 recipe wraps the model's own decoder layers",
    "use_cpu": "gemmaforge trains on the GPU when there is one, else the CPU",
    "debug": "transformers' debugging switches",
    "logging_strategy": "train.logging_steps",
    "logging_first_step": "train.logging_steps",
    "log_level": "gemmaforge prints its own progress",
    "disable_tqdm": "gemmaforge prints its own progress",
    "save_safetensors": "adapters and checkpoints are always safetensors",
    "save_on_each_node": "nodes check whether they share the run directory themselves",
    "dataloader_persistent_workers": "set by the trainer",
    "dataloader_prefetch_factor": "set by the trainer",
    "eval_accumulation_steps": "eval computes the loss alone, batch by batch",
    "prediction_loss_only": "eval computes the loss alone, batch by batch",
    "bf16_full_eval": "the precision policy decides (train.precision)",
    "fp16_full_eval": "the precision policy decides (train.precision)",
    "auto_find_batch_size": "the memory plan says before training what fits (gemmaforge plan)",
    "local_rank": "set by the launcher",
    "ddp_backend": "set by the launcher (nccl, or gloo on the CPU)",
    "use_liger_kernel": "gemmaforge's own kernels: packed rows, chunked loss",
})
IGNORED_PREFIXES = {"vllm_": "vLLM settings: `gemmaforge export vllm` writes the serve command",
                    "sglang_": "SGLang is not a gemmaforge engine",
                    "swanlab_": "SwanLab is not supported (use_swanlab: false)",
                    "hub_": "nothing is pushed to a hub", "profiler_": "no torch profiler in gemmaforge",
                    "export_": "export keys are read by `gemmaforge merge EXPORT.yaml`",
                    "kt_": _OFF.format("use_kt"), "oft_": _OFF.format("finetuning_type: oft"),
                    "galore_": _OFF.format("use_galore"), "apollo_": _OFF.format("use_apollo"),
                    "badam_": _OFF.format("use_badam"),
                    "pref_": _OFF.format("stage: dpo/kto/rm"), "dpo_": _OFF.format("stage: dpo"),
                    "kto_": _OFF.format("stage: kto"), "simpo_": _OFF.format("stage: dpo"),
                    "ppo_": _OFF.format("stage: ppo")}

# keys that change what is trained: allowed at LLaMA-Factory's default only (set otherwise: exit 2)
REFUSED: dict[str, tuple[Any, str]] = {
    "dpo_label_smoothing": (0.0, "cDPO's label smoothing is not implemented: DPO trains on the labels as given"),
    "pref_bco_weight": (0.0, "the BCO term is not implemented"),
    "ld_alpha": (None, "LD-DPO's length weighting is not implemented"),
    "ref_model": (None, "the reference is the base model: this run's adapter disabled, no second copy"),
    "ref_model_adapters": (None, "the reference is the base model: this run's adapter disabled"),
    "ref_model_quantization_bit": (None, "the reference shares the trained model's weights"),
    "eval_dataset": (None, "evaluate on a split (val_size) or a file (gemmaforge data.eval_path)"),
    "enable_thinking": (True, "thinking in the data trains as written; LLaMA-Factory's false removes it"),
    "image_do_pan_and_scan": (False, "pan-and-scan crops are off, as Gemma3Processor sets them"),
    "media_dir": ("dataset_dir", "pictures are found relative to dataset_dir"),
    "mix_strategy": ("concat", "datasets are concatenated"),
    "interleave_probs": (None, "datasets are concatenated"),
    "streaming": (False, "datasets are prepared, not streamed"),
    "tool_format": (None, "tools are rendered in each family's own format"),
    "freeze_language_model": (False, "LoRA always trains the language model"),
    "loraplus_lr_ratio": (None, "LoRA+ learning rates are not supported"),
    "pissa_init": (False, "PiSSA initialisation is not supported"),
    "pissa_convert": (False, "PiSSA is not supported"),
    "use_llama_pro": (False, "LLaMA Pro block expansion is not supported"),
    "use_galore": (False, "GaLore is not supported"),
    "use_apollo": (False, "APOLLO is not supported"),
    "use_badam": (False, "BAdam is not supported"),
    "use_adam_mini": (False, "gemmaforge trains with AdamW"),
    "use_muon": (False, "gemmaforge trains with AdamW"),
    "use_dft_loss": (False, "gemmaforge trains with cross-entropy"),
    "use_asft_loss": (False, "gemmaforge trains with cross-entropy"),
    "use_eaft_loss": (False, "gemmaforge trains with cross-entropy"),
    "use_swanlab": (False, "SwanLab is not supported"),
    "use_kt": (False, "KTransformers is not supported"),
    "use_mca": (False, "Megatron-Core is not supported"),
    "use_megatron_bridge": (False, "Megatron is not supported"),
    "use_hyper_parallel": (False, "hyper-parallel training is not supported"),
    "disable_shuffling": (False, "training rows are shuffled by the seed"),
    "rope_scaling": (None, "the checkpoint's own RoPE is used"),
    "shift_attn": (False, "shifted sparse attention is not supported"),
    "mixture_of_depths": (None, "mixture of depths is not supported"),
    "resize_vocab": (False, "the vocabulary is the checkpoint's"),
    "add_tokens": (None, "the vocabulary is the checkpoint's"),
    "add_special_tokens": (None, "the vocabulary is the checkpoint's"),
    "new_special_tokens_config": (None, "the vocabulary is the checkpoint's"),
    "train_from_scratch": (False, "LoRA starts from the checkpoint"),
    "quantization_method": ("bnb", "QLoRA quantizes with bitsandbytes"),
    "quantization_type": ("nf4", "QLoRA quantizes to NF4"),
    "double_quantization": (True, "QLoRA double-quantizes"),
    "optim": (("adamw_torch", "adamw_torch_fused"), "gemmaforge trains with torch's AdamW"),
    "lr_scheduler_kwargs": (None, "schedulers take their standard arguments"),
    "label_smoothing_factor": (0.0, "gemmaforge trains with plain cross-entropy"),
    "neftune_noise_alpha": (None, "NEFTune is not supported"),
    "greater_is_better": (False, "eval_loss and loss are lower-is-better"),
    "do_predict": (False, "run `gemmaforge eval RUN_DIR` on the trained run"),
    "push_to_hub": (False, "nothing is pushed to a hub"),
    "fsdp": ("", "several GPUs: accelerate launch --config_file examples/distributed/fsdp2.yaml"),
    "fsdp_config": (None, "several GPUs: accelerate launch --config_file examples/distributed/fsdp2.yaml"),
    "torch_compile": (False, "gemmaforge does not compile the model"),
    "adapter_folder": (None, "training starts a new adapter"),
    "split_special_tokens": (False, "the tokenizer keeps its special tokens whole"),
    "moe_aux_loss_coef": (None, "the checkpoint's own router settings are kept"),
    "crop_to_patches": (False, "pictures go through the checkpoint's image processor as it is"),
    "eval_on_each_dataset": (False, "one validation split across the datasets"),
    "preserve_thinking": (False, "earlier turns are rendered as Gemma 4's official template renders them"),
    "fp8": (False, "fp8 training is not supported"),
    "adam_beta1": (0.9, "AdamW with transformers' default betas"),
    "adam_beta2": (0.999, "AdamW with transformers' default betas"),
    "adam_epsilon": (1e-8, "AdamW with transformers' default epsilon"),
    "group_by_length": (False, "rows are packed, or padded in data order"),
    "full_determinism": (False, "runs are seeded (train.seed), not bitwise deterministic"),
    "data_seed": ("seed", "train.seed orders the data"),
}

# REFUSED keys accepted when equal to another key's value: that key and its default
SAME_AS = {"seed": 42, "dataset_dir": "data"}

# keys that take LLaMA-Factory's (or transformers') default when left out, where gemmaforge's default differs in
# what it trains: (gemmaforge key, value, the key it stands for)
DEFAULTS: list[tuple[str, Any, str]] = [
    ("lora.lora_dropout", 0.0, "lora_dropout"),
    ("train.cutoff_len", 2048, "cutoff_len"),
    ("train.num_train_epochs", 3.0, "num_train_epochs"),
    ("train.per_device_train_batch_size", 8, "per_device_train_batch_size"),
    ("train.learning_rate", 5.0e-5, "learning_rate"),
    ("train.save_steps", 500, "save_steps"),
    ("train.eval_strategy", "no", "eval_strategy"),
    ("train.packing", False, "packing"),
    ("data.path", "data", "dataset_dir"),
]
# PEFT's LoraConfig defaults, for the walkthrough's lora_config block (peft 0.21: r 8, lora_alpha 8, dropout 0, and
# q_proj/v_proj for every Gemma model type)
PEFT_DEFAULTS = {"lora.r": 8, "lora.lora_alpha": 8, "lora.lora_dropout": 0.0,
                 "lora.target_modules": ["q_proj", "v_proj"]}
# gemmaforge's cleaning, off: LLaMA-Factory trains on the records as they are
NO_CLEANING = {"data.clean.strip_html": False, "data.clean.remove_control_chars": False, "data.clean.dedup": "none"}


def is_llamafactory(raw: dict[str, Any]) -> bool:
    """Written with LLaMA-Factory's keys (translate refuses one that mixes in gemmaforge sections)."""
    return bool(MARKERS & raw.keys())


def translate(raw: dict[str, Any], source: str) -> Translation:
    """A gemmaforge raw config from an LLaMA-Factory one. UserError naming the key when a key has no equivalent
    and changes what is trained, or is unknown."""
    mixed = sorted(k for k in SECTIONS if isinstance(raw.get(k), dict))
    if mixed:
        raise UserError(f"{source}: mixes LLaMA-Factory keys with gemmaforge sections ({', '.join(mixed)}): "
                        "write one or the other")
    t = Translation()
    raw = {key: _number(value) for key, value in raw.items()}
    flat = {key: value for key, value in raw.items() if key not in ("lora_config", "training_args")}
    where = {key: key for key in flat}
    blocks = {}
    for block in ("lora_config", "training_args"):
        if block in raw:
            if not isinstance(raw[block], dict):
                raise UserError(f"{source}: {block}: expected a mapping of keys")
            blocks[block] = raw[block]
    for key, value in blocks.get("training_args", {}).items():
        value = _number(value)
        if key in flat:
            raise UserError(f"{source}: training_args.{key} is also set at the top level: keep one")
        flat[key], where[key] = value, f"training_args.{key}"
    for key in [k for k, v in flat.items() if v is None and k in TRANSLATED]:  # `key: null` is LLaMA-Factory's default
        t.ignored.append((where[key], "null: LLaMA-Factory's default"))
        del flat[key]
    try:
        for key in sorted(flat, key=lambda k: k != "output_dir"):  # resume_from_checkpoint is read against it
            _translate_key(key, flat[key], t, where[key], flat)
        for key, value in blocks.get("lora_config", {}).items():
            _translate_peft_key(key, value, t)
    except UserError as e:
        raise UserError(f"{source}: {e}") from None
    _fill_defaults(t, flat, source, "lora_config" in blocks)
    _check_model(t, flat.get("template"), source)
    return t


def _at_default(value: Any, accepted: Any, flat: dict[str, Any]) -> bool:
    """`value` is LLaMA-Factory's default: unset, one of `accepted`, or (for a key's name as `accepted`, such as
    data_seed's "seed") that key's value."""
    if value in (None, "", [], {}):
        return True
    if isinstance(accepted, tuple):
        return value in accepted
    if accepted in SAME_AS:
        return value == flat.get(accepted, SAME_AS[accepted])
    return bool(value == accepted)


def _translate_key(key: str, value: Any, t: Translation, where: str, flat: dict[str, Any]) -> None:
    if key in TRANSLATED:
        target, convert = TRANSLATED[key]
        converted = convert(value, where, t)
        if target:
            t.set(target, converted, where)
            converted = f"{target}: {converted}"
        t.translated.append((where, converted))
    elif key in IGNORED:
        t.ignored.append((where, IGNORED[key]))
    elif any(key.startswith(p) for p in IGNORED_PREFIXES):
        t.ignored.append((where, next(r for p, r in IGNORED_PREFIXES.items() if key.startswith(p))))
    elif key in REFUSED:
        accepted, instead = REFUSED[key]
        if not _at_default(value, accepted, flat):
            raise UserError(f"{where}: {value!r} has no gemmaforge equivalent and changes what is trained "
                            f"({instead}); remove the key")
        t.ignored.append((where, f"at LLaMA-Factory's default ({instead})"))
    else:
        known = [*TRANSLATED, *IGNORED, *REFUSED]
        raise UserError(f"{where}: not an LLaMA-Factory SFT key gemmaforge knows{_close(key, known)}")


def _number(value: Any) -> Any:
    """`1e-4` as a number: PyYAML (YAML 1.1) reads it as text, LLaMA-Factory's OmegaConf as a float."""
    if isinstance(value, str) and EXPONENT_FLOAT.match(value):
        return float(value)
    return {k: _number(v) for k, v in value.items()} if isinstance(value, dict) else value


def _translate_peft_key(key: str, value: Any, t: Translation) -> None:
    """A key of the walkthrough's `lora_config:` block (PEFT's LoraConfig names)."""
    where = f"lora_config.{key}"
    if key in PEFT_IGNORED:
        t.ignored.append((where, PEFT_IGNORED[key]))
    elif key in PEFT_KEYS:
        t.set(PEFT_KEYS[key], value, where)
        t.translated.append((where, f"{PEFT_KEYS[key]}: {value}"))
    else:
        raise UserError(f"{where}: unknown LoRA key{_close(key, [*PEFT_KEYS, *PEFT_IGNORED])}")


def _fill_defaults(t: Translation, flat: dict[str, Any], source: str, peft_block: bool) -> None:
    if peft_block:
        for target, value in PEFT_DEFAULTS.items():
            if not t.has(target):
                t.set(target, value, f"lora_config (PEFT's default {target.split('.')[1]})")
                t.notes.append(f"lora_config.{target.split('.')[1]} not set: PEFT's default {value}")
    for target, value in NO_CLEANING.items():
        t.set(target, value, "LLaMA-Factory's data handling")
    t.notes.append("gemmaforge's cleaning is off (data.clean: strip_html, remove_control_chars, dedup), as "
                   "LLaMA-Factory trains on the records as they are")
    for target, value, key in DEFAULTS:
        if not t.has(target):
            t.set(target, value, f"{key} (LLaMA-Factory's default)")
            t.notes.append(f"{key} not set: LLaMA-Factory's default {value} ({target})")
    if not t.has("lora.target_modules"):
        t.set("lora.target_modules", "all-linear", "lora_target (LLaMA-Factory's default: all)")
        t.notes.append("lora_target not set: LLaMA-Factory's default, all linear layers of the language model")
    if not t.has("lora.lora_alpha"):  # LLaMA-Factory: lora_alpha defaults to twice the rank
        t.set("lora.lora_alpha", 2 * int(t.raw.get("lora", {}).get("r", 8)), "lora_alpha (2 x lora_rank)")
        t.notes.append("lora_alpha not set: twice the rank, as LLaMA-Factory does")
    if not t.has("train.gradient_checkpointing"):
        t.set("train.gradient_checkpointing", True, "disable_gradient_checkpointing (LLaMA-Factory's default)")
        t.notes.append("disable_gradient_checkpointing not set: activations are checkpointed, as LLaMA-Factory does "
                       "by default (train.gradient_checkpointing: true; `gemmaforge plan` says whether it is needed)")
    if "val_size" not in flat:
        t.notes.append("val_size not set: LLaMA-Factory would train on every record; gemmaforge holds out 10% to "
                       "evaluate the tuned model (set val_size to choose)")
    if t.raw["train"]["eval_strategy"] == "steps" and not t.has("train.eval_steps"):
        every = t.raw["train"].get("logging_steps", 500)  # transformers: eval_steps defaults to logging_steps
        t.set("train.eval_steps", every, "eval_steps (transformers' default: logging_steps)")
        t.notes.append(f"eval_steps not set: every logging_steps ({every}), as transformers does")
    if not t.raw["train"]["packing"]:  # LLaMA-Factory cuts what is too long when it does not pack
        t.set("data.clean.overlong", "truncate", "cutoff_len (LLaMA-Factory truncates without packing)")
        t.notes.append("examples over cutoff_len are cut, as LLaMA-Factory cuts them without packing (gemmaforge cuts "
                       "the last answer, keeping its end-of-turn); with packing they are dropped, as there")
    t.notes.append("the chat markers' embedding rows train too (lora.train_template_tokens, gemmaforge's default): "
                   "base Gemma checkpoints never trained them, and without them answers do not stop")
    if not ({"bf16", "fp16", "pure_bf16"} & flat.keys()):
        t.notes.append("bf16/fp16 not set: train.precision auto (bf16 where the device has it, else fp32)")
    if "output_dir" not in flat:
        raise UserError(f"{source}: output_dir: required (the run directory)")
    if "dataset" not in flat:
        raise UserError(f"{source}: dataset: required (dataset names in dataset_dir's dataset_info.json)")


def _check_model(t: Translation, template: Any, source: str) -> None:
    """A non-Gemma model is refused; the template must be its family's."""
    model = str(t.raw.get("model", {}).get("name_or_path", "gemma3-270m"))
    family = _family_of(model)
    if family is None and OTHER_MODELS.search(Path(model).name):
        raise UserError(f"{source}: model_name_or_path: {model} is not a Gemma checkpoint; gemmaforge trains Gemma "
                        "1, 2, 3 and 4")
    if template is not None and family is None:
        t.notes.append(f"template {template}: not checked, {model} does not name its family (the checkpoint's own "
                       "family's format is rendered in any case)")
    elif family is not None:
        check_template(template, family, model, source)


def _family_of(model: str) -> str | None:
    """The Gemma family of a local checkpoint (its config.json), the embedded model, or a hub id that names it."""
    if model == "gemma3-270m":
        return "gemma3"
    path = Path(model).expanduser()
    if path.is_dir() and (path / "config.json").is_file():
        return read_spec(path).family.name
    found = re.search(r"gemma-(\d)(?![\d.]*b)", Path(model).name, re.IGNORECASE)  # gemma-3-4b-it; not gemma-7b
    return {"1": "gemma", "2": "gemma2", "3": "gemma3", "4": "gemma4"}.get(found.group(1)) if found else None


def _close(key: str, known: list[str]) -> str:
    close = difflib.get_close_matches(key, known, n=1, cutoff=0.6)
    return f"; did you mean '{close[0]}'?" if close else ""


EXPORT_IGNORED = {
    "export_size": "the merged checkpoint keeps the base checkpoint's safetensors shards (merged in place, one "
                   "layer at a time)",
    "export_device": "merging runs on the CPU, one layer at a time",
    "export_quantization_nsamples": "GPTQ settings (export_quantization_bit is refused when set)",
    "export_quantization_maxlen": "GPTQ settings (export_quantization_bit is refused when set)",
}
EXPORT_REFUSED = {
    "export_legacy_format": (False, "the merged checkpoint is written as safetensors"),
    "export_quantization_bit": (None, "GPTQ is not supported: quantize the merged model to GGUF with `gemmaforge "
                                      "export gguf EXPORT_DIR --quant q4_k_m`"),
    "export_quantization_dataset": (None, "GPTQ is not supported"),
    "export_hub_model_id": (None, "nothing is pushed to a hub"),
    "quantization_bit": (None, "merging needs the full-precision base"),
}


@dataclass(frozen=True)
class MergeRequest:
    """An LLaMA-Factory export config (examples/merge_lora/*.yaml) as a gemmaforge merge."""

    run_dir: Path  # adapter_name_or_path: the run directory training wrote, or an adapter folder LLaMA-Factory wrote
    export_dir: Path
    model: str | None
    template: str | None
    report: str


def merge_request(raw: dict[str, Any], source: str) -> MergeRequest:
    """UserError naming the key for what a merge cannot do."""
    for key in ("adapter_name_or_path", "export_dir"):
        if not raw.get(key):
            raise UserError(f"{source}: {key}: required (the run or adapter folder to merge, and where the "
                            "merged checkpoint goes)")
    lines = []
    for key, value in raw.items():
        if key in ("model_name_or_path", "adapter_name_or_path", "export_dir", "template"):
            lines.append(f"#   {key}: {value}")
        elif key == "finetuning_type":
            _finetuning_type(value, key, Translation())
        elif key in EXPORT_IGNORED or (key in IGNORED and key not in EXPORT_REFUSED):
            lines.append(f"#   {key}: ignored ({EXPORT_IGNORED.get(key) or IGNORED[key]})")
        elif key in EXPORT_REFUSED:
            default, instead = EXPORT_REFUSED[key]
            if not _at_default(value, default, raw):
                raise UserError(f"{source}: {key}: {value!r} has no gemmaforge equivalent ({instead}); remove the key")
            lines.append(f"#   {key}: ignored at LLaMA-Factory's default ({instead})")
        else:
            known = [*EXPORT_IGNORED, *EXPORT_REFUSED, *IGNORED, "model_name_or_path", "adapter_name_or_path",
                     "export_dir", "finetuning_type"]
            raise UserError(f"{source}: {key}: not an LLaMA-Factory export key gemmaforge knows{_close(key, known)}")
    template = raw.get("template")
    if template is not None and template not in TEMPLATES:
        _template(template, "template", Translation())  # the same refusal as for training
    adapters = _names(raw["adapter_name_or_path"], "adapter_name_or_path", Translation())
    if len(adapters) != 1:
        raise UserError(f"{source}: adapter_name_or_path: one run directory to merge, got {len(adapters)}")
    return MergeRequest(Path(adapters[0]), Path(raw["export_dir"]), raw.get("model_name_or_path"), template,
                        "# an LLaMA-Factory export config, merged as:\n" + "\n".join(lines) + "\n")


def check_template(template: str | None, family: str, model: str, source: str) -> None:
    """The LLaMA-Factory template names the checkpoint's family."""
    if template is not None and family not in TEMPLATES.get(template, ()):
        expected = [name for name, families in TEMPLATES.items() if family in families]
        raise UserError(f"{source}: template: {template} does not fit {model}, a {family} checkpoint (its "
                        f"template: {' or '.join(expected)})")
