"""Text training on every multimodal checkpoint kind (tests/checkpoint_kinds.py): the one model spec, LoRA on the
language model only, our supervised loss equal to transformers' own, and the refusals."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from gemmaforge.cli import main
from gemmaforge.config import RunConfig
from gemmaforge.errors import UserError
from gemmaforge.model_spec import read_spec
from gemmaforge.models import load_causal_lm
from gemmaforge.train.loss import supervised_loss
from gemmaforge.train.wrapping import wrap_for_training
from tests.helpers import assert_loss_equals_transformers, write_config

MULTIMODAL = ("gemma3-mm", "gemma4-e2b", "gemma4-moe", "gemma4-dense", "gemma4-unified")


def run_config(tmp_path: Path, **lora: object) -> RunConfig:
    return RunConfig(output_dir=str(tmp_path / "run"), data={"path": "unused.json"},
                     lora={"r": 4, "lora_alpha": 8, "lora_dropout": 0.0, **lora}, train={"packing": False})


@pytest.mark.parametrize(("kind", "family", "towers", "experts", "rows", "text_type"), [
    ("gemma3-mm", "gemma3", ("vision",), 0, 262208, "gemma3_text"),  # 262144 + 64 rows (convert_gemma3_weights.py)
    ("gemma4-e2b", "gemma4", ("vision", "audio"), 0, 262144, "gemma4_text"),
    ("gemma4-moe", "gemma4", ("vision",), 4, 262144, "gemma4_text"),
    ("gemma4-dense", "gemma4", ("vision",), 0, 262144, "gemma4_text"),
    # encoder-free: "vision" and "audio" are its input projections (vision_config, audio_config), Gemma 4's decoder
    ("gemma4-unified", "gemma4", ("vision", "audio"), 0, 262144, "gemma4_unified_text"),
])
def test_the_spec_reads_each_kind_once(kind: str, family: str, towers: tuple, experts: int, rows: int, text_type: str,
                                       checkpoint_of) -> None:
    spec = read_spec(checkpoint_of(kind))
    assert (spec.family.name, spec.towers, spec.num_experts, spec.vocab_rows) == (family, towers, experts, rows)
    assert spec.multimodal and spec.language_prefix == "model.language_model"
    assert spec.text["model_type"] == text_type


@pytest.mark.parametrize("architecture", ["PaliGemmaForConditionalGeneration", "Gemma3nForConditionalGeneration",
                                          "T5GemmaForConditionalGeneration", "MistralForCausalLM"])
def test_unsupported_architectures_name_what_is_supported(architecture: str, checkpoint_of, tmp_path: Path) -> None:
    config = json.loads((checkpoint_of("gemma3-mm") / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "architectures": [architecture]}))
    with pytest.raises(UserError, match=rf"{architecture}.*supported.*Gemma4ForConditionalGeneration"):
        read_spec(tmp_path)


def lora_wrapped(checkpoint: Path, tmp_path: Path, **lora: object):
    spec = read_spec(checkpoint)
    model = load_causal_lm(checkpoint, spec)
    config = run_config(tmp_path, **lora)
    targets = config.lora.target_modules or list(spec.family.default_lora_targets)
    return wrap_for_training(model, config, spec.family, targets, None)


@pytest.mark.parametrize("kind", MULTIMODAL)
@pytest.mark.parametrize("targets", [None, "all-linear"])
def test_lora_goes_on_the_language_model_only(kind: str, targets: str | None, checkpoint_of, tmp_path: Path) -> None:
    model = lora_wrapped(checkpoint_of(kind), tmp_path, target_modules=targets)
    adapted = [name for name, module in model.named_modules() if hasattr(module, "lora_A")]
    assert adapted and all(".language_model." in name for name in adapted)
    assert not any(".router." in name for name in adapted)  # a MoE router is never trained
    suffixes = {name.rsplit(".", 1)[-1] for name in adapted}
    assert suffixes == ({"q_proj", "k_proj", "v_proj", "o_proj"} if targets is None
                        else suffixes | {"gate_proj", "up_proj", "down_proj"})
    trainable = [name for name, p in model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in name and ".language_model." in name for name in trainable)


@pytest.mark.parametrize("kind", MULTIMODAL)
def test_supervised_loss_and_gradients_equal_transformers_labels_loss(kind: str, checkpoint_of, tmp_path: Path) -> None:
    """transformers' own `labels=` loss on the whole multimodal class (its logits soft-capped by text_config's
    final_logit_softcapping where the kind has one) against ours, which skips unsupervised positions."""
    model = lora_wrapped(checkpoint_of(kind), tmp_path, target_modules="all-linear").train()
    torch.manual_seed(0)
    for p in model.parameters():
        if p.requires_grad:
            torch.nn.init.normal_(p, std=0.02)  # lora_B starts at zero: give every LoRA weight a gradient path
    base = model.get_base_model()
    softcap = base.config.get_text_config().final_logit_softcapping
    if softcap:  # tiny random logits stay far below a cap of 30: scale them into its nonlinear range
        with torch.no_grad():
            base.get_decoder().norm.weight.fill_(100.0)
            hidden = base.model(input_ids=torch.randint(3, 20000, (1, 24))).last_hidden_state
            logits = base.get_output_embeddings()(hidden)
        assert logits.abs().max() > softcap / 2
    assert_loss_equals_transformers(model)


def test_the_soft_capping_of_gemma4_lives_in_text_config(checkpoint_of) -> None:
    """The case the loss must not miss: Gemma 4 caps its logits, and only text_config says so."""
    config = json.loads((checkpoint_of("gemma4-dense") / "config.json").read_text())
    assert "final_logit_softcapping" not in config and config["text_config"]["final_logit_softcapping"] == 30.0


@pytest.mark.parametrize(("targets", "message"), [
    (["fc1"], r"fc1 matches no linear layer of the language model \(fc1 only outside"),
    (["qkv"], r"qkv matches no linear layer of the language model; targetable: down_proj, gate_proj, k_proj"),
])
def test_targets_that_match_nothing_in_the_language_model_are_refused(targets: list[str], message: str,
                                                                      checkpoint_of, tmp_path: Path) -> None:
    with pytest.raises(UserError, match=message):
        lora_wrapped(checkpoint_of("gemma3-mm"), tmp_path, target_modules=targets)


def test_expert_lora_adapts_the_experts_and_never_the_router(checkpoint_of, tmp_path: Path) -> None:
    """26B-A4B: attention LoRA by default, the experts' stacked weights through PEFT's parameter targets on request;
    the loss still equals transformers' own."""
    model = lora_wrapped(checkpoint_of("gemma4-moe"), tmp_path, lora_dropout=0.0,
                         target_parameters=["experts.gate_up_proj", "experts.down_proj"]).train()
    trainable = {name for name, p in model.named_parameters() if p.requires_grad}
    assert any(".experts." in name for name in trainable) and not any(".router." in name for name in trainable)
    assert any(".self_attn.q_proj.lora_A." in name for name in trainable)  # the default targets stay
    input_ids = torch.randint(3, 20000, (1, 16))
    labels = input_ids.clone()
    labels[:, :5] = -100
    for p in model.parameters():
        if p.requires_grad:
            torch.nn.init.normal_(p, std=0.02)
    base = model.get_base_model()
    want = base.__class__.forward(base, input_ids=input_ids, labels=labels).loss
    got = supervised_loss(model, {"input_ids": input_ids, "attention_mask": torch.ones_like(input_ids),
                                  "labels": labels}, None)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(("kind", "parameters", "message"), [
    ("gemma4-dense", ["experts.down_proj"], "matches no expert weight of the language model; targetable: none: "
                                            "this checkpoint has no experts"),
    ("gemma4-moe", ["router.per_expert_scale"], "is a MoE router's weight; the router is never trained"),
    ("gemma4-moe", ["experts.up_proj"], "targetable: experts.down_proj, experts.gate_up_proj"),
])
def test_bad_expert_targets_are_refused(kind: str, parameters: list[str], message: str, checkpoint_of,
                                        tmp_path: Path) -> None:
    with pytest.raises(UserError, match=message):
        lora_wrapped(checkpoint_of(kind), tmp_path, lora_dropout=0.0, target_parameters=parameters)


def test_expert_lora_needs_no_dropout(tmp_path: Path) -> None:
    from gemmaforge.config import load_config

    path = tmp_path / "c.yaml"
    path.write_text("output_dir: x\ndata: {path: d.json}\nlora: {target_parameters: [experts.down_proj]}\n")
    with pytest.raises(UserError, match="lora.*target_parameters \\(expert LoRA\\) needs lora_dropout: 0"):
        load_config(path)


def test_run_refuses_a_multimodal_checkpoint_without_processor_files_before_training(
        checkpoint_of, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The projector GGUF takes the image normalization from the processor files: a checkpoint folder without them
    is refused before the model loads, not after training and merging."""
    checkpoint = shutil.copytree(checkpoint_of("gemma3-mm"), tmp_path / "stripped",
                                 ignore=shutil.ignore_patterns("preprocessor_config.json", "processor_config.json"))
    assert main(["run", str(write_config(tmp_path, checkpoint))]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert f"{checkpoint} has neither preprocessor_config.json nor processor_config.json" in err
    assert not (tmp_path / "run" / "adapter").exists() and not (tmp_path / "run" / "checkpoints").exists()

