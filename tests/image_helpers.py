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

