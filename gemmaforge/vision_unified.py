"""Gemma 4 12B Unified's image inputs, computed as its own image processor computes them, without torchvision.

transformers' Gemma4UnifiedImageProcessor has only a torchvision backend, and torchvision wheels are built for one
torch build each (a CPU torch cannot load the CUDA wheel PyPI serves). Its steps are plain tensor work, done here
with torch alone, in its order (transformers models/gemma4_unified/image_processing_gemma4_unified.py):
1. resize keeping the aspect ratio to the largest size within max_soft_tokens x pooling_kernel_size**2 patches
   whose sides are multiples of patch_size x pooling_kernel_size (Gemma 4's size function, the same code); the resize is
   torchvision's for a CPU uint8 tensor, bicubic with antialiasing: torch's native uint8 interpolate
   (torchvision/transforms/v2/functional/_geometry.py resize_image);
2. rescale by rescale_factor (no normalization: do_normalize false);
3. cut into model patches (patch_size x pooling_kernel_size pixels a side) row by row, each flattened in HWC order:
   what its 16 px teacher patches merged k x k (patches_merge) give, with each model patch's (x, y);
4. pad to max_soft_tokens with zero patches at (-1, -1).
tests/unit/test_vision_unified.py holds this against the official processor's own steps.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

PROCESSOR_CLASS = "Gemma4UnifiedImageProcessor"


class UnifiedImageProcessor:
    """Called as transformers' image processors are: `(images=[PIL RGB], return_tensors="pt")`."""

    def __init__(self, settings: dict[str, Any]):
        self.patch_size = int(settings.get("patch_size", 16))
        self.pooling_kernel_size = int(settings.get("pooling_kernel_size", 3))
        self.max_soft_tokens = int(settings.get("max_soft_tokens", 280))
        self.rescale_factor = float(settings.get("rescale_factor", 1 / 255)) if settings.get("do_rescale", True) \
            else 1.0
        self.do_resize = bool(settings.get("do_resize", True))
        if settings.get("do_normalize"):
            raise ValueError(f"{PROCESSOR_CLASS} with do_normalize is not supported (Google's checkpoints set false)")

    @classmethod
    def load(cls, model_dir: Path) -> UnifiedImageProcessor:
        """From the checkpoint's processor_config.json (its "image_processor"), or preprocessor_config.json."""
        for name in ("processor_config.json", "preprocessor_config.json"):
            path = model_dir / name
            if path.is_file():
                settings = json.loads(path.read_text(encoding="utf-8"))
                return cls(settings.get("image_processor", settings))
        return cls({})

    def __call__(self, images: list[Any], return_tensors: str = "pt") -> dict[str, Any]:
        import torch

        side = self.patch_size * self.pooling_kernel_size
        pixel_values = torch.zeros(len(images), self.max_soft_tokens, side * side * 3)
        positions = torch.full((len(images), self.max_soft_tokens, 2), -1, dtype=torch.long)
        counts = []
        for i, image in enumerate(images):
            pixels = torch.from_numpy(np.array(image.convert("RGB"))).permute(2, 0, 1).contiguous()
            pixels = self._resized(pixels).float() * self.rescale_factor
            rows, cols = pixels.shape[1] // side, pixels.shape[2] // side
            patches = pixels[:, :rows * side, :cols * side].reshape(3, rows, side, cols, side)
            pixel_values[i, :rows * cols] = patches.permute(1, 3, 2, 4, 0).reshape(rows * cols, -1)
            grid = torch.meshgrid(torch.arange(cols), torch.arange(rows), indexing="xy")
            positions[i, :rows * cols] = torch.stack(grid, dim=-1).reshape(rows * cols, 2)
            counts.append(rows * cols)
        return {"pixel_values": pixel_values, "image_position_ids": positions,
                "num_soft_tokens_per_image": torch.tensor(counts)}

    def _resized(self, pixels: Any) -> Any:
        import torch
        from transformers.models.gemma4.image_processing_pil_gemma4 import get_aspect_ratio_preserving_size

        if not self.do_resize:
            return pixels
        height, width = get_aspect_ratio_preserving_size(
            pixels.shape[1], pixels.shape[2], self.patch_size,
            self.max_soft_tokens * self.pooling_kernel_size**2, self.pooling_kernel_size)
        if (height, width) == tuple(pixels.shape[1:]):
            return pixels
        return torch.nn.functional.interpolate(pixels[None], size=[height, width], mode="bicubic",
                                               align_corners=False, antialias=True)[0]
