"""The merge stage: base + adapter -> merged/ (HF safetensors, tokenizer with its chat template).

The merged folder is the whole checkpoint: a multimodal base keeps its architecture, config, towers and
projectors (unchanged: LoRA only adapts the language model) and its processor files."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path
from typing import Any

from gemmaforge.console import console
from gemmaforge.data.sources import file_sha256
from gemmaforge.errors import UserError
from gemmaforge.export.merge_in_place import merge_into_copy
from gemmaforge.model_spec import ModelSpec, read_spec, reward_classifier
from gemmaforge.models import ResolvedModel, exclusive_lock, load_tokenizer
from gemmaforge.runs import RunDir, atomic_dir
from gemmaforge.train.reward_head import REWARD_HEAD

# What a multimodal checkpoint's processor reads beside the tokenizer (image and audio preprocessing): copied
# unchanged, so AutoProcessor loads the merged folder as it loads the base. Its chat template is not among
# them: the merged folder's is the training template, written with the tokenizer.
PROCESSOR_FILES = ("preprocessor_config.json", "processor_config.json", "video_preprocessor_config.json")
# Keys that describe how a checkpoint was loaded, not the model (a quantized base is refused before).
_LOAD_TIME_CONFIG_KEYS = ("_name_or_path",)


def merge(run: RunDir, base: ResolvedModel, target: Path | None = None) -> dict[str, Any]:
    """The run's adapter merged into a copy of the base, in RUN_DIR/merged or `target`."""
    adapter = run.require(run.adapter_dir / "adapter_config.json", "train").parent
    return merge_adapter(adapter, base, target or run.merged_dir)


def merge_adapter(adapter: Path, base: ResolvedModel, target: Path) -> dict[str, Any]:
    """A PEFT adapter folder (a run's adapter/, or one LLaMA-Factory trained) merged into a copy of the base."""
    import transformers

    config = json.loads((base.path / "config.json").read_text(encoding="utf-8"))
    if "quantization_config" in config:  # a QLoRA run merges into the full-precision weights, never 4-bit ones
        method = config["quantization_config"].get("quant_method", "quantized")
        raise UserError(f"{base.path / 'config.json'}: the base is stored {method}; merge writes full-precision "
                        "weights and needs the full-precision checkpoint it was quantized from (model: its hub id)")
    # the adapter's tokenizer when it saved one (a run's, LLaMA-Factory's output_dir), else the base's
    tokenizer = load_tokenizer(adapter if (adapter / "tokenizer_config.json").is_file() else base.path)
    tokenizer.chat_template = base.family.chat.jinja()
    classifier = reward_head_classifier(adapter, base.spec)
    with atomic_dir(target) as tmp:
        counts = merge_into_copy(base.path, adapter, getattr(transformers, classifier or base.spec.architecture.name),
                                 base_dtype(base.spec), tmp, num_labels=1 if classifier else None)
        config = {k: v for k, v in config.items() if k not in _LOAD_TIME_CONFIG_KEYS}
        if classifier:  # one score per sequence, read at its last token that is not padding
            config.update(architectures=[classifier], id2label={"0": "LABEL_0"}, label2id={"LABEL_0": 0})
            config.setdefault("pad_token_id", tokenizer.pad_token_id)
        _write_json(tmp / "config.json", config)
        _generation_config(base, tokenizer).save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        for name in PROCESSOR_FILES:
            if (base.path / name).is_file():
                shutil.copyfile(base.path / name, tmp / name)
    return {"path": str(target), "dtype": base.spec.dtype, **counts,
            **({"sequence_classifier": classifier} if classifier else {})}


def adapted_base(base: ResolvedModel, adapter: str, home: Path) -> ResolvedModel:
    """The base with `adapter` (model.adapter) merged in, cached in home/models by both contents: what the run's new
    adapter trains on top of, its reference (the model with the new adapter disabled) and every later stage's base.
    Merged first rather than stacked: one adapter to train, merge, export and serve, and the reference costs nothing."""
    folder = adapter_folder(Path(adapter).expanduser(), adapter)
    if reward_head_classifier(folder, base.spec):
        raise UserError(f"model.adapter '{adapter}': a reward model's adapter scores answers; a run starts from an "
                        "adapter that writes them (an SFT run)")
    key = hashlib.sha256(f"{base.revision}:{file_sha256(folder / 'adapter_model.safetensors')}".encode()).hexdigest()
    target = home / "models" / f"adapted-{key[:16]}"
    with exclusive_lock(target.with_name(target.name + ".lock")):
        if not (target / "config.json").is_file():
            console.print(f"[bold]gemmaforge[/]: merging {folder} into {base.reference} (model.adapter, once) ...")
            merge_adapter(folder, base, target)
    return ResolvedModel(str(target), target, f"{base.revision}+adapter:{key[:16]}", read_spec(target))


def adapter_folder(path: Path, given: str) -> Path:
    """A PEFT adapter folder, or a run directory's adapter/."""
    for folder in (path, path / "adapter"):
        if (folder / "adapter_config.json").is_file() and (folder / "adapter_model.safetensors").is_file():
            return folder
    raise UserError(f"model.adapter '{given}': expected a run directory that trained an adapter (RUN/adapter/) or a "
                    "PEFT adapter folder (adapter_config.json, adapter_model.safetensors)")


def reward_head_classifier(adapter: Path, spec: ModelSpec) -> str | None:
    """The sequence classifier an adapter with a reward model's score head merges into (None for any other)."""
    saved = json.loads((adapter / "adapter_config.json").read_text(encoding="utf-8")).get("modules_to_save") or []
    return reward_classifier(spec) if REWARD_HEAD in saved else None


def _generation_config(base: ResolvedModel, tokenizer: Any) -> Any:
    """The base's generation settings, stopping at the end-of-turn marker as well as <eos>, as Ollama does."""
    from transformers import AutoConfig, GenerationConfig

    if (base.path / "generation_config.json").is_file():
        generation = GenerationConfig.from_pretrained(base.path)
    else:
        generation = GenerationConfig.from_model_config(AutoConfig.from_pretrained(base.path))
    generation.eos_token_id = sorted(base.family.stop_ids(tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids))
    generation.pad_token_id = tokenizer.pad_token_id
    return generation


def base_dtype(spec: ModelSpec) -> Any:
    """The torch dtype the base checkpoint is stored in."""
    import torch

    return {"bfloat16": torch.bfloat16, "float16": torch.float16}.get(spec.dtype, torch.float32)


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")
