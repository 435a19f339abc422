"""Builders and checks shared by tests: configs and datasets for tiny runs, the CLI in its own process, and
transformers' own answer to a served prompt."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

import yaml

from gemmaforge.config import RunConfig, validate_config

COFFEE = Path(__file__).parents[1] / "examples" / "data" / "coffee_qa.json"


def write_dataset(path: Path, n: int = 24) -> Path:
    """The first n coffee records: real answers, short enough for quick CPU steps."""
    records = json.loads(COFFEE.read_text(encoding="utf-8"))[:n]
    path.write_text(json.dumps(records, ensure_ascii=False), encoding="utf-8")
    return path


def run_config(**sections: dict) -> RunConfig:
    """A validated config with only `sections` set (beside a run and a data path)."""
    return validate_config({"output_dir": "run", "data": {"path": "data.json"}, **sections}, "test")


def run_cli(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    """`python -m gemmaforge ARGS` in its own process, as a user runs it."""
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    return subprocess.run([sys.executable, "-m", "gemmaforge", *args], cwd=cwd, capture_output=True, text=True, env=env)


def manifest_train(run: Path) -> dict:
    return json.loads((run / "manifest.json").read_text())["stages"]["train"]


def adapter_tensors(run: Path) -> dict:
    """The saved adapter's tensors by name."""
    from safetensors.torch import load_file

    return load_file(run / "adapter" / "adapter_model.safetensors")


def metrics(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def write_config(tmp_path: Path, model: Path | str, lora: dict | None = None, **train: object) -> Path:
    """A config for a few fast steps on a tiny model; `lora` and `train` override their sections' keys."""
    config = {
        "output_dir": str(tmp_path / "run"),
        "model": {"name_or_path": str(model)},
        "data": {"path": str(write_dataset(tmp_path / "data.json")), "val_size": 4},
        "lora": {"r": 4, "lora_alpha": 8, "lora_dropout": 0.0, **(lora or {})},
        "train": {
            "max_steps": 4,
            "per_device_train_batch_size": 4,
            "learning_rate": 5e-3,
            "logging_steps": 1,
            "save_steps": 2,
            "cutoff_len": 128,
            **train,
        },
        # a random tiny model never stops on its own: short answers keep a run's eval stage a few seconds
        "eval": {"max_new_tokens": 24},
        "export": {"gguf": ["f16", "q8_0"], "ollama": {"name": "tiny-coffee"}},
    }
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(config, allow_unicode=True), encoding="utf-8")
    return path


def example(n: int, supervised_from: int, seed: int) -> dict[str, list[int]]:
    """A tokenized example of n random ids after <bos>, supervised from position `supervised_from`."""
    import torch

    from gemmaforge.chat.conversation import IGNORE_INDEX

    ids = [2] + torch.randint(10, 5000, (n - 1,), generator=torch.Generator().manual_seed(seed)).tolist()
    return {"input_ids": ids, "labels": [IGNORE_INDEX] * supervised_from + ids[supervised_from:]}


def assert_loss_equals_transformers(model: object, chunk_size: int = 1024) -> None:
    """Our supervised loss and its gradients (to every trainable parameter) equal transformers' own `labels=`
    loss of the PEFT `model`'s base class on a batch with a prompt and padding."""
    import torch

    from gemmaforge.train.loss import supervised_loss

    input_ids = torch.randint(3, 20000, (2, 24), generator=torch.Generator().manual_seed(1))
    labels = input_ids.clone()
    labels[:, :9] = -100  # a prompt
    labels[1, 20:] = -100  # padding
    attention_mask = torch.ones_like(input_ids)
    attention_mask[1, 20:] = 0
    trained = [p for p in model.parameters() if p.requires_grad]
    base = model.get_base_model()
    want = base.__class__.forward(base, input_ids=input_ids, attention_mask=attention_mask, labels=labels).loss
    want_grads = torch.autograd.grad(want, trained)
    inputs = {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}
    got = supervised_loss(model, inputs, None, chunk_size)
    got_grads = torch.autograd.grad(got, trained)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    for g, w in zip(got_grads, want_grads):
        # absolute slack scaled to the gradient: fp32 sums over the 262k-entry vocabulary in another order leave
        # ~1e-5 of its largest entry on a trained output layer (measured 6.2e-6 of 0.66 on an AMD EPYC)
        torch.testing.assert_close(g, w, rtol=1e-4, atol=max(1e-6, 1e-4 * float(w.abs().max())))


def reference_answer(registry, name: str, messages: list[dict[str, str]], n: int) -> str:
    """transformers' own greedy generation (PEFT's, for an adapter) on the served prompt ids."""
    from gemmaforge.serve.protocol import chat_prompt

    served = registry.get(name)
    return reference_answer_to_ids(registry, name, served.engine.encode(chat_prompt(served, messages)), n)


def reference_answer_to_ids(registry, name: str, ids: list[int], n: int) -> str:
    """transformers' own greedy generation (PEFT's, for an adapter) after the prompt `ids`."""
    import torch

    served = registry.get(name)
    engine = served.engine
    with _as_served(served):
        out = (engine.peft or engine.model).generate(input_ids=torch.tensor([ids]), max_new_tokens=n, do_sample=False,
                                                     eos_token_id=sorted(engine.stops), pad_token_id=0)
    answer = [t for t in out[0, len(ids):].tolist() if t not in engine.stops]
    return engine.tokenizer.decode(answer, skip_special_tokens=True)


def reference_embedding(registry, name: str, text: str) -> list[float]:
    """The mean of transformers' own text-model output (its final norm applied) over the tokenizer's encoding of
    `text` (<bos> first), with the served adapter: not normalised."""
    served = registry.get(name)
    engine = served.engine
    with _as_served(served):
        ids = engine.tokenizer(text, return_tensors="pt").input_ids
        hidden = engine.model.model(input_ids=ids).last_hidden_state
    return hidden[0].mean(dim=0).tolist()


@contextmanager
def _as_served(served) -> Iterator[None]:
    """The engine's model computing as `served` does (its adapter, or none), with no engine step in between."""
    import torch

    engine = served.engine
    with engine._model_lock, torch.inference_mode(), ExitStack() as stack:
        if served.adapter:  # the engine may have left the adapter layers switched off (a base step)
            engine.peft.base_model.enable_adapter_layers()
            engine.peft.set_adapter(served.adapter)
        elif engine.peft is not None:  # the base model's layers hold the adapters: switch them off
            stack.enter_context(engine.peft.disable_adapter())
        yield


def trained_adapter(model, target: Path, seed: int = 0, **lora) -> Path:
    """An adapter of `model` with random (non-zero) LoRA weights and trained marker rows (or whole modules), as
    training leaves one, saved to `target`. LoRA r 4, alpha 8, no dropout unless `lora` says otherwise."""
    import torch
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    peft = get_peft_model(model, LoraConfig(**{"r": 4, "lora_alpha": 8, "lora_dropout": 0.0, **lora},
                                            init_lora_weights=False))
    with torch.no_grad():
        for name, param in peft.named_parameters():
            if "trainable_tokens_delta" in name or "modules_to_save" in name:
                param.add_(torch.randn_like(param) * 0.05)
    peft.save_pretrained(target)
    return target
