"""The merge keeps the base in its own dtype and sums one adapted weight at a time in fp32 (README "merge"): the
same bytes as merging the whole model in fp32 and rounding once, which took 4 bytes per parameter."""

from __future__ import annotations

from pathlib import Path

import torch

from gemmaforge.export.merge import merge_in_fp32


def bf16_base_and_adapter(tiny_gemma3_dir: Path, tmp_path: Path) -> tuple[Path, Path]:
    """The tiny model stored in bf16, and an adapter with non-zero LoRA weights and trained chat-marker rows."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(tiny_gemma3_dir, dtype=torch.bfloat16)
    base.save_pretrained(tmp_path / "base")
    torch.manual_seed(0)
    model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", init_lora_weights=False,
                                            trainable_token_indices=[105, 106]))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "trainable_tokens_delta" in name:
                param.add_(torch.randn_like(param) * 0.05)
    model.save_pretrained(tmp_path / "adapter")
    return tmp_path / "base", tmp_path / "adapter"


def test_one_weight_at_a_time_in_fp32_gives_the_whole_fp32_merge(tiny_gemma3_dir: Path, tmp_path: Path) -> None:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base, adapter = bf16_base_and_adapter(tiny_gemma3_dir, tmp_path)
    whole = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32), adapter)
    expected = whole.merge_and_unload().to(torch.bfloat16).state_dict()
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base, dtype=torch.bfloat16), adapter)
    merged = merge_in_fp32(model).state_dict()
    assert merged.keys() == expected.keys()
    for name, tensor in expected.items():
        assert merged[name].dtype == torch.bfloat16, name
        assert torch.equal(merged[name], tensor), name
    original = AutoModelForCausalLM.from_pretrained(base, dtype=torch.bfloat16).state_dict()
    adapted = [name for name in original if name.endswith("proj.weight")]
    assert adapted and all(not torch.equal(merged[name], original[name]) for name in adapted)  # LoRA was merged
    embedding = "model.embed_tokens.weight"
    assert not torch.equal(merged[embedding][105:107], original[embedding][105:107])  # the trained marker rows
    assert torch.equal(merged[embedding][:105], original[embedding][:105])
