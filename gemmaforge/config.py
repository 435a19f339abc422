"""The run configuration: pydantic models per section, YAML loading, dotted overrides.

Field names follow PEFT `LoraConfig` and transformers `TrainingArguments`, so what users know
from those libraries transfers. Unknown keys are errors with a did-you-mean, never ignored.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, get_args

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from gemmaforge.compat.llamafactory import Translation, is_llamafactory, translate
from gemmaforge.console import console, escape
from gemmaforge.errors import UserError
from gemmaforge.units import parse_decimal_size


@dataclass(frozen=True)
class Split:
    """Start a new shard before a tensor would take the shard past `max_bytes`, or once it holds
    `max_tensors` tensors (0: no limit). A model that fits one shard stays one unsplit file."""

    max_bytes: int = 0
    max_tensors: int = 0

    @property
    def enabled(self) -> bool:
        return bool(self.max_bytes or self.max_tensors)


NO_SPLIT = Split()


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class ModelConfig(Section):
    name_or_path: str = Field(
        "gemma3-270m",
        description="'gemma3-270m' (embedded), a local HF directory, a local .gguf file, or a hub id",
    )
    revision: str | None = None
    adapter: str | None = Field(None, description="a LoRA adapter this run starts from, merged into the base first: "
                                "a run directory (its adapter/) or a PEFT adapter folder; an SFT run before dpo or "
                                "kto makes the SFT model the reference, and every later stage's base")
    load_in_4bit: bool = Field(False, description="QLoRA: 4-bit NF4 base through bitsandbytes (CUDA/ROCm GPU only)")


class CleanConfig(Section):
    """Each step is counted by reason in data/stats.json (dropped or changed examples)."""

    strip_html: bool = Field(True, description="remove HTML tags and decode entities (never inside `code`)")
    remove_control_chars: bool = Field(True, description="remove control, zero-width and invalid characters")
    unicode_normalization: Literal["NFC", "NFKC"] | None = Field(
        None, description="NFKC also turns full-width punctuation into ASCII: off unless asked"
    )
    drop_empty: bool = Field(False, description="drop examples with an empty turn; false: an empty answer is an error")
    min_answer_tokens: int = Field(1, ge=0, description="drop conversations whose answers have fewer tokens")
    overlong: Literal["drop", "truncate"] = Field(
        "drop", description="examples over train.cutoff_len tokens: drop them, or cut the last answer to fit"
    )
    dedup: Literal["none", "exact", "near"] = Field("exact", description="near: MinHash over character 5-grams")
    near_dup_threshold: float = Field(
        0.8, gt=0, le=1, description="estimated Jaccard of character 5-grams; one changed character in 80 gives 0.88"
    )


# The dataset formats data/formats.py reads (named here, below the data stage, for the config and the CLI)
Formatting = Literal["alpaca", "sharegpt", "openai"]
FORMATTINGS: tuple[Formatting, ...] = get_args(Formatting)
# The training methods recipe/ has (recipe/trainer.METHODS holds each one's parts)
Method = Literal["sft", "pt", "dpo", "kto", "rm"]
# Preference losses (train.pref_loss, LLaMA-Factory's names): sigmoid (DPO), hinge, ipo against a reference model;
# orpo and simpo need none
PrefLoss = Literal["sigmoid", "hinge", "ipo", "orpo", "simpo"]
METHODS: tuple[Method, ...] = get_args(Method)


class DataConfig(Section):
    path: str = Field(
        ..., description="dataset file (JSON, JSONL, CSV, Parquet), a folder of them, or a LLaMA-Factory data "
        "folder with dataset_info.json"
    )
    dataset: list[str] = Field(default_factory=list, description="LLaMA-Factory dataset name(s) in dataset_info.json")
    format: Literal["auto", Formatting] = "auto"
    columns: dict[str, str | None] | None = Field(None, description="column names, as LLaMA-Factory's `columns`")
    tags: dict[str, str] | None = Field(None, description="role tags, as LLaMA-Factory's `tags`")
    eval_path: str | None = Field(None, description="an explicit validation file instead of a split")
    max_samples: int | None = Field(
        None, ge=1, description="read at most this many records of each dataset, the first ones (LLaMA-Factory's "
        "max_samples): a quick run on a large dataset"
    )
    val_size: float | None = Field(
        None, ge=0, description="ratio in [0, 1) or a count >= 1 (default 0.1; 0 with eval_path)"
    )
    system: str | None = Field(None, description="system prompt added to every example without one")
    train_on_prompt: bool = Field(False, description="also compute loss on prompts (default: answers only)")
    mask_history: bool = Field(False, description="loss on the last answer of each conversation only")
    clean: CleanConfig = Field(default_factory=CleanConfig)

    @field_validator("dataset", mode="before")
    @classmethod
    def _split_names(cls, value: Any) -> Any:
        # `dataset: a,b` as in LLaMA-Factory configs
        return [n.strip() for n in value.split(",") if n.strip()] if isinstance(value, str) else value

    @model_validator(mode="after")
    def _one_validation_source(self) -> DataConfig:
        if self.eval_path is not None and self.val_size:
            raise ValueError("set data.eval_path or data.val_size, not both")
        return self

    @property
    def validation_size(self) -> float:
        return 0.0 if self.eval_path is not None else (0.1 if self.val_size is None else self.val_size)


class LoraSection(Section):
    r: int = Field(8, ge=1)
    lora_alpha: float = Field(16, gt=0)
    lora_dropout: float = Field(0.05, ge=0, lt=1)
    target_modules: list[str] | Literal["all-linear"] | None = Field(
        None, description="module names, 'all-linear', or None for the family's default (q/k/v/o projections)"
    )
    target_parameters: list[str] | None = Field(
        None, description="weights held as parameters, not modules (PEFT's target_parameters): a MoE model's "
        "experts, e.g. [experts.gate_up_proj, experts.down_proj]; needs lora_dropout 0 and no DoRA"
    )
    bias: Literal["none", "all", "lora_only"] = "none"
    use_rslora: bool = Field(False, description="scale by lora_alpha / sqrt(r) instead of lora_alpha / r")
    use_dora: bool = Field(False, description="weight-decomposed LoRA (slower steps; merge before GGUF)")
    modules_to_save: list[str] | None = Field(None, description="modules trained in full and saved with the adapter")
    freeze_vision_tower: bool = Field(
        True, description="keep the vision tower as it is (LLaMA-Factory's key); false: LoRA on its linear layers "
        "too, with the same r and alpha (pictures unlike the tower's pretraining: documents, screenshots, X-rays)",
    )
    freeze_multi_modal_projector: bool = Field(
        True, description="keep the projector from the vision tower into the text embeddings (LLaMA-Factory's key); "
        "false: train it in full, saved with the adapter",
    )
    freeze_audio_tower: bool = Field(
        True, description="keep the audio tower as it is (Gemma 4 E2B/E4B); false: LoRA on its linear layers too, "
        "with the same r and alpha (sound unlike the tower's pretraining: a machine's noises, a rare accent)",
    )
    freeze_audio_projector: bool = Field(
        True, description="keep the projector from the audio tower into the text embeddings; false: train it in "
        "full, saved with the adapter",
    )
    train_template_tokens: bool = Field(
        True,
        description="also train the embedding rows of the chat markers (<start_of_turn>, <end_of_turn>): base "
        "Gemma checkpoints never trained them, and through frozen tied embeddings a LoRA alone cannot "
        "learn to emit <end_of_turn>, so answers would never stop",
    )

    @model_validator(mode="after")
    def _parameter_targets(self) -> LoraSection:
        """PEFT's LoRA on a parameter (ParamWrapper) has no dropout and no DoRA form."""
        if self.target_parameters and self.lora_dropout:
            raise ValueError("target_parameters (expert LoRA) needs lora_dropout: 0 (PEFT cannot apply dropout there)")
        if self.target_parameters and self.use_dora:
            raise ValueError("target_parameters (expert LoRA) cannot be combined with use_dora")
        return self


SCHEDULERS = Literal[
    "linear", "cosine", "cosine_with_restarts", "cosine_with_min_lr", "polynomial", "constant",
    "constant_with_warmup", "inverse_sqrt", "warmup_stable_decay",
]


class TrainConfig(Section):
    method: Method = Field("sft", description="the training method: sft, supervised fine-tuning on conversations "
                           "(the loss on what the model writes); pt, continued pretraining on raw text (the loss on "
                           "every token, each text cut into rows of cutoff_len); dpo, preference tuning on pairs of "
                           "a chosen and a rejected answer (train.pref_loss); kto, on answers labelled desirable "
                           "or undesirable (or on pairs, each side one answer); rm, a reward model: a score head "
                           "on the last token, trained on the same pairs to rank the chosen answer above the "
                           "rejected one, merged into a sequence classifier")
    pref_loss: PrefLoss = Field("sigmoid", description="dpo: sigmoid (DPO), hinge, ipo (against the reference: the "
                                "model before this run's adapter), orpo or simpo (no reference)")
    pref_beta: float = Field(0.1, gt=0, description="dpo and kto: how far the tuned model may move from the "
                             "reference (orpo: the weight of the odds-ratio term)")
    pref_ftx: float = Field(0.0, ge=0, description="dpo and kto: weight of the supervised loss on the chosen "
                            "(desirable) answers added to the preference loss")
    simpo_gamma: float = Field(0.5, ge=0, description="dpo with pref_loss simpo: the target reward margin")
    kto_chosen_weight: float = Field(1.0, gt=0, description="kto: weight of the desirable answers' loss")
    kto_rejected_weight: float = Field(1.0, gt=0, description="kto: weight of the undesirable answers' loss")
    num_train_epochs: float = Field(1.0, gt=0)
    max_steps: int = Field(-1, description="-1: run num_train_epochs")
    per_device_train_batch_size: int = Field(4, ge=1)
    gradient_accumulation_steps: int = Field(1, ge=1)
    learning_rate: float = Field(2.0e-4, gt=0)
    lr_scheduler_type: SCHEDULERS = "linear"
    warmup_steps: int = Field(0, ge=0)
    warmup_ratio: float = Field(0.0, ge=0, lt=1, description="used when warmup_steps is 0")
    weight_decay: float = Field(0.0, ge=0)
    max_grad_norm: float = Field(1.0, gt=0)
    cutoff_len: int = Field(512, ge=8)
    packing: bool = Field(
        True, description="pack examples into rows of cutoff_len tokens; attention never crosses examples"
    )
    attention: Literal["auto", "segments", "flash", "flex"] = Field(
        "auto", description="attention kernel of packed rows: auto measures the available ones on a GPU (the CPU "
        "takes segments); segments: each example through SDPA; flash: FlashAttention 2 varlen; flex: flex_attention"
    )
    logits_chunk_size: int = Field(
        128, ge=16, description="supervised positions per output-layer chunk: full-vocabulary logits never "
        "exist for more than this many tokens at once"
    )
    logging_steps: int = Field(5, ge=1)
    eval_strategy: Literal["no", "steps", "epoch"] = Field("steps", description="'steps': every eval_steps")
    eval_steps: int | None = Field(None, ge=1, description="default: save_steps")
    save_strategy: Literal["no", "steps", "epoch"] = "steps"
    save_steps: int = Field(50, ge=1)
    save_total_limit: int | None = Field(2, ge=1)
    load_best_model_at_end: bool = Field(False, description="restore the checkpoint with the best metric")
    metric_for_best_model: Literal["eval_loss", "loss"] = Field(
        "eval_loss", description="the evaluation computes the loss alone ('loss' is the same metric)"
    )
    early_stopping_patience: int | None = Field(
        None, ge=1, description="stop after this many evaluations without improvement (needs load_best_model_at_end)"
    )
    precision: Literal["auto", "bf16", "fp16", "fp32"] = "auto"
    gradient_checkpointing: bool | None = Field(
        None, description="recompute activations in backward: less memory, ~30% slower; null (auto): on only when "
        "the memory plan says the run fits with it and not without"
    )
    check_memory: bool = Field(
        True, description="refuse, before the model loads, a config the memory planner says cannot fit the device "
        "(`gemmaforge plan`); false: train anyway"
    )
    dataloader_num_workers: int = Field(0, ge=0)
    report_to: Literal["none", "tensorboard"] = Field("none", description="tensorboard: logs under RUN_DIR/tensorboard")
    seed: int = 42

    @model_validator(mode="after")
    def _consistent(self) -> TrainConfig:
        if self.attention != "auto" and not self.packing:
            raise ValueError(f"attention={self.attention} is the kernel of packed rows: it needs packing: true")
        if self.early_stopping_patience and not self.load_best_model_at_end:
            raise ValueError("early_stopping_patience needs load_best_model_at_end: true "
                             "(the best checkpoint is restored)")
        if self.load_best_model_at_end:
            if self.eval_strategy == "no":
                raise ValueError("load_best_model_at_end needs evaluation: set eval_strategy to steps or epoch")
            if self.save_strategy != self.eval_strategy:
                raise ValueError("load_best_model_at_end needs save_strategy equal to eval_strategy")
            if self.eval_strategy == "steps" and self.save_steps % (self.eval_steps or self.save_steps):
                raise ValueError("load_best_model_at_end needs save_steps to be a multiple of eval_steps")
        return self


class OllamaConfig(Section):
    name: str | None = Field(None, description="model name for `ollama create`; default: the run name")
    system: str | None = Field(None, description="Modelfile SYSTEM; default: data.system, as in training")
    temperature: float = Field(0.7, ge=0)
    top_p: float = Field(0.95, gt=0, le=1)
    top_k: int = Field(64, ge=0)
    num_ctx: int = Field(4096, ge=1)


class EvalConfig(Section):
    """`gemmaforge eval` and the eval stage of `gemmaforge run`: base vs tuned on loss, a generation
    suite, and knowledge retention."""

    enabled: bool = Field(True, description="`gemmaforge run` evaluates after training; false skips it")
    suite: str | None = Field(None, description="YAML or JSONL suite of cases; default: a sample of val prompts")
    num_samples: int = Field(16, ge=1, description="val prompts in the default suite")
    engine: Literal["transformers", "llamacpp"] = Field(
        "transformers", description="llamacpp: the tuned answers come from the exported GGUF itself"
    )
    gguf: str | None = Field(
        None, description="with engine llamacpp: which gguf/model-<quant>.gguf (default: the first exported)"
    )
    max_new_tokens: int = Field(192, ge=1)
    batch_size: int = Field(32, ge=1, description="prompts generated together (left-padded, with KV cache)")
    do_sample: bool = Field(False, description="false: greedy; true: seeded sampling with temperature/top_p")
    temperature: float = Field(0.7, gt=0)
    top_p: float = Field(0.95, gt=0, le=1)
    seed: int = 42
    retention: bool = Field(True, description="the shipped general-knowledge probes and general-text perplexity")
    retention_tolerance: float = Field(
        0.1, ge=0, le=1, description="flag a regression when tuned probe accuracy is this much below base's"
    )
    perplexity_tolerance: float = Field(
        0.25, ge=0, description="flag a regression when tuned general-text perplexity exceeds base's by this fraction"
    )
    fail_under: float | None = Field(
        None, ge=0, le=1, description="exit 1 when the tuned suite pass rate is below this (for CI)"
    )

    @model_validator(mode="after")
    def _gguf_needs_llamacpp(self) -> EvalConfig:
        if self.gguf is not None and self.engine != "llamacpp":
            raise ValueError("eval.gguf picks the file the llamacpp engine answers from: set eval.engine to llamacpp "
                             "(--engine llamacpp), or leave out eval.gguf")
        return self


# f32 ... q5_0 are written in numpy; the K-quants by llama.cpp's quantizer (export/quantize.py)
GgufQuant = Literal["f32", "f16", "bf16", "q8_0", "q4_0", "q5_0", "q4_k_m", "q5_k_m", "q6_k"]
GGUF_QUANTS: tuple[str, ...] = get_args(GgufQuant)
_DEFAULT_GGUF: list[GgufQuant] = ["f16", "q8_0"]


class ExportConfig(Section):
    gguf: list[GgufQuant] = Field(default_factory=lambda: list(_DEFAULT_GGUF))
    split_max_size: str | None = Field(
        None, description="split each GGUF into shards of at most this size (2G, 500M) in llama.cpp's gguf-split "
        "layout; Ollama cannot import split files"
    )
    split_max_tensors: int = Field(0, ge=0, description="split each GGUF into shards of at most this many tensors")
    ollama: OllamaConfig = Field(default_factory=OllamaConfig)

    @field_validator("split_max_size")
    @classmethod
    def _size(cls, value: str | None) -> str | None:
        if value is not None:
            try:
                parse_decimal_size(value)
            except UserError as e:
                raise ValueError(str(e)) from None  # pydantic names the key
        return value

    def split(self) -> Split:
        size = parse_decimal_size(self.split_max_size) if self.split_max_size else 0
        return Split(size, self.split_max_tensors)


class RunConfig(Section):
    output_dir: str = Field(..., description="the run directory")
    model: ModelConfig = Field(default_factory=ModelConfig)
    data: DataConfig
    lora: LoraSection = Field(default_factory=LoraSection)
    train: TrainConfig = Field(default_factory=TrainConfig)
    eval: EvalConfig = Field(default_factory=EvalConfig)
    export: ExportConfig = Field(default_factory=ExportConfig)

    @property
    def deployed_system(self) -> str | None:
        """The system prompt the deployed model is given: the export's own, else the one it trained with. The
        Modelfile, `serve` and `eval` all use it."""
        return self.export.ollama.system or self.data.system


# ---------------------------------------------------------------------------- loading


def load_config(path: Path, overrides: list[str] | tuple[str, ...] = ()) -> RunConfig:
    """Read a YAML config (gemmaforge's, or an LLaMA-Factory SFT config, translated and its translation printed),
    apply `key.sub=value` overrides, validate. Data and suite paths stay as written but are resolved against the
    config file's folder when relative and not found from the cwd."""
    config, translation = read_config(path, overrides)
    if translation is not None:
        console.print(f"[bold]config[/]: {path} is an LLaMA-Factory config, read as gemmaforge's "
                      f"({len(translation.translated)} keys translated, {len(translation.ignored)} ignored; "
                      f"`gemmaforge config convert {path}` writes it out):")
        console.print(escape(translation.report()), end="")
    return config


def read_config(path: Path, overrides: list[str] | tuple[str, ...] = ()) -> tuple[RunConfig, Translation | None]:
    """load_config's config, and its translation when the file is an LLaMA-Factory config."""
    raw = read_yaml(path)
    translation = translate(raw, str(path)) if is_llamafactory(raw) else None
    if translation is not None:
        raw = translation.raw
    for item in overrides:
        apply_override(raw, item)
    config = validate_config(raw, source=str(path), origin=translation.origin if translation else None)
    for section, key in ((config.data, "path"), (config.data, "eval_path"), (config.eval, "suite")):
        value = getattr(section, key)
        if value and not Path(value).is_absolute() and not Path(value).exists() and (path.parent / value).exists():
            setattr(section, key, str(path.parent / value))
    return config, translation


def validate_config(raw: dict[str, Any], source: str, origin: dict[str, str] | None = None) -> RunConfig:
    """`origin`: for a translated config, the key each gemmaforge key came from, which errors name."""
    try:
        return RunConfig.model_validate(raw)
    except ValidationError as exc:
        raise UserError(_describe_validation_error(exc, source, origin or {})) from None


def dump_config(config: RunConfig) -> str:
    """Every default written out, in section order (the run.yaml text)."""
    return yaml.safe_dump(config.model_dump(mode="json"), sort_keys=False, allow_unicode=True)


def read_yaml(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise UserError(f"{path}: config file not found")
    try:
        raw = yaml.safe_load(path.read_text(encoding="utf-8"))
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" line {mark.line + 1}" if mark is not None else ""
        raise UserError(f"{path}{where}: not valid YAML ({getattr(exc, 'problem', exc)})") from None
    except UnicodeDecodeError as exc:
        raise UserError(f"{path}: not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise UserError(f"{path}: expected a mapping of sections (output_dir, model, data, ...)")
    return raw


def apply_override(raw: dict[str, Any], item: str) -> None:
    key, sep, text = item.partition("=")
    if not sep or not key:
        raise UserError(f"override '{item}': expected key.sub=value, e.g. train.learning_rate=1e-4")
    node = raw
    parts = key.split(".")
    for part in parts[:-1]:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise UserError(f"override '{item}': '{part}' is not a section")
        node = child
    node[parts[-1]] = yaml.safe_load(text) if text else ""


def _describe_validation_error(exc: ValidationError, source: str, origin: dict[str, str]) -> str:
    lines = [f"  {f'{origin[key]} ({key})' if key in origin else key}: {problem}"
             for key, problem in validation_problems(exc)]
    return "\n".join([f"{source}: invalid config", *lines])


def validation_problems(exc: ValidationError) -> list[tuple[str, str]]:
    """(dotted key, what is wrong with it) for each error, as the command line and the dashboard's form say it."""
    problems = []
    for err in exc.errors():
        loc = ".".join(str(p) for p in err["loc"])
        if err["type"] == "extra_forbidden":
            problems.append((loc, f"unknown key{_did_you_mean(err['loc'])}"))
        elif err["type"] == "missing":
            problems.append((loc, "required key is missing"))
        else:
            problems.append((loc, f"{err['msg']} (got {err.get('input')!r})"))
    return problems


def _did_you_mean(loc: tuple[Any, ...]) -> str:
    model: type[BaseModel] = RunConfig
    for part in loc[:-1]:
        field = model.model_fields.get(str(part))
        annotation = getattr(field, "annotation", None)
        if not (isinstance(annotation, type) and issubclass(annotation, BaseModel)):
            return ""
        model = annotation
    close = difflib.get_close_matches(str(loc[-1]), list(model.model_fields), n=1, cutoff=0.5)
    return f"; did you mean '{close[0]}'?" if close else f"; expected one of: {', '.join(model.model_fields)}"
