"""The merge copies the base's safetensors files and rewrites only the adapted tensors (docs/export.md, merge): the
result equals PEFT's merge_and_unload on the whole model in fp32, rounded once to the stored dtype, for every checkpoint
kind and every kind of adapted module, and the base is never loaded whole."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from gemmaforge.errors import UserError
from gemmaforge.export.gguf import weight_files
from gemmaforge.export.merge_in_place import merge_into_copy
from tests.helpers import trained_adapter

CLASSES = {"gemma3-mm": "Gemma3ForConditionalGeneration", "gemma4-e2b": "Gemma4ForConditionalGeneration",
           "gemma4-moe": "Gemma4ForConditionalGeneration", "gemma4-dense": "Gemma4ForConditionalGeneration",
           "gemma4-unified": "Gemma4UnifiedForConditionalGeneration"}
TEXT_CLASSES = {"gemma": "GemmaForCausalLM", "gemma2": "Gemma2ForCausalLM", "gemma4": "Gemma4ForCausalLM"}
MARKER_ROWS = [105, 106]  # <start_of_turn>, <end_of_turn>: the rows the training template adds


def weight_files_of(checkpoint: Path) -> list[Path]:
    return sorted(set(weight_files(checkpoint).values()))


def in_bf16(checkpoint: Path, target: Path) -> Path:
    """`checkpoint` with its tensors stored in bf16 under the same keys (the Hub's own layout kept)."""
    shutil.copytree(checkpoint, target)
    for path in weight_files_of(target):
        save_file({k: v.to(torch.bfloat16) for k, v in load_file(path).items()}, path, metadata={"format": "pt"})
    config = json.loads((target / "config.json").read_text())
    config["dtype"] = "bfloat16"
    (target / "config.json").write_text(json.dumps(config))
    return target


def assert_merges_like_whole_fp32(base: Path, adapter: Path, model_class, out: Path) -> None:
    from peft import PeftModel

    out.mkdir()
    counts = merge_into_copy(base, adapter, model_class, torch.bfloat16, out)
    shutil.copyfile(base / "config.json", out / "config.json")
    whole = PeftModel.from_pretrained(model_class.from_pretrained(base, dtype=torch.float32), adapter)
    expected = whole.merge_and_unload().to(torch.bfloat16).state_dict()
    merged = model_class.from_pretrained(out, dtype=torch.bfloat16).state_dict()
    original = model_class.from_pretrained(base, dtype=torch.bfloat16).state_dict()
    assert merged.keys() == expected.keys()
    for name, tensor in expected.items():
        assert torch.equal(merged[name], tensor), name
    assert any(not torch.equal(merged[name], original[name]) for name in merged)
    # The files keep the base's keys, order and metadata; the tensors the adapter does not touch are unchanged.
    rewritten = 0
    for path in weight_files_of(base):
        with safe_open(path, "pt") as before, safe_open(out / path.name, "pt") as after:
            assert list(before.keys()) == list(after.keys()) and before.metadata() == after.metadata()
            rewritten += sum(not torch.equal(before.get_tensor(k), after.get_tensor(k)) for k in before.keys())
    assert rewritten == counts["tensors_merged"]


def test_text_model_lora_and_marker_rows(tiny_gemma3_dir: Path, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM, Gemma3ForCausalLM

    base = in_bf16(tiny_gemma3_dir, tmp_path / "base")
    adapter = trained_adapter(AutoModelForCausalLM.from_pretrained(base, dtype=torch.bfloat16), tmp_path / "adapter",
                              target_modules="all-linear", trainable_token_indices=MARKER_ROWS)
    assert_merges_like_whole_fp32(base, adapter, Gemma3ForCausalLM, tmp_path / "merged")
    embedding = "model.embed_tokens.weight"
    merged, original = load_file(tmp_path / "merged" / "model.safetensors"), load_file(base / "model.safetensors")
    assert not torch.equal(merged[embedding][105:107], original[embedding][105:107])  # the trained marker rows
    assert torch.equal(merged[embedding][:105], original[embedding][:105])


@pytest.mark.parametrize("family", sorted(TEXT_CLASSES))
def test_every_other_text_family(family: str, text_checkpoint_of, tmp_path: Path) -> None:
    """Gemma 1, 2 and 4 text-only checkpoints (Gemma 3's is above)."""
    import transformers

    model_class = getattr(transformers, TEXT_CLASSES[family])
    base = in_bf16(text_checkpoint_of(family), tmp_path / "base")
    adapter = trained_adapter(model_class.from_pretrained(base, dtype=torch.bfloat16), tmp_path / "adapter",
                              target_modules="all-linear", trainable_token_indices=MARKER_ROWS)
    assert_merges_like_whole_fp32(base, adapter, model_class, tmp_path / "merged")


@pytest.mark.parametrize("lora", [{"use_dora": True}, {"modules_to_save": ["model.norm"]}], ids=["dora", "full-module"])
def test_dora_and_modules_trained_in_full(lora: dict, tiny_gemma3_dir: Path, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM, Gemma3ForCausalLM

    base = in_bf16(tiny_gemma3_dir, tmp_path / "base")
    adapter = trained_adapter(AutoModelForCausalLM.from_pretrained(base, dtype=torch.bfloat16), tmp_path / "adapter",
                              target_modules=["q_proj", "v_proj"], **lora)
    assert_merges_like_whole_fp32(base, adapter, Gemma3ForCausalLM, tmp_path / "merged")


def test_sharded_base_keeps_its_shards_and_index(tiny_gemma3_dir: Path, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM, Gemma3ForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_gemma3_dir, dtype=torch.bfloat16)
    model.save_pretrained(tmp_path / "base", max_shard_size="20MB")
    files = weight_files_of(tmp_path / "base")
    assert len(files) > 1
    adapter = trained_adapter(model, tmp_path / "adapter", target_modules="all-linear",
                              trainable_token_indices=MARKER_ROWS)
    assert_merges_like_whole_fp32(tmp_path / "base", adapter, Gemma3ForCausalLM, tmp_path / "merged")
    index = "model.safetensors.index.json"
    assert (tmp_path / "merged" / index).read_text() == (tmp_path / "base" / index).read_text()


@pytest.mark.parametrize("kind", sorted(CLASSES))
def test_every_multimodal_kind_in_its_hub_layout(kind: str, checkpoint_of, tmp_path: Path) -> None:
    import transformers

    model_class = getattr(transformers, CLASSES[kind])
    base = in_bf16(checkpoint_of(kind), tmp_path / "base")
    lora: dict = {"target_modules": r".*language_model.*\.(q_proj|o_proj|down_proj)",
                  "trainable_token_indices": {"embed_tokens": MARKER_ROWS}}
    if kind == "gemma4-moe":  # LoRA on the fused expert tensors too (PEFT's target_parameters)
        lora["target_parameters"] = ["experts.gate_up_proj", "experts.down_proj"]
    adapter = trained_adapter(model_class.from_pretrained(base, dtype=torch.bfloat16), tmp_path / "adapter", **lora)
    assert_merges_like_whole_fp32(base, adapter, model_class, tmp_path / "merged")
    if kind == "gemma3-mm":  # the Hub's tower names, which transformers 5 would save without `vision_model.`
        with safe_open(tmp_path / "merged" / "model.safetensors", "pt") as f:
            assert any(k.startswith("vision_tower.vision_model.") for k in f.keys())


def test_a_folder_without_safetensors_is_named(tiny_gemma3_dir: Path, tmp_path: Path) -> None:
    from transformers import Gemma3ForCausalLM

    (tmp_path / "base").mkdir()
    (tmp_path / "base" / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(UserError, match=r"no weights in .*base: expected model\.safetensors"):
        merge_into_copy(tmp_path / "base", tmp_path / "adapter", Gemma3ForCausalLM, torch.bfloat16, tmp_path)


def test_a_prequantized_base_is_refused_before_anything_is_written(tiny_gemma3_dir: Path, tmp_path: Path) -> None:
    from gemmaforge.export.merge import merge
    from gemmaforge.model_spec import read_spec
    from gemmaforge.models import ResolvedModel
    from gemmaforge.runs import RunDir

    base = tmp_path / "bnb-4bit"
    shutil.copytree(tiny_gemma3_dir, base)
    config = json.loads((base / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "bitsandbytes", "load_in_4bit": True}
    (base / "config.json").write_text(json.dumps(config))
    run = RunDir(tmp_path / "run")
    run.adapter_dir.mkdir(parents=True)
    (run.adapter_dir / "adapter_config.json").write_text("{}")
    resolved = ResolvedModel("unsloth/gemma-3-4b-it-bnb-4bit", base, "local", read_spec(base))
    with pytest.raises(UserError, match=r"config\.json: the base is stored bitsandbytes; .*full-precision checkpoint"):
        merge(run, resolved)
    assert not run.merged_dir.exists()
