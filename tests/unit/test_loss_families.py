"""Our supervised loss against transformers' own `labels=` loss on tiny Gemma 1, 2, 3 and 4 (Gemma 2 with its
attention and final soft-capping), packed rows against separate examples with the attention training uses, and a
few steps of `gemmaforge run` (train, merge, f16 GGUF in llama.cpp) on each family."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from gemmaforge.cli import main
from gemmaforge.families import FAMILIES
from gemmaforge.train import packed_attention
from gemmaforge.train.collate import RightPadCollator
from gemmaforge.train.loss import supervised_loss
from gemmaforge.train.packing import PackedCollator, pack_examples
from tests.helpers import assert_loss_equals_transformers, example, write_config

TEXT_FAMILIES = ["gemma", "gemma2", "gemma3", "gemma4"]
LINEAR = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def lora_model(path: Path, family: str, attention: str | None = None):
    """fp32 LoRA on every linear layer with random LoRA weights (lora_B starts at zero: every LoRA weight gets a
    gradient path), in the family's training attention unless `attention` is given."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                 attn_implementation=attention or FAMILIES[family].attn_implementation)
    with torch.no_grad():  # random tiny models give logits below 1, where a soft cap of 30 changes nothing
        model.model.norm.weight.fill_(100.0)
    model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=LINEAR)).train()
    torch.manual_seed(0)
    for p in model.parameters():
        if p.requires_grad:
            torch.nn.init.normal_(p, std=0.02)
    return model


@pytest.mark.parametrize("family", TEXT_FAMILIES)
@pytest.mark.parametrize("path", ["fused", "fused in chunks", "autograd in chunks"])
def test_supervised_loss_and_gradients_equal_transformers_labels_loss(family: str, path: str,
                                                                      text_checkpoint_of) -> None:
    """'autograd in chunks': a trained output layer, which the fused loss leaves to the chunked autograd loss."""
    model = lora_model(text_checkpoint_of(family), family)
    if path == "autograd in chunks":
        model.get_base_model().get_output_embeddings().weight.requires_grad_(True)
    softcap = getattr(model.get_base_model().config.get_text_config(), "final_logit_softcapping", None)
    assert bool(softcap) == (family in ("gemma2", "gemma4"))  # both soft-capping code paths are exercised
    if softcap:  # in the cap's nonlinear range: tanh(x / 30) * 30 above 15 needs x above 16.5
        with torch.no_grad():
            logits = model.get_base_model()(input_ids=torch.randint(3, 20000, (1, 24))).logits
        assert logits.abs().max() > softcap / 2
    assert_loss_equals_transformers(model, chunk_size=1024 if path == "fused" else 5)


@pytest.mark.parametrize("family", ["gemma2", "gemma4"])
def test_packed_rows_equal_separate_examples(family: str, text_checkpoint_of) -> None:
    """Packed as training packs them, through the per-example attention: Gemma 4's shared KV layers reuse the
    earlier layers' keys, Gemma 2 soft-caps its attention scores. Loss and LoRA gradients equal those of the padded
    batch in the family's own attention."""
    padded_model = lora_model(text_checkpoint_of(family), family)
    packed_model = lora_model(text_checkpoint_of(family), family, packed_attention.register())
    examples = [example(n, 4, i) for i, n in enumerate([21, 9, 14, 6, 30])]
    padded = RightPadCollator(0)(examples)
    packed = PackedCollator(0)(pack_examples(examples, cutoff_len=32))
    assert packed["input_ids"].shape[0] < len(examples)
    results = []
    for model, batch in ((padded_model, padded), (packed_model, packed)):
        loss = supervised_loss(model, batch, None)
        results.append((loss, torch.autograd.grad(loss, [p for p in model.parameters() if p.requires_grad])))
    (want, want_grads), (got, got_grads) = results
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    for g, w in zip(got_grads, want_grads):  # within 1e-5 in fp32 (Gemma 2's capped scores: 1.1e-6 apart at most)
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-5)
    # positions that do not restart let attention cross examples: the same rows then give another loss (the
    # tiny random models are near-uniform, so it differs by ~5e-4: several times the tolerance above)
    crossed = {**packed, "segments": None,
               "position_ids": torch.arange(packed["input_ids"].shape[1]).repeat(packed["input_ids"].shape[0], 1)}
    with torch.no_grad(), pytest.raises(AssertionError):
        torch.testing.assert_close(supervised_loss(packed_model, crossed, None), want.detach(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("family", ["gemma", "gemma2", "gemma4"])  # Gemma 3: every other training test
@pytest.mark.slow
def test_gemmaforge_run_trains_merges_and_exports_each_family(family: str, text_checkpoint_of, tmp_path: Path) -> None:
    """docs/checkpoint-kinds.md: every text kind goes through `gemmaforge run`: a few training steps, the merge and an
    f16 GGUF (eval off) that llama.cpp loads and that computes what the merged model computes (relative error of the
    logits measured: Gemma 1 3.6e-4, Gemma 2 9.3e-4, Gemma 4 8.6e-4)."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from tests.llama_cpp_checks import PROMPT, load, relative_error

    config = write_config(tmp_path, text_checkpoint_of(family), max_steps=3, save_steps=3, eval_strategy="no")
    assert main(["run", str(config), "eval.enabled=false", "export.gguf=[f16]"]) == 0
    run = tmp_path / "run"
    losses = [row["loss"] for row in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if "loss" in row]
    assert len(losses) == 3 and all(math.isfinite(loss) and loss > 0 for loss in losses)
    assert (run / "adapter" / "adapter_model.safetensors").is_file()
    stages = json.loads((run / "manifest.json").read_text())["stages"]
    assert stages["train"]["steps"] == 3 and stages["train"]["packing"] is True
    assert all(stages[name]["status"] == "done" for name in ("merge", "export_gguf", "export_ollama"))
    base, tuned = (load_file(folder / "model.safetensors") for folder in (text_checkpoint_of(family), run / "merged"))
    query = "model.layers.0.self_attn.q_proj.weight"
    assert base.keys() == tuned.keys()
    assert not torch.equal(base[query], tuned[query])  # the adapter is merged in
    merged = AutoModelForCausalLM.from_pretrained(run / "merged", dtype=torch.float32,
                                                  attn_implementation=FAMILIES[family].attn_implementation).eval()
    assert type(merged).__name__ == json.loads((text_checkpoint_of(family) / "config.json").read_text())[
        "architectures"][0]
    llm = load(run / "gguf" / "model-f16.gguf", logits_all=True)
    assert llm.metadata["general.architecture"] == family
    tokens = llm.tokenize(PROMPT.encode(), add_bos=True, special=True)
    with torch.no_grad():
        want = merged(torch.tensor([tokens])).logits[0].numpy()
    assert relative_error(llm, tokens, want) < 5e-3
