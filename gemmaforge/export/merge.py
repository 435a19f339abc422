"""The merge stage: base + adapter -> merged/ (HF safetensors, tokenizer with its chat template).

The merged folder is the whole checkpoint: a multimodal base keeps its architecture, config, towers and
projectors (unchanged: LoRA only adapts the language model) and its processor files."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

from gemmaforge.model_spec import ModelSpec
from gemmaforge.models import ResolvedModel, load_causal_lm, load_tokenizer
from gemmaforge.runs import RunDir, atomic_dir
from gemmaforge.templates import hf_chat_template

# Shards of the size Hub checkpoints use (transformers 5 would write up to 50 GB files, which many
# tools and file systems handle badly); readers find them through model.safetensors.index.json.
MAX_SHARD = "5GB"
# What a multimodal checkpoint's processor reads beside the tokenizer (image and audio preprocessing): copied
# unchanged, so AutoProcessor loads the merged folder as it loads the base. Its chat template is not among
# them: the merged folder's is the training template, written with the tokenizer.
PROCESSOR_FILES = ("preprocessor_config.json", "processor_config.json", "video_preprocessor_config.json")
# Keys that describe how a checkpoint was loaded, not the model; converters choke on some of them.
_LOAD_TIME_CONFIG_KEYS = ("quantization_config", "_name_or_path")


def merge(run: RunDir, base: ResolvedModel) -> dict[str, Any]:
    from peft import PeftModel

    adapter = run.require(run.adapter_dir / "adapter_config.json", "train").parent
    # The base in its own dtype (never 4-bit: a QLoRA run does not merge into quantized weights); each adapted
    # weight alone is summed in fp32 and stored back in that dtype.
    model = PeftModel.from_pretrained(load_causal_lm(base.path, base.spec, base_dtype(base.spec)), adapter)
    model = merge_in_fp32(model)
    tokenizer = load_tokenizer(adapter)
    tokenizer.chat_template = hf_chat_template(base.family)
    # Generation stops at the end-of-turn marker as well as <eos>, as it does in Ollama.
    stop_ids = [tokenizer.eos_token_id] + tokenizer.convert_tokens_to_ids(list(base.family.stop))
    model.generation_config.eos_token_id = sorted(set(stop_ids))
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    with atomic_dir(run.merged_dir) as tmp:
        model.save_pretrained(tmp, max_shard_size=MAX_SHARD)
        tokenizer.save_pretrained(tmp)
        for name in PROCESSOR_FILES:
            if (base.path / name).is_file():
                shutil.copyfile(base.path / name, tmp / name)
        _clean_config(tmp / "config.json")
    return {"path": str(run.merged_dir), "dtype": str(model.dtype).removeprefix("torch."),
            "parameters": sum(p.numel() for p in model.parameters())}


def merge_in_fp32(model: Any) -> Any:
    """The PEFT model merged and unwrapped, each LoRA weight summed in fp32 and rounded once to its own dtype: the
    bytes a whole-model fp32 merge gives, with one weight in fp32 at a time instead of the whole model (4 bytes
    per parameter: 108 GB for a 27B model)."""
    import warnings

    import torch
    from peft.tuners.lora import LoraLayer

    for module in model.modules():
        if not isinstance(module, LoraLayer):
            continue
        weight = getattr(module.get_base_layer(), getattr(module, "parameter_name", "weight"))
        dtype = weight.dtype
        weight.data = weight.data.to(torch.float32)
        module.merge()
        weight.data = weight.data.to(dtype)
    with warnings.catch_warnings():  # the LoRA layers merged above are skipped, each with this warning
        warnings.filterwarnings("ignore", message="All adapters are already merged")
        return model.merge_and_unload()  # the other adapted parts (chat-marker rows, modules_to_save), unwrapped


def base_dtype(spec: ModelSpec) -> Any:
    """The torch dtype the base checkpoint is stored in."""
    import torch

    return {"bfloat16": torch.bfloat16, "float16": torch.float16}.get(spec.dtype, torch.float32)


def _clean_config(path: Path) -> None:
    config = json.loads(path.read_text(encoding="utf-8"))
    for key in _LOAD_TIME_CONFIG_KEYS:
        config.pop(key, None)
    path.write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
