"""The training engine on tiny models: kill -9 and resume, NaN guard, early stopping, refusals before
loading, and Gemma 4 with gradient checkpointing."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from gemmaforge.cli import main
from gemmaforge.runs import RunDir
from gemmaforge.train.checkpoints import MARKER
from tests.helpers import adapter_tensors, manifest_train, run_config, write_config


@pytest.mark.slow
def test_sigkill_then_same_command_resumes_from_the_last_complete_checkpoint(tmp_path: Path, tiny_gemma3_dir) -> None:
    """With dropout and evaluation on, the resumed run equals the uninterrupted one only if the checkpoint
    restores the RNG (dropout masks), the optimizer and the data position."""
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
    settings = {"lora": {"lora_dropout": 0.1}, "max_steps": 6, "save_steps": 2, "eval_strategy": "steps",
                "eval_steps": 2}
    straight = write_config(tmp_path / "a", tiny_gemma3_dir, **settings)
    assert main(["train", str(straight)]) == 0

    config = write_config(tmp_path / "b", tiny_gemma3_dir, **settings)
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    child = subprocess.Popen([sys.executable, "-m", "gemmaforge", "train", str(config)], env=env,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    checkpoints = tmp_path / "b" / "run" / "checkpoints"
    deadline = time.monotonic() + 300
    while not (checkpoints / "checkpoint-2" / MARKER).exists():
        assert child.poll() is None and time.monotonic() < deadline, "training ended before its first checkpoint"
        time.sleep(0.05)
    child.send_signal(signal.SIGKILL)
    child.wait()
    half_written = checkpoints / "checkpoint-5"  # as a kill in the middle of a save leaves it
    half_written.mkdir()
    (half_written / "adapter_model.safetensors").write_bytes(b"\0" * 10)

    assert main(["train", str(config)]) == 0
    record = manifest_train(tmp_path / "b" / "run")
    assert record["steps"] == 6 and record["resumed_from_step"] in (2, 4)
    full = manifest_train(tmp_path / "a" / "run")
    trained = {run["resumed_from_step"]: run["samples_per_second"] * run["train_runtime_s"] for run in (full, record)}
    assert 0 < trained[record["resumed_from_step"]] < 0.9 * trained[None]  # speed counts what this run trained
    assert not half_written.exists()
    rows = map(json.loads, (tmp_path / "b" / "run" / "metrics.jsonl").read_text().splitlines())
    assert [row["step"] for row in rows if "loss" in row] == [1, 2, 3, 4, 5, 6]  # none lost, none twice
    a, b = adapter_tensors(tmp_path / "a" / "run"), adapter_tensors(tmp_path / "b" / "run")
    assert a.keys() == b.keys()
    assert all(torch.allclose(a[k], b[k], rtol=1e-4, atol=1e-6) for k in a), "resumed run differs from a straight run"


@pytest.mark.slow
def test_the_same_command_after_a_finished_training_trains_nothing_more(tmp_path: Path, tiny_gemma3_dir,
                                                                        capsys: pytest.CaptureFixture[str]) -> None:
    """`gemmaforge run` again after a later stage failed resumes train from its final checkpoint: no step beyond
    max_steps (the Trainer's loop would take one), the same adapter, the same metrics. docs/training.md says where it
    resumed."""
    config = write_config(tmp_path, tiny_gemma3_dir, max_steps=2, save_steps=2)
    assert main(["train", str(config)]) == 0
    run = tmp_path / "run"
    first, metrics = adapter_tensors(run), (run / "metrics.jsonl").read_text()
    assert "resuming from" not in capsys.readouterr().err
    assert main(["train", str(config)]) == 0
    assert "train: resuming from checkpoint-2 (step 2), the last complete checkpoint" in capsys.readouterr().err
    record = manifest_train(run)
    assert record["steps"] == 2 and record["resumed_from_step"] == 2
    logged = [json.loads(line)["loss"] for line in metrics.splitlines() if "loss" in json.loads(line)]
    assert record["train_loss"] == pytest.approx(sum(logged) / 2, abs=1e-4)
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["checkpoint-2"]
    assert (run / "metrics.jsonl").read_text() == metrics
    again = adapter_tensors(run)
    assert first.keys() == again.keys() and all(torch.equal(first[k], again[k]) for k in first)


@pytest.mark.slow
def test_non_finite_loss_stops_with_a_diagnosis(tmp_path: Path, tiny_gemma3_dir,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    config = write_config(tmp_path, tiny_gemma3_dir, max_steps=12, learning_rate=1e9, max_grad_norm=1e9,
                          save_steps=100, eval_strategy="no")
    assert main(["train", str(config)]) == 1
    err = capsys.readouterr().err
    assert "training stopped: the loss became" in err and "learning_rate=1000000000.0 is high" in err
    flat = " ".join(err.split())
    assert "add warmup: train.warmup_ratio=0.03" in flat and "check the data around this step" in flat
    assert not (tmp_path / "run" / "adapter").exists()


def test_losses_are_read_back_at_logs_and_checkpoints_naming_the_first_bad_step() -> None:
    """The guard reads the losses since the last check in one go (not one read per step) and names the first
    non-finite one; a checkpoint is never written before that read."""
    from types import SimpleNamespace

    from gemmaforge.train.loss import NonFiniteLoss, SupervisedLossTrainer

    trainer = SimpleNamespace(unchecked_losses=[(4, torch.tensor(2.5)), (5, torch.tensor(float("nan"))),
                                                (6, torch.tensor(float("inf")))])
    trainer.check_finite = lambda: SupervisedLossTrainer.check_finite(trainer)
    trainer.before_checkpoint = lambda: SupervisedLossTrainer.before_checkpoint(trainer)
    with pytest.raises(NonFiniteLoss, match="loss nan at step 5"):
        SupervisedLossTrainer.check_finite(trainer)
    assert trainer.unchecked_losses == []
    trainer.unchecked_losses = [(7, torch.tensor(1.0))]
    SupervisedLossTrainer.check_finite(trainer)  # finite: nothing raised
    trainer.unchecked_losses = [(8, torch.tensor(float("-inf")))]
    with pytest.raises(NonFiniteLoss, match="step 8"):
        SupervisedLossTrainer._save_checkpoint(trainer)  # raised before the Trainer's save could run


@pytest.mark.slow
def test_checkpointing_left_to_auto_is_turned_on_where_only_it_fits(tmp_path: Path, tiny_gemma3_dir,
                                                                     monkeypatch: pytest.MonkeyPatch,
                                                                     capsys: pytest.CaptureFixture[str]) -> None:
    """train.gradient_checkpointing null (the default): on a device with room for the run with checkpointing and
    not without, `plan` and `train` turn it on and say so; set to false, the same run is refused (exit 2)."""
    from gemmaforge.config import load_config
    from gemmaforge.models import resolve_model
    from gemmaforge.recipe import trainer
    from gemmaforge.train.memory_plan import GPU_CONTEXT_BYTES, Device, Planner

    config = write_config(tmp_path, tiny_gemma3_dir, max_steps=1, save_steps=100, eval_strategy="no",
                          per_device_train_batch_size=8, cutoff_len=512, precision="fp32")
    loaded = load_config(config)
    assert loaded.train.gradient_checkpointing is None
    # a GPU-sized budget: its runtime part is fixed, so the two peaks below are exactly what train will price
    probe = Device("gpu", "a small GPU", 2**40, GPU_CONTEXT_BYTES)
    planner = Planner(loaded, resolve_model(str(tiny_gemma3_dir), tmp_path / "home"), "fp32", probe)
    on, off = planner.plan(checkpointing=True).peak_bytes, planner.plan(checkpointing=False).peak_bytes
    assert on < off
    small = Device("gpu", "a small GPU", (on + off) // 2, GPU_CONTEXT_BYTES)
    assert main(["plan", str(config), "--gpu-memory", f"{small.capacity_bytes / 2**20:.6f}MiB", "--json"]) == 0
    planned = json.loads(capsys.readouterr().out)
    assert planned["gradient_checkpointing"] is True and planned["fits"]
    monkeypatch.setattr(trainer, "this_device", lambda: small)
    assert main(["train", str(config)]) == 0
    assert "gradient checkpointing on: without it this run needs" in " ".join(capsys.readouterr().err.split())
    assert manifest_train(tmp_path / "run")["gradient_checkpointing"] is True
    assert main(["train", str(config), "train.gradient_checkpointing=false", "output_dir=" + str(tmp_path / "r2")]) == 2
    assert "this config cannot fit" in capsys.readouterr().err


@pytest.mark.slow
def test_early_stopping_restores_the_best_checkpoint(tmp_path: Path, tiny_gemma3_dir,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    config = write_config(tmp_path, tiny_gemma3_dir, max_steps=12, learning_rate=0.5, save_steps=1, eval_steps=1,
                          load_best_model_at_end=True, early_stopping_patience=2, save_total_limit=None)
    monkeypatch.delenv("LRU_CACHE_CAPACITY", raising=False)
    monkeypatch.setenv("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "64")  # the user's own choice stays
    assert main(["train", str(config)]) == 0
    # bounded per-shape kernel caches on the CPU (unbounded, packed runs grow for hundreds of steps)
    assert (os.environ["LRU_CACHE_CAPACITY"], os.environ["ONEDNN_PRIMITIVE_CACHE_CAPACITY"]) == ("16", "64")
    record = manifest_train(tmp_path / "run")
    evals = [row["eval_loss"] for row in map(json.loads, (tmp_path / "run" / "metrics.jsonl").read_text().splitlines())
             if "eval_loss" in row]
    assert record["steps"] < 12, "a learning rate this high must stop improving early"
    assert record["best_checkpoint"].endswith(f"checkpoint-{1 + evals.index(min(evals))}")
    assert record["eval_loss"] == pytest.approx(min(evals), abs=1e-4)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["train.cutoff_len=4096"], "train.cutoff_len=4096 is longer than the model's context (2048 tokens)"),
        (["model.load_in_4bit=true"], "model.load_in_4bit (QLoRA) needs a CUDA or ROCm GPU"),
        (["train.early_stopping_patience=2"], "early_stopping_patience needs load_best_model_at_end"),
        (["train.metric_for_best_model=eval_accuracy"], "train.metric_for_best_model"),
        (["train.load_best_model_at_end=true", "train.save_steps=3", "train.eval_steps=2"],
         "save_steps to be a multiple of eval_steps"),
    ],
)
def test_impossible_setups_are_refused_before_loading(tmp_path: Path, tiny_gemma3_dir,
                                                      capsys: pytest.CaptureFixture[str],
                                                     overrides: list[str], message: str) -> None:
    config = write_config(tmp_path, tiny_gemma3_dir)
    assert main(["train", str(config), *overrides]) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_qlora_without_bitsandbytes_is_refused_before_loading(tmp_path: Path, tiny_gemma3_dir,
                                                              capsys: pytest.CaptureFixture[str],
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """docs/training.md (Refused before loading): model.load_in_4bit without bitsandbytes, on a machine with a GPU
    (faked: the GPU check comes first), is refused with the install line and nothing is trained."""
    import importlib.util

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "bitsandbytes" else
                        find_spec(name, *a))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # and what the run's manifest asks of the GPU:
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "Fake GPU")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    config = write_config(tmp_path, tiny_gemma3_dir, precision="fp32")  # auto would ask the fake GPU its arch
    assert main(["train", str(config), "model.load_in_4bit=true"]) == 2
    assert "model.load_in_4bit (QLoRA) needs bitsandbytes: pip install bitsandbytes (on ROCm, a ROCm build of " \
        "bitsandbytes for your GPU's arch)" in " ".join(capsys.readouterr().err.split())
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_tensorboard_without_the_package_is_refused_before_loading(tmp_path: Path, tiny_gemma3_dir,
                                                                   capsys: pytest.CaptureFixture[str],
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """docs/training.md: `report_to: tensorboard` writes RUN_DIR/tensorboard, and needs the package: without it the run
    is refused with the install line before anything loads."""
    import importlib.util

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "tensorboard" else
                        find_spec(name, *a))
    assert main(["train", str(write_config(tmp_path, tiny_gemma3_dir)), "train.report_to=tensorboard"]) == 2
    assert "train.report_to=tensorboard needs the tensorboard package: pip install tensorboard" in \
        capsys.readouterr().err
    assert not (tmp_path / "run" / "checkpoints").exists()


def gemma4_losses(checkpointing: bool, steps: int = 30) -> list[float]:
    from peft import LoraConfig, get_peft_model
    from transformers import Gemma4ForCausalLM, Gemma4TextConfig

    from gemmaforge.train.loss import supervised_loss

    torch.manual_seed(0)
    config = Gemma4TextConfig(
        vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=6, num_attention_heads=4,
        num_key_value_heads=1, head_dim=16, sliding_window=32, vocab_size_per_layer_input=512,
        hidden_size_per_layer_input=16, num_kv_shared_layers=2, max_position_embeddings=256,
        layer_types=["sliding_attention", "full_attention"] * 3,
    )
    model = get_peft_model(Gemma4ForCausalLM(config), LoraConfig(r=8, lora_alpha=16, target_modules="all-linear"))
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    ids = torch.randint(3, 512, (4, 48))
    batch = {"input_ids": ids, "labels": ids, "attention_mask": torch.ones_like(ids)}
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    losses = []
    for _ in range(steps):
        loss = supervised_loss(model, batch, None)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


@pytest.mark.slow
def test_tiny_gemma4_learns_with_gradient_checkpointing() -> None:
    """Gemma 4 shares KV across layers through the cache; with checkpointing and no cache that broke
    in some transformers versions (loss 10-16, garbage logits). Here the loss starts at ln(vocab),
    falls, and checkpointing changes nothing but memory."""
    with_checkpointing, without = gemma4_losses(True), gemma4_losses(False)
    assert abs(with_checkpointing[0] - torch.log(torch.tensor(512.0)).item()) < 0.2
    # learning: -0.28 over 30 steps on an AVX512 host, -0.3 on an AVX2 one; broken: 10-16
    assert with_checkpointing[-1] < with_checkpointing[0] - 0.2, with_checkpointing
    assert with_checkpointing == pytest.approx(without, rel=1e-4)


@pytest.mark.slow
def test_packed_rows_take_the_packed_attention_in_every_family(text_checkpoint_of, tiny_gemma3_dir: Path,
                                                               tmp_path: Path) -> None:
    """docs/training.md: Gemma 2 trains padded batches with eager attention (SDPA ignores its attention soft-capping);
    packed rows of every family go through the packed attention (build_peft_model, as `train` calls it), whose kernels
    soft-cap."""
    from gemmaforge.families import FAMILIES
    from gemmaforge.models import load_tokenizer, resolve_model
    from gemmaforge.train.wrapping import build_peft_model

    assert FAMILIES["gemma2"].attn_implementation == "eager"
    implementations = {}
    for packing in (True, False):
        for family, folder in (("gemma2", text_checkpoint_of("gemma2")), ("gemma3", tiny_gemma3_dir)):
            base = resolve_model(str(folder), tmp_path)
            assert base.family.name == family
            model = build_peft_model(run_config(train={"packing": packing}), base, load_tokenizer(base.path), "fp32")
            implementations[family, packing] = model.get_base_model().config._attn_implementation
    assert implementations == {("gemma2", True): "gemmaforge_packed", ("gemma3", True): "gemmaforge_packed",
                               ("gemma2", False): "eager", ("gemma3", False): "sdpa"}


def test_every_training_arguments_name_of_the_train_section_reaches_training_arguments(tmp_path: Path,
                                                                                      monkeypatch) -> None:
    """docs/configuration.md: the `train` keys named after TrainingArguments are those arguments; each is set here to a
    value other than its default (warmup_ratio and warmup_steps in two configs) and read back from the arguments `train`
    builds, without training."""
    from gemmaforge.recipe.trainer import checkpointing_arguments, training_arguments

    monkeypatch.setenv("TENSORBOARD_LOGGING_DIR", "unset")  # training_arguments sets it; restored after the test
    run = RunDir(tmp_path / "run")
    by_epoch = run_config(train={
        "num_train_epochs": 2, "per_device_train_batch_size": 3, "gradient_accumulation_steps": 4,
        "learning_rate": 1e-3, "lr_scheduler_type": "cosine", "warmup_ratio": 0.1, "weight_decay": 0.01,
        "max_grad_norm": 0.5, "logging_steps": 7, "eval_strategy": "epoch", "save_strategy": "epoch",
        "save_total_limit": 3, "load_best_model_at_end": True, "metric_for_best_model": "loss",
        "gradient_checkpointing": True, "dataloader_num_workers": 2, "report_to": "tensorboard", "seed": 7})
    args = training_arguments(by_epoch, run, "fp32", has_val=True)
    assert (args.num_train_epochs, args.per_device_train_batch_size, args.gradient_accumulation_steps) == (2, 3, 4)
    assert (args.learning_rate, args.lr_scheduler_type, args.weight_decay, args.max_grad_norm) == \
        (1e-3, "cosine", 0.01, 0.5)
    assert args.get_warmup_steps(1000) == 100  # the ratio, of the steps the run will take
    assert (args.logging_steps, args.eval_strategy, args.save_strategy) == (7, "epoch", "epoch")
    assert args.save_total_limit == 3
    assert args.load_best_model_at_end and args.metric_for_best_model == "loss" and not args.greater_is_better
    assert getattr(args, next(iter(checkpointing_arguments(True)))) is True
    assert (args.dataloader_num_workers, args.report_to, args.seed) == (2, ["tensorboard"], 7)
    assert os.environ["TENSORBOARD_LOGGING_DIR"] == str(run.root / "tensorboard")

    by_steps = run_config(train={"max_steps": 120, "warmup_steps": 7, "warmup_ratio": 0.5, "eval_strategy": "steps",
                                 "eval_steps": 10, "save_steps": 20})
    args = training_arguments(by_steps, run, "fp32", has_val=True)
    assert (args.max_steps, args.eval_steps, args.save_steps) == (120, 10, 20)
    assert args.get_warmup_steps(1000) == 7  # warmup_steps wins over warmup_ratio
    assert args.report_to == [] and not args.load_best_model_at_end


@pytest.mark.slow
def test_modules_to_save_trains_the_whole_module_into_the_adapter(tmp_path: Path, tiny_gemma3_dir) -> None:
    """docs/configuration.md (`lora`): `modules_to_save` trains whole modules beside the LoRA weights and saves them
    with the adapter: lm_head here, tied to the embedding in Gemma, so the adapter holds its own trained copy."""
    from safetensors.torch import load_file

    config = write_config(tmp_path, tiny_gemma3_dir, lora={"modules_to_save": ["lm_head"]}, max_steps=1,
                          save_steps=100, eval_strategy="no")
    assert main(["train", str(config)]) == 0
    run = tmp_path / "run"
    assert json.loads((run / "adapter" / "adapter_config.json").read_text())["modules_to_save"] == ["lm_head"]
    embedding = load_file(tiny_gemma3_dir / "model.safetensors")["model.embed_tokens.weight"]
    heads = [tensor for name, tensor in adapter_tensors(run).items() if ".lm_head." in name]
    assert len(heads) == 1 and heads[0].shape == embedding.shape
    assert not torch.equal(heads[0].float(), embedding.float())  # trained, not the base's copy


@pytest.mark.slow
def test_bias_all_on_a_multimodal_checkpoint_is_refused_before_loading(tmp_path: Path, checkpoint_of,
                                                                      capsys: pytest.CaptureFixture[str]) -> None:
    """PEFT's bias="all" marks every bias trainable, the vision tower's included (Gemma's decoder has none)."""
    config = write_config(tmp_path, checkpoint_of("gemma3-mm"))
    assert main(["train", str(config), "lora.bias=all"]) == 2
    assert "lora.bias=all would also train the vision towers' biases" in capsys.readouterr().err
    assert not (tmp_path / "run" / "checkpoints").exists()
