"""The merge stage: base + adapter -> merged/ (HF safetensors, tokenizer with its chat template)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from gemmaforge.models import ResolvedModel, load_causal_lm, load_tokenizer
from gemmaforge.runs import RunDir, atomic_dir
from gemmaforge.templates import hf_chat_template

# Keys that describe how a checkpoint was loaded, not the model; converters choke on some of them.
_LOAD_TIME_CONFIG_KEYS = ("quantization_config", "_name_or_path")


def merge(run: RunDir, base: ResolvedModel) -> dict[str, Any]:
    import torch
    from peft import PeftModel

    adapter = run.require(run.adapter_dir / "adapter_config.json", "train").parent
    model = load_causal_lm(base.path, base.family, torch.float32)
    model = PeftModel.from_pretrained(model, adapter).merge_and_unload()
    tokenizer = load_tokenizer(adapter)
    tokenizer.chat_template = hf_chat_template(base.family)
    # Generation stops at the end-of-turn marker as well as <eos>, as it does in Ollama.
    stop_ids = [tokenizer.eos_token_id] + tokenizer.convert_tokens_to_ids(list(base.family.stop))
    model.generation_config.eos_token_id = sorted(set(stop_ids))
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    with atomic_dir(run.merged_dir) as tmp:
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        _clean_config(tmp / "config.json")
    return {"path": str(run.merged_dir), "parameters": sum(p.numel() for p in model.parameters())}


def _clean_config(path: Path) -> None:
    config = json.loads(path.read_text(encoding="utf-8"))
    for key in _LOAD_TIME_CONFIG_KEYS:
        config.pop(key, None)
    path.write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
