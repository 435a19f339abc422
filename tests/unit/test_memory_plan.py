"""The memory planner: its activation probe against a trace of whole tiny models, its parameter counts against
the real PEFT model, its plan against the measured tensor peak of training steps on every checkpoint kind, sizes,
the `plan` verb, and `train` refusing a config that cannot fit."""

from __future__ import annotations

import json
from contextlib import nullcontext
from pathlib import Path

import pytest
import torch

from gemmaforge.cli import main
from gemmaforge.config import RunConfig
from gemmaforge.errors import UserError
from gemmaforge.families import FAMILIES
from gemmaforge.models import resolve_model
from gemmaforge.recipe.trainer import check_memory
from gemmaforge.system.memory import resident_bytes
from gemmaforge.train import activations
from gemmaforge.train.memory_plan import Device, Planner, count_model
from gemmaforge.train.wrapping import lora_targets, wrap_for_training
from gemmaforge.units import parse_binary_size
from tests.helpers import run_config, write_config
from tests.tensor_memory import Fp32Matmuls, PeakTensorMemory

QUICKSTART = Path(__file__).parents[2] / "examples" / "quickstart.yaml"


def tiny_config(family: str):
    """Tiny configs with each family's layer kinds; Gemma 2 runs eager attention (its soft-capping), whose
    attention probabilities grow with the square of the row length."""
    from transformers import Gemma2Config, Gemma3TextConfig, Gemma4TextConfig

    sizes = {"vocab_size": 1024, "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
             "num_key_value_heads": 1, "head_dim": 16, "max_position_embeddings": 1024}
    if family == "gemma2":
        return Gemma2Config(**sizes, num_hidden_layers=4, query_pre_attn_scalar=16, sliding_window=64)
    if family == "gemma3":
        return Gemma3TextConfig(**sizes, num_hidden_layers=6, query_pre_attn_scalar=16, sliding_window=64)
    return Gemma4TextConfig(**sizes, num_hidden_layers=6, sliding_window=32, vocab_size_per_layer_input=1024,
                            hidden_size_per_layer_input=16, layer_types=["sliding_attention", "full_attention"] * 3)


def graph_saved_bytes(model, tokens: int) -> int:
    """What the autograd graph of one training forward holds, found by walking the graph from the loss and reading
    each node's saved tensors (distinct storages, parameters excepted): a count that shares nothing with the
    planner's own hook-based one (activations._saved_bytes)."""
    ids = torch.randint(1, activations.PROBE_VOCAB, (1, tokens))
    labels = ids.clone()
    labels[0, 0] = -100
    loss = model(input_ids=ids, labels=labels, position_ids=torch.arange(tokens)[None]).loss
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    storages: dict[int, int] = {}
    seen, stack = set(), [loss.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        saved = [getattr(node, name) for name in dir(node) if name.startswith("_saved_")]
        if hasattr(node, "saved_tensors"):  # a Python autograd Function's ctx.save_for_backward
            saved.append(node.saved_tensors)
        for value in saved:
            for tensor in value if isinstance(value, (tuple, list)) else (value,):
                if isinstance(tensor, torch.Tensor) and tensor.untyped_storage().data_ptr() not in params:
                    storages[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
        stack.extend(next_node for next_node, _ in node.next_functions)
    return sum(storages.values())


def traced_bytes(model_config, family, config: RunConfig, tokens: int, checkpointing: bool) -> float:
    """What autograd keeps in one training forward of the whole model (every layer, the real vocabulary)."""
    model = activations._probe_model(model_config, family, config, torch.float32, checkpointing)
    return sum(activations._saved_bytes(model, tokens).values())


@pytest.mark.parametrize("family", ["gemma2", "gemma3", "gemma4"])
@pytest.mark.parametrize("checkpointing", [False, True])
def test_the_probe_predicts_what_the_whole_model_keeps(family: str, checkpointing: bool) -> None:
    """The probe runs one layer per kind at 64 and 128 tokens; the whole model is traced at 200 tokens."""
    model_config = tiny_config(family)
    config = run_config(lora={"target_modules": "all-linear"})
    profile = activations.profile_activations(model_config, FAMILIES[family], config, torch.float32)
    assert set(profile.counts) == set(activations.layer_kinds(model_config))
    if family == "gemma2" and not checkpointing:
        assert all(cost.square > 0 for cost in profile.within.layers.values())  # eager attention's T x T probabilities
    predicted = profile.total(200, 200, checkpointing)
    assert predicted == pytest.approx(traced_bytes(model_config, FAMILIES[family], config, 200, checkpointing),
                                      rel=0.03)
    if not checkpointing:  # (a checkpointed graph holds hooks, not tensors, until backward recomputes them)
        model = activations._probe_model(model_config, FAMILIES[family], config, torch.float32, False)
        assert predicted == pytest.approx(graph_saved_bytes(model, 200), rel=0.03)


@pytest.mark.parametrize("family", ["gemma3", "gemma4"])
def test_a_probe_model_is_gone_once_it_is_traced(family: str) -> None:
    """The planner builds several probe models (each 4 GB at Gemma 4 31B's width); a trace that kept one alive
    (autograd's saved outputs holding their own graph, a cycle the garbage collector cannot see) stacked them
    until a 24 GiB host ran out of memory."""
    import gc
    import weakref

    model = activations._probe_model(tiny_config(family), FAMILIES[family], run_config(), torch.float32, False)
    activations._saved_bytes(model, 64)
    weights = [weakref.ref(p) for p in model.parameters()]
    del model
    gc.collect()
    assert [w for w in weights if w() is not None] == []


def test_checkpointing_keeps_a_small_share() -> None:
    profile = activations.profile_activations(tiny_config("gemma3"), FAMILIES["gemma3"], run_config(), torch.float32)
    assert profile.total(512, 512, True) < 0.25 * profile.total(512, 512, False)


@pytest.mark.parametrize("lora", [{}, {"r": 16, "target_modules": "all-linear", "train_template_tokens": False}])
def test_counts_match_the_real_peft_model(tiny_gemma3_dir: Path, tmp_path: Path, lora: dict) -> None:
    from transformers import AutoConfig, AutoModelForCausalLM

    base = resolve_model(str(tiny_gemma3_dir), tmp_path)
    config = run_config(lora=lora)
    counts = count_model(AutoConfig.from_pretrained(tiny_gemma3_dir), base, config, torch.float32)
    template_ids = [105, 106] if config.lora.train_template_tokens else None
    model = wrap_for_training(AutoModelForCausalLM.from_pretrained(tiny_gemma3_dir), config, base.family,
                              lora_targets(config, base), template_ids)
    params = list(model.named_parameters())
    assert counts.trainable_params == sum(p.numel() for _, p in params if p.requires_grad)
    assert counts.frozen_bytes == sum(p.numel() * 4 for _, p in params if not p.requires_grad)
    assert counts.vocab_size == 262144 and counts.layers == 2
    assert counts.checkpoint_bytes == (tiny_gemma3_dir / "model.safetensors").stat().st_size


GPU = Device("gpu", "a GPU", 2**40, 0)


@pytest.mark.parametrize("template_tokens", [False, True])
def test_the_trainable_part_is_16_bytes_per_lora_parameter(tiny_gemma3_dir: Path, tmp_path: Path,
                                                           template_tokens: bool) -> None:
    """docs/training.md: LoRA (and template-token) parameters with gradient and AdamW state, 16 bytes each. The
    parameters are counted here from the checkpoint's shapes: r x (in + out) for each of q, k, v, o in every layer, and
    one hidden-wide row for each of the two chat markers."""
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(tiny_gemma3_dir)
    hidden, q, kv = cfg.hidden_size, cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    r = 8
    lora = cfg.num_hidden_layers * r * ((hidden + q) + (hidden + kv) + (hidden + kv) + (q + hidden))
    trainable = lora + (2 * hidden if template_tokens else 0)
    config = run_config(lora={"r": r, "train_template_tokens": template_tokens})
    planner = Planner(config, resolve_model(str(tiny_gemma3_dir), tmp_path), "bf16", GPU)
    assert planner.parts(2, 64, False)["trainable"] == 16 * trainable


def test_a_4_bit_linear_weight_is_priced_at_0_52_bytes(tiny_gemma3_dir: Path, tmp_path: Path) -> None:
    """docs/training.md: NF4 (~0.52 bytes per parameter) for model.load_in_4bit: bitsandbytes' 4 bits per weight, an
    8-bit absmax per block of 64 and an fp32 constant per 256 absmax (double quantization). Only the decoder layers'
    linear weights are quantized; everything else stays in the training dtype (bf16 here)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.from_pretrained(tiny_gemma3_dir)
    with torch.device("meta"):
        linears = sum(m.weight.numel() for m in AutoModelForCausalLM.from_config(cfg).model.layers.modules()
                      if isinstance(m, torch.nn.Linear))
    base = resolve_model(str(tiny_gemma3_dir), tmp_path)
    full = count_model(cfg, base, run_config(), torch.bfloat16)
    nf4 = count_model(cfg, base, run_config(model={"load_in_4bit": True}), torch.bfloat16)
    price = (nf4.frozen_bytes - (full.frozen_bytes - 2 * linears)) / linears
    assert price == pytest.approx(0.5 + 1 / 64 + 4 / (64 * 256), abs=1e-3) and round(price, 2) == 0.52


@pytest.mark.slow  # 19 s on 2 busy cores
def test_fp16_activations_are_planned_as_fp32(text_checkpoint_of, tmp_path: Path) -> None:
    """docs/training.md: fp16 (Gemma 1/2 only) is planned as fp32 activations, an overestimate: on a tiny Gemma 2 the
    fp16 plan's activations (and the backward term drawn from them) equal the fp32 plan's, above the bf16 plan's."""
    base = resolve_model(str(text_checkpoint_of("gemma2")), tmp_path)
    config = run_config(train={"precision": "fp16"})
    fp16, fp32, bf16 = (Planner(config, base, precision, GPU).parts(2, 128, False)
                        for precision in ("fp16", "fp32", "bf16"))
    assert fp16["activations"] == fp32["activations"] > bf16["activations"]
    assert fp16["backward"] == fp32["backward"]


@pytest.mark.slow
def test_the_backward_term_is_what_the_largest_layer_keeps(text_checkpoint_of, tmp_path: Path) -> None:
    """docs/training.md (`gemmaforge plan`): backward is the largest layer's gradients while its backward runs, counted
    as what that layer keeps for backward (twice that with gradient checkpointing, which recomputes it first). Held
    against a trace of the wrapped tiny Gemma 4, whose full-attention layers (wider heads) keep the most; the first
    layer of a kind also keeps what its kind shares, which the plan counts elsewhere (measured 4.9% below the trace)."""
    from gemmaforge.models import load_tokenizer
    from gemmaforge.train.wrapping import build_peft_model

    base = resolve_model(str(text_checkpoint_of("gemma4")), tmp_path)
    config = run_config()
    planner = Planner(config, base, "fp32", GPU)
    model = build_peft_model(config, base, load_tokenizer(base.path), "fp32")
    for tokens in (128, 256):
        traced = activations._saved_bytes(model, tokens)
        layers = [kept for layer, kept in traced.items() if layer is not None]
        backward = planner.parts(1, tokens, False)["backward"]
        assert backward == pytest.approx(max(layers), rel=0.08), (backward, layers)
        assert planner.parts(1, tokens, True)["backward"] == pytest.approx(2 * backward, abs=1)


@pytest.mark.parametrize(("text", "expected"), [("24GiB", 24 * 2**30), ("24G", 24 * 2**30), ("24 GB", 24 * 2**30),
                                                ("16000MiB", 16000 * 2**20), ("0.5T", 2**39), ("1048576", 2**20)])
def test_parse_binary_size(text: str, expected: int) -> None:
    assert parse_binary_size(text) == expected


@pytest.mark.parametrize("text", ["abc", "24 GiBs", "-1G", "0", "", "1e9", "24", "0.5"])
def test_parse_memory_rejects(text: str) -> None:
    with pytest.raises(UserError, match=r"--gpu-memory .*expected a size with its unit, such as 24GiB"):
        parse_binary_size(text)


@pytest.fixture(scope="module")
def embedded_planner(embedded_model) -> Planner:
    """The embedded Gemma 3 270M planned for a 4 GiB GPU at batch 8 x 1024 (which cannot fit there)."""
    config = run_config(train={"per_device_train_batch_size": 8, "cutoff_len": 1024})
    return Planner(config, embedded_model, "bf16", Device("gpu", "a GPU", 4 * 2**30, 512 * 2**20))


def test_the_advice_is_priced_by_the_planner(embedded_planner: Planner) -> None:
    plan = embedded_planner.plan()
    assert not plan.fits and plan.peak_bytes == sum(plan.parts.values())
    batch, cutoff = plan.largest_batch, plan.largest_cutoff
    assert 1 <= batch < 8 and 8 <= cutoff < 1024
    assert embedded_planner.fits(batch, 1024, False) and not embedded_planner.fits(batch + 1, 1024, False)
    assert cutoff % 8 == 0 and embedded_planner.fits(8, cutoff, False) and \
        not embedded_planner.fits(8, cutoff + 8, False)
    assert any(f"per_device_train_batch_size={batch} " in hint for hint in plan.advice)
    assert any(f"cutoff_len={cutoff}" in hint for hint in plan.advice)
    checkpointed = embedded_planner.parts(8, 1024, True)
    assert any("gradient_checkpointing=true" in hint for hint in plan.advice) == embedded_planner.fits(8, 1024, True)
    assert checkpointed["activations"] < plan.parts["activations"] / 4
    assert any("load_in_4bit=true" in hint for hint in plan.advice)


@pytest.mark.slow
def test_four_bit_weights_are_priced_as_nf4(embedded_model) -> None:
    device = Device("gpu", "a GPU", 24 * 2**30, 512 * 2**20)
    full = Planner(run_config(), embedded_model, "bf16", device).counts
    nf4 = Planner(run_config(model={"load_in_4bit": True}), embedded_model, "bf16", device).counts
    assert nf4.trainable_params == full.trainable_params
    assert 0.4 * full.frozen_bytes < nf4.frozen_bytes < 0.8 * full.frozen_bytes  # the 168M-entry embedding stays bf16


@pytest.mark.slow
def test_plan_verb(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", str(QUICKSTART), "--gpu-memory", "24GiB", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["fits"] and result["device"]["capacity_bytes"] == 24 * 2**30
    assert result["peak_bytes"] == sum(result["parts"].values()) and result["advice"] == []
    assert result["batch_size"] == 4 and result["largest_batch"] > 4

    assert main(["plan", str(QUICKSTART), "--gpu-memory", "1GiB", "train.cutoff_len=2048"]) == 1
    out = capsys.readouterr().out
    assert "does NOT fit" in out and "try: " in out and "cutoff_len 2048" in out

    assert main(["plan", str(QUICKSTART), "--gpu-memory", "abc"]) == 2
    assert "--gpu-memory 'abc': expected a size" in capsys.readouterr().err
    assert main(["plan", "missing.yaml"]) == 2
    assert "missing.yaml" in capsys.readouterr().err


def tiny_cpu(spare: int) -> Device:
    """This CPU with only `spare` bytes beyond what this (test) process holds."""
    return Device("cpu", "this CPU", resident_bytes() + spare, resident_bytes())


@pytest.mark.slow
def test_train_refuses_a_config_that_cannot_fit(tmp_path: Path, tiny_gemma3_dir: Path, monkeypatch,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr("gemmaforge.recipe.trainer.this_device", lambda: tiny_cpu(500 * 2**20))
    config = write_config(tmp_path, tiny_gemma3_dir, per_device_train_batch_size=64, cutoff_len=1024)
    assert main(["train", str(config)]) == 2
    err = capsys.readouterr().err
    assert "this config cannot fit" in err and "try: train.per_device_train_batch_size=" in err
    assert "train.check_memory=false" in err
    assert not (tmp_path / "run" / "checkpoints").exists() and not (tmp_path / "run" / "adapter").exists()


def test_check_memory_false_plans_and_goes_on(tiny_gemma3_dir: Path, tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr("gemmaforge.recipe.trainer.this_device", lambda: tiny_cpu(500 * 2**20))
    config = run_config(train={"per_device_train_batch_size": 64, "cutoff_len": 1024, "check_memory": False})
    plan, trained = check_memory(config, resolve_model(str(tiny_gemma3_dir), tmp_path), "fp32", "single")
    assert not plan.fits and plan.advice and trained.train.gradient_checkpointing is False


def test_a_failing_planner_stops_train_unless_check_memory_is_false(monkeypatch) -> None:
    def broken(*args: object) -> None:
        raise ValueError("no config.json")

    monkeypatch.setattr("gemmaforge.recipe.trainer.Planner", broken)
    with pytest.raises(ValueError, match="no config.json"):
        check_memory(run_config(), None, "fp32", "single")
    plan, trained = check_memory(run_config(train={"check_memory": False}), None, "fp32", "single")
    assert plan is None and trained.train.gradient_checkpointing is False  # auto without a plan: off


def test_the_tensor_tracker_counts_what_lives() -> None:
    kept = torch.ones(1000)
    with PeakTensorMemory(kept) as tracked:
        a = torch.ones(2**20)
        b = a * 2  # a and b together: the peak
        view = b[:10]
        del a, b
        after = tracked.current  # b lives on through its view
    assert tracked.peak == 4000 + 2 * 4 * 2**20 and after == 4000 + 4 * 2**20 and view.shape == (10,)


def test_bf16_matmuls_in_fp32_leave_the_tracked_peak_and_the_dtypes_as_they_are() -> None:
    """The measured training steps enter Fp32Matmuls for speed: what the tracker sees must not change."""
    generator = torch.Generator().manual_seed(0)
    linear = torch.nn.Linear(64, 96, dtype=torch.bfloat16)
    x = torch.randn(2, 8, 64, generator=generator).bfloat16().requires_grad_()

    def step(fast: bool) -> tuple[int, torch.Tensor, torch.Tensor]:
        with Fp32Matmuls() if fast else nullcontext(), PeakTensorMemory(x, *linear.parameters()) as tracked:
            out = torch.bmm(linear(x), linear.weight.expand(2, 96, 64))
            out.square().mean().backward()
        grad, x.grad = x.grad, None
        linear.zero_grad(set_to_none=True)
        return tracked.peak, out, grad

    peak, out, grad = step(fast=False)
    fast_peak, fast_out, fast_grad = step(fast=True)
    assert fast_peak == peak and fast_out.dtype == fast_grad.dtype == torch.bfloat16
    torch.testing.assert_close(fast_out, out, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(fast_grad, grad, rtol=2e-2, atol=2e-2)


# tiny checkpoints of every kind and Gemma 2's text model (eager attention), not the text-only Gemma 1 and Gemma 4
# (about 15 s each on 2 cores); a 16-position logits chunk so that weights and activations weigh as much as the
# 262k-entry logits do
@pytest.mark.parametrize(("kind", "precision", "packing", "overrides"), [
    ("gemma3-text", "bf16", True, {}),
    ("gemma3-text", "fp32", False, {}),
    ("gemma3-mm", "bf16", True, {}),
    ("gemma4-e2b", "bf16", True, {"gradient_checkpointing": True}),
    ("gemma4-moe", "bf16", True, {"expert_lora": True}),
    ("gemma4-dense", "bf16", False, {}),
    ("gemma4-unified", "bf16", True, {}),
    ("gemma2", "bf16", False, {}),  # eager attention: its T x T probabilities (measured: the plan 7% above)
])
@pytest.mark.slow
def test_the_plan_predicts_the_measured_peak_of_a_training_step(kind: str, precision: str, packing: bool,
                                                                overrides: dict, tiny_gemma3_dir: Path,
                                                                checkpoint_of, text_checkpoint_of,
                                                                tmp_path: Path) -> None:
    """Plan a config as for a GPU (the counted terms, no CPU runtime or heap), then train a step on the CPU
    and measure the peak of live tensor memory: within 20% (measured at batch 2: the plan 3-7% above)."""
    from gemmaforge.models import load_tokenizer
    from gemmaforge.train.loss import install_supervised_forward
    from gemmaforge.train.wrapping import build_peft_model

    folder = (tiny_gemma3_dir if kind == "gemma3-text" else text_checkpoint_of(kind) if kind in FAMILIES
              else checkpoint_of(kind))
    checkpointing = overrides.get("gradient_checkpointing", False)
    lora = ({"lora_dropout": 0.0, "target_parameters": ["experts.gate_up_proj", "experts.down_proj"]}
            if overrides.get("expert_lora") else {})
    batch, cutoff = 2, 256
    config = run_config(lora=lora, train={"per_device_train_batch_size": batch, "cutoff_len": cutoff,
                                          "packing": packing,
                                          "gradient_checkpointing": checkpointing, "logits_chunk_size": 16})
    base = resolve_model(str(folder), tmp_path)
    planned = sum(Planner(config, base, precision, Device("gpu", "a GPU", 2**40, 0))
                  .parts(batch, cutoff, checkpointing).values())

    model = build_peft_model(config, base, load_tokenizer(base.path), precision)
    install_supervised_forward(model, config.train.logits_chunk_size)
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.enable_input_require_grads()
    model.train()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    ids = torch.randint(10, 1000, (batch, cutoff), generator=torch.Generator().manual_seed(0))
    inputs = {"input_ids": ids, "labels": ids.clone()}
    if packing:  # two examples per row
        inputs["position_ids"] = torch.cat([torch.arange(100), torch.arange(cutoff - 100)]).repeat(batch, 1)
    else:
        inputs["attention_mask"] = torch.ones_like(ids)
    with Fp32Matmuls(), PeakTensorMemory(*model.parameters(), *model.buffers()) as tracked:
        model(**inputs).loss.backward()
        optimizer.step()  # its moments appear beside the gradients
    assert planned == pytest.approx(tracked.peak, rel=0.2), \
        f"planned {planned / 2**20:.1f} MiB, measured {tracked.peak / 2**20:.1f} MiB"


@pytest.mark.slow
@pytest.mark.parametrize("method", ["dpo", "kto", "rm"])
def test_the_plan_prices_a_preference_step_with_its_reference_passes(method: str, tiny_gemma3_dir: Path,
                                                                     tmp_path: Path) -> None:
    """A DPO step trains a pair's two rows and scores them again with the adapter disabled; a KTO step trains its
    answers and scores mismatched rows and the reference without gradient: the plan (two rows per pair, nothing
    for the passes without gradient) within 20% of the measured peak of live tensors. A reward model trains a pair's
    two rows through its score head, never the output layer (no logits priced)."""
    from gemmaforge.models import load_tokenizer
    from gemmaforge.train.loss import install_supervised_forward
    from gemmaforge.train.preference import (
        PreferenceSettings,
        kto_losses,
        pair_logps,
        preference_losses,
        reward_losses,
    )
    from gemmaforge.train.wrapping import build_peft_model

    batch, cutoff = 2, 256
    config = run_config(train={"method": method, "per_device_train_batch_size": batch, "cutoff_len": cutoff,
                               "packing": False, "logits_chunk_size": 16})
    base = resolve_model(str(tiny_gemma3_dir), tmp_path)
    planned = sum(Planner(config, base, "bf16", Device("gpu", "a GPU", 2**40, 0)).parts(batch, cutoff, False).values())

    model = build_peft_model(config, base, load_tokenizer(base.path), "bf16")
    install_supervised_forward(model, config.train.logits_chunk_size)
    model.train()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    ids = torch.randint(10, 1000, (2 * batch, cutoff), generator=torch.Generator().manual_seed(0))
    labels = ids.clone()
    labels[:, :cutoff // 4] = -100  # the prompt
    rows = {"input_ids": ids, "labels": labels, "attention_mask": torch.ones_like(ids)}
    settings = PreferenceSettings("sigmoid", beta=0.1)
    with Fp32Matmuls(), PeakTensorMemory(*model.parameters(), *model.buffers()) as tracked:
        if method == "dpo":  # both rows of each pair with gradient, then the reference without
            chosen, rejected, chosen_counts, rejected_counts = pair_logps(model, rows)
            with torch.no_grad(), model.disable_adapter():
                ref_chosen, ref_rejected, _, _ = pair_logps(model, rows)
            loss = preference_losses(settings, chosen, rejected, ref_chosen, ref_rejected, chosen_counts,
                                     rejected_counts).losses.mean()
        elif method == "rm":  # both rows of each pair through the score head
            chosen, rejected = model(**rows, rewards=True).rewards.chunk(2)
            loss = reward_losses(chosen, rejected).mean()
        else:  # the answers with gradient; their mismatched rows and the reference without
            answers = {key: value[:batch] for key, value in rows.items()}
            mismatched = {key: value[batch:] for key, value in rows.items()}
            out = model(**answers, sequence_logps=True)
            with torch.no_grad():
                kl_logps = model(**mismatched, sequence_logps=True).logps
                with model.disable_adapter():
                    ref_logps = model(**answers, sequence_logps=True).logps
                    ref_kl_logps = model(**mismatched, sequence_logps=True).logps
            kl = (kl_logps - ref_kl_logps).mean().clamp(min=0)
            losses, _ = kto_losses(settings, out.logps, ref_logps, out.counts, torch.tensor([True, False]), kl)
            loss = losses.mean()
        loss.backward()
        optimizer.step()
    assert planned == pytest.approx(tracked.peak, rel=0.2), \
        f"planned {planned / 2**20:.1f} MiB, measured {tracked.peak / 2**20:.1f} MiB"
