"""Pictures and checkpoints for the image tests (tests/unit/test_image_*.py)."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import torch
from PIL import Image

KINDS = ["gemma3-mm", "gemma4-e2b", "gemma4-moe", "gemma4-dense", "gemma4-unified"]
TOWER_KINDS = KINDS[:4]  # with a vision tower to adapt (Unified's pictures enter through a projection alone)
COLOURS = {"red": (220, 30, 30), "green": (30, 200, 40), "blue": (30, 40, 220)}
QUESTION = "Which colour is this picture?"
FINAL_NORMS = ("language_model.norm.weight", "language_model.model.norm.weight")  # Gemma 4's, Gemma 3's hub name


def picture(colour: tuple[int, int, int], rng: np.random.Generator) -> Image.Image:
    """A noisy picture of one colour, of a random size (Gemma 4 gives each size its own token count)."""
    width, height = (int(n) for n in rng.integers(40, 120, 2))
    return Image.fromarray(np.clip(np.array(colour) + rng.normal(0, 25, (height, width, 3)), 0, 255).astype("uint8"))


def trained_scale_copy(source: Path, target: Path) -> Path:
    """The checkpoint with its final norm at a trained model's scale. Drawn at random it leaves the logits below 1
    over a 262k vocabulary, where no answer can ever be the most likely token (real Gemma checkpoints' final norms
    are tens, see tests/unit/test_loss_families.py)."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(source, target)
    scaled = []
    for file in target.glob("*.safetensors"):
        tensors = load_file(file)
        for key in [k for k in tensors if k.endswith(FINAL_NORMS)]:
            tensors[key] = torch.full_like(tensors[key], 30.0)
            scaled.append(key)
        save_file(tensors, file, metadata={"format": "pt"})
    assert len(scaled) == 1, scaled
    return target



def learned_signature(tmp_path: Path, model: Path, data: Path, cases: list[dict], steps: int) -> dict:
    """`gemmaforge run` on the tiny checkpoint `model` with the folder `data`, evaluated on the suite of held-out
    `cases` (one `checks` regex each, in tmp_path's suite.yaml) by llama.cpp from the exported GGUF and projector:
    the base passes none, the tuned model (the adapter in transformers) all, and llama.cpp answers word for word as
    it.
    fp32, not the CPU's bf16: bf16 kernels differ between CPUs (AMX, AVX512-BF16). The eval results."""
    import json

    from gemmaforge.cli import main

    (tmp_path / "suite.yaml").write_text(json.dumps({"cases": cases}))  # JSON is YAML
    config = tmp_path / "run.yaml"
    config.write_text(json.dumps({
        "output_dir": str(tmp_path / "run"), "model": {"name_or_path": str(model)},
        "data": {"path": str(data), "val_size": 3},
        "lora": {"r": 8, "lora_alpha": 16, "target_modules": "all-linear"},
        "train": {"max_steps": steps, "per_device_train_batch_size": 4, "learning_rate": 5e-3, "cutoff_len": 1024,
                  "logging_steps": 10, "save_steps": 1000, "seed": 1, "precision": "fp32"},
        "eval": {"suite": str(tmp_path / "suite.yaml"), "engine": "llamacpp", "retention": False},
        "export": {"gguf": ["f16"]},
    }))
    assert main(["run", str(config)]) == 0
    results = json.loads((tmp_path / "run" / "eval" / "results.json").read_text())
    expected = [case["checks"][0]["regex"].strip("^$") for case in cases]
    assert results["base"]["suite_pass_rate"] == 0.0
    assert results["agreement"]["merged_answers"] == expected  # transformers, the adapter on the base
    assert [case["tuned"]["answer"] for case in results["cases"]] == expected  # llama.cpp: GGUF + projector
    assert results["tuned"]["suite_pass_rate"] == 1.0 and results["agreement"]["exact_match"] == 1.0
    assert sorted(p.name for p in (tmp_path / "run" / "gguf").glob("mmproj*.gguf")) == ["mmproj-f16.gguf"]
    return results


def checkpoint_tensor(folder: Path, name: str) -> np.ndarray:
    """One tensor of a safetensors checkpoint folder, as float32."""
    from safetensors import safe_open

    for file in folder.glob("*.safetensors"):
        with safe_open(file, "pt") as f:
            if name in f.keys():
                return f.get_tensor(name).float().numpy()
    raise KeyError(name)
