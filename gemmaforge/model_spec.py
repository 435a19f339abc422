"""What every stage needs to know about a checkpoint, read once from its config.json.

A Gemma checkpoint is either a text-only causal LM (`Gemma3ForCausalLM`, ...) or a multimodal one
(`Gemma3ForConditionalGeneration`, `Gemma4ForConditionalGeneration`, `Gemma4UnifiedForConditionalGeneration`)
whose language model sits beside vision and audio towers (Gemma 4 Unified: beside linear input projections).
Stages take a `ModelSpec` and never read config.json, unwrap `text_config` or compare `model_type` strings
themselves.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gemmaforge.errors import UserError
from gemmaforge.families import Family, family_for_model_type


@dataclass(frozen=True)
class Architecture:
    """One `architectures[0]` value that gemmaforge supports, and where its parts live in the module tree."""

    name: str
    kind: str  # the row of docs/checkpoint-kinds.md's table
    language_prefix: str  # module path of the decoder ("model" for text-only causal LMs)
    # module paths of the parts LoRA never touches: towers and the projectors into the text width
    tower_prefixes: tuple[str, ...] = ()
    # the image path, which training may adapt (lora.freeze_vision_tower / lora.freeze_multi_modal_projector)
    vision_tower: str | None = None
    vision_projector: str | None = None
    # transformers' sequence classifier over the same modules plus a `score` head: what a reward model (train.method
    # rm) is merged into; None where transformers has none (Gemma 4)
    sequence_classifier: str | None = None
    # the sound path (E2B, E4B: a checkpoint whose config has no audio_config has neither module), which training may
    # adapt (lora.freeze_audio_tower / lora.freeze_audio_projector)
    audio_tower: str | None = None
    audio_projector: str | None = None


ARCHITECTURES: dict[str, Architecture] = {
    a.name: a
    for a in (
        Architecture("GemmaForCausalLM", "Gemma 1 (2B, 7B)", "model",
                     sequence_classifier="GemmaForSequenceClassification"),
        Architecture("Gemma2ForCausalLM", "Gemma 2 (2B, 9B, 27B)", "model",
                     sequence_classifier="Gemma2ForSequenceClassification"),
        Architecture("Gemma3ForCausalLM", "Gemma 3 text (270M, 1B)", "model",
                     sequence_classifier="Gemma3TextForSequenceClassification"),
        Architecture("Gemma4ForCausalLM", "Gemma 4 text", "model"),
        # transformers' modeling_gemma3.py: Gemma3Model holds vision_tower, multi_modal_projector, language_model
        Architecture("Gemma3ForConditionalGeneration", "Gemma 3 multimodal (4B, 12B, 27B)", "model.language_model",
                     ("model.vision_tower", "model.multi_modal_projector"), "model.vision_tower",
                     "model.multi_modal_projector", "Gemma3ForSequenceClassification"),
        # modeling_gemma4.py: Gemma4Model holds vision_tower, audio_tower, embed_vision, embed_audio, language_model
        Architecture("Gemma4ForConditionalGeneration", "Gemma 4 (E2B, E4B, 26B-A4B, 31B)", "model.language_model",
                     ("model.vision_tower", "model.audio_tower", "model.embed_vision", "model.embed_audio"),
                     "model.vision_tower", "model.embed_vision", audio_tower="model.audio_tower",
                     audio_projector="model.embed_audio"),
        # modeling_gemma4_unified.py: Gemma4UnifiedModel holds language_model, embed_vision (the encoder-free vision
        # input: patch LayerNorms, patch Linear, position embedding, projection) and embed_audio (RMSNorm -> Linear
        # over raw waveform frames); no vision or audio tower. Its text model (gemma4_unified_text) is Gemma 4's.
        Architecture("Gemma4UnifiedForConditionalGeneration", "Gemma 4 12B Unified", "model.language_model",
                     ("model.embed_vision", "model.embed_audio")),
    )
}

# Gemma relatives that are not this toolkit's models, with what to use instead
UNSUPPORTED: dict[str, str] = {
    "PaliGemmaForConditionalGeneration": "PaliGemma (a different prompt format and training recipe)",
    "Gemma3nForConditionalGeneration": "Gemma 3n (MatFormer, AltUp and Laurel blocks)",
    "Gemma3nForCausalLM": "Gemma 3n (MatFormer, AltUp and Laurel blocks)",
    "RecurrentGemmaForCausalLM": "RecurrentGemma (Griffin recurrence, not a transformer decoder)",
    "T5GemmaForConditionalGeneration": "T5Gemma (an encoder-decoder)",
}


@dataclass(frozen=True)
class ModelSpec:
    """A checkpoint as the stages see it: which family and architecture, its text model's configuration,
    the towers it carries, its experts and vocabulary size."""

    family: Family
    architecture: Architecture
    text: dict[str, Any]  # the language model's config (text_config, or the whole config for text-only models)
    towers: tuple[str, ...] = ()  # "vision", "audio": the sub-configs the checkpoint carries
    token_ids: dict[str, int] = field(default_factory=dict)  # image/audio placeholder and boundary ids
    # each tower's config (vision_config, audio_config) with transformers' defaults filled in
    tower_configs: dict[str, dict[str, Any]] = field(default_factory=dict)
    dtype: str = "float32"  # what the weights are stored in: config `dtype` (`torch_dtype` before transformers 5)
    # bos/eos/unk/pad/mask ids as config.json's top level gives them (the tokenizer's names come first in GGUF)
    special_token_ids: dict[str, int] = field(default_factory=dict)

    @property
    def multimodal(self) -> bool:
        return bool(self.towers)

    @property
    def num_experts(self) -> int:
        """Experts per MoE layer (0: dense)."""
        return int(self.text.get("num_experts") or 0) if self.text.get("enable_moe_block") else 0

    @property
    def vocab_rows(self) -> int:
        """Rows of the input embedding (Gemma 3 multimodal: 262,208, above the tokenizer's 262,145)."""
        return int(self.text["vocab_size"])

    @property
    def language_prefix(self) -> str:
        return self.architecture.language_prefix

    @property
    def context(self) -> int:
        """The text model's context length in tokens (max_position_embeddings)."""
        return int(self.text["max_position_embeddings"])


_TOWER_CONFIGS = {"vision_config": "vision", "audio_config": "audio"}
SPECIAL_TOKEN_NAMES = ("bos", "eos", "unk", "pad", "mask")
_TOKEN_ID_KEYS = ("image_token_id", "image_token_index", "boi_token_id", "boi_token_index", "eoi_token_id",
                  "eoi_token_index", "audio_token_id", "boa_token_id", "eoa_token_id", "video_token_id")


def spec_from_config(config: dict[str, Any], source: str) -> ModelSpec:
    """The spec of a parsed config.json; `source` names the file in errors."""
    architectures = config.get("architectures") or []
    name = architectures[0] if architectures else None
    if name in UNSUPPORTED:
        raise UserError(f"{source}: {name} is {UNSUPPORTED[name]}, which gemmaforge does not train; "
                        f"supported architectures: {', '.join(ARCHITECTURES)}")
    if name is None:  # an old or hand-written config: a text-only causal LM of the family its model_type names
        family = family_for_model_type(config.get("model_type", ""))
        name = next(a for a in ARCHITECTURES if a.lower().startswith(family.name) and a.endswith("ForCausalLM"))
    if name not in ARCHITECTURES:
        raise UserError(f"{source}: architecture {name!r} is not a supported Gemma checkpoint; "
                        f"supported: {', '.join(ARCHITECTURES)}")
    architecture = ARCHITECTURES[name]
    raw_text = config.get("text_config") if architecture.tower_prefixes else config
    if not isinstance(raw_text, dict) or "model_type" not in raw_text:
        raise UserError(f"{source}: {name} needs a text_config with a model_type")
    family = family_for_model_type(raw_text["model_type"])
    parsed = _with_defaults(config, source)
    text = parsed.get_text_config().to_dict()
    tower_configs = {tower: getattr(parsed, key).to_dict() for key, tower in _TOWER_CONFIGS.items() if config.get(key)}
    token_ids = {key.replace("_index", "_id"): int(config[key]) for key in _TOKEN_ID_KEYS
                 if isinstance(config.get(key), int)}
    special = {name: config[f"{name}_token_id"] for name in SPECIAL_TOKEN_NAMES
               if isinstance(config.get(f"{name}_token_id"), int)}
    dtype = config.get("dtype") or config.get("torch_dtype") or "float32"
    return ModelSpec(family, architecture, text, tuple(tower_configs), token_ids, tower_configs, dtype, special)


def _with_defaults(config: dict[str, Any], source: str) -> Any:
    """The config parsed by transformers' own config classes, which fill in every default (sub-configs
    included): Hub configs leave defaults out (google/gemma-3-4b-it's text_config has no vocab_size or
    num_attention_heads)."""
    from transformers import AutoConfig

    try:
        parsed = AutoConfig.for_model(**config)
    except (ValueError, TypeError, KeyError) as exc:
        raise UserError(f"{source}: transformers cannot read this config ({exc})") from None
    return parsed


def read_spec(model_dir: Path) -> ModelSpec:
    """The spec of the checkpoint in `model_dir` (a Hugging Face folder with config.json)."""
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise UserError(f"no config.json in {model_dir}: expected a Hugging Face model folder")
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise UserError(f"{path} is not valid JSON: {exc}") from None
    return spec_from_config(config, str(path))


def text_weight_name(spec: ModelSpec, hf_name: str) -> str | None:
    """A checkpoint tensor's name in the text-only model (`model.layers.0...`, `lm_head.weight`), or None for a
    tower or projector tensor. Multimodal checkpoints name the language model `language_model.model.*`
    (Gemma 3 as published and as transformers saves it) or `model.language_model.*` (Gemma 4); dropping
    "language_model." gives the text-only name in both, as llama.cpp's converter does."""
    if not spec.multimodal:
        return hf_name
    if "language_model." in hf_name:
        return hf_name.replace("language_model.", "", 1)
    return hf_name if hf_name == "lm_head.weight" else None


def reward_classifier(spec: ModelSpec) -> str:
    """The sequence classifier a reward model (train.method: rm) of this checkpoint is merged into; UserError where
    transformers has none (the run could train, but what it trained could not be loaded as a scorer)."""
    architecture = spec.architecture
    if architecture.sequence_classifier is None:
        raise UserError(f"train.method: rm: {architecture.name} ({architecture.kind}) has no sequence classifier in "
                        "transformers, so its reward model could not be saved as one; a reward model trains on "
                        "Gemma 1, Gemma 2 and Gemma 3 (text and multimodal)")
    return architecture.sequence_classifier
