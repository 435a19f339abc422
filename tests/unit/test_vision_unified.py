"""Gemma 4 12B Unified's image inputs (gemmaforge/vision_unified.py) against transformers' own
Gemma4UnifiedImageProcessor. That processor imports torchvision, which has no CPU wheel for this torch here: its
module is imported with a stand-in for torchvision's functional module whose `resize` does what torchvision's
resize_image does for a CPU uint8 tensor, bicubic with antialiasing (torchvision/transforms/v2/functional/
_geometry.py: native uint8 `interpolate`, align_corners False). Everything else is the official code: the size, the
rescale, the 16 px teacher patches and their k x k merge, the positions and the padding."""

from __future__ import annotations

import sys
import types
from unittest import mock

import numpy as np
import pytest
import torch
from PIL import Image

from gemmaforge.model_spec import read_spec
from gemmaforge.models import load_tokenizer
from gemmaforge.vision import ImagePrompt
from gemmaforge.vision_unified import UnifiedImageProcessor

SIZES = [(200, 70), (70, 200), (144, 96), (30, 1000), (1000, 30), (17, 17), (2000, 1500)]  # (width, height)


def official_steps():
    """transformers' Gemma4UnifiedImageProcessor class, imported beside a torchvision stand-in (its resize alone)."""
    # everything the module imports but torchvision, imported first: patch.dict drops what was imported inside it,
    # and a native extension (soxr, below processing_utils) cannot be imported twice in one process
    import transformers.image_processing_backends  # noqa: F401
    import transformers.models.gemma4.image_processing_pil_gemma4  # noqa: F401

    def resize(image, size, interpolation=None, antialias=True):
        assert interpolation == "bicubic" and image.dtype == torch.uint8 and image.device.type == "cpu"
        return torch.nn.functional.interpolate(image[None], size=size, mode="bicubic", align_corners=False,
                                               antialias=antialias)[0]

    functional = types.SimpleNamespace(resize=resize, InterpolationMode=types.SimpleNamespace(BICUBIC="bicubic"))
    names = ("torchvision", "torchvision.transforms", "torchvision.transforms.v2")
    stand_ins = {**{n: types.SimpleNamespace(functional=functional) for n in names},
                 "torchvision.transforms.v2.functional": functional}
    with mock.patch.dict(sys.modules, stand_ins):  # on leaving, the module imported here is dropped with them
        from transformers.models.gemma4_unified.image_processing_gemma4_unified import Gemma4UnifiedImageProcessor
    return Gemma4UnifiedImageProcessor


@pytest.mark.parametrize("max_soft_tokens", [70, 280])
def test_image_inputs_equal_the_official_processors(max_soft_tokens: int) -> None:
    official = official_steps()
    processor = object.__new__(official)  # its __init__ asks for torchvision; _preprocess needs no state
    ours = UnifiedImageProcessor({"patch_size": 16, "pooling_kernel_size": 3, "max_soft_tokens": max_soft_tokens,
                                  "rescale_factor": 1 / 255, "do_normalize": False})
    rng = np.random.default_rng(0)
    images = [Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)) for w, h in SIZES]
    got = ours(images=images)
    for i, image in enumerate(images):  # the official processor's own loop, one image at a time
        pixels = torch.from_numpy(np.array(image)).permute(2, 0, 1).contiguous()  # TorchvisionBackend's PIL intake
        want = processor._preprocess([pixels], do_resize=True, resample="bicubic", do_rescale=True,
                                     rescale_factor=1 / 255, do_normalize=False, image_mean=None, image_std=None,
                                     return_tensors="pt", patch_size=16, max_soft_tokens=max_soft_tokens,
                                     pooling_kernel_size=3)
        assert torch.equal(got["pixel_values"][i], want["pixel_values"][0]), SIZES[i]
        assert torch.equal(got["image_position_ids"][i], want["image_position_ids"][0]), SIZES[i]
        assert got["num_soft_tokens_per_image"][i] == want["num_soft_tokens_per_image"][0], SIZES[i]
    assert len(set(got["num_soft_tokens_per_image"].tolist())) > 2  # the sizes give their own counts


def test_a_unified_prompt_is_expanded_as_its_processor_writes_it(checkpoint_of) -> None:
    """Gemma4UnifiedProcessor.replace_image_token: `<|image>` + the image's soft-token count x `<|image|>` +
    `<image|>`, the count its image processor gives; mm_token_type_ids 1 on the soft tokens."""
    folder = checkpoint_of("gemma4-unified")
    spec, tokenizer = read_spec(folder), load_tokenizer(folder)
    vision = ImagePrompt.load(folder, spec, tokenizer)
    image = Image.new("RGB", (200, 70), (9, 99, 199))
    text, inputs = vision.expand(f"<|turn>user\n{vision.placeholder}Which colour?<turn|>\n", [image])
    (count,) = UnifiedImageProcessor.load(folder)(images=[image])["num_soft_tokens_per_image"].tolist()
    assert f"<|image>{'<|image|>' * count}<image|>Which colour?" in text and count == vision.soft_token_counts(
        [image.size])[0]
    assert set(inputs) == {"pixel_values", "image_position_ids"}
    ids = torch.tensor([tokenizer(text, add_special_tokens=False).input_ids])
    types_ = vision.token_types(ids)["mm_token_type_ids"]
    assert int(types_.sum()) == count


def test_unknown_settings_are_refused_by_name() -> None:
    with pytest.raises(ValueError, match="do_normalize"):
        UnifiedImageProcessor({"do_normalize": True})
