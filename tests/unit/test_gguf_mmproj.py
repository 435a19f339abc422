"""write_mmproj refuses what it cannot turn into a projector GGUF, naming the folder and what it expected, and
leaves nothing at the destination. (Conformance with llama.cpp's converter:
tests/integration/test_mmproj_conformance.py.)"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gemmaforge.errors import UserError
from gemmaforge.export.gguf_mmproj import write_mmproj

# google/gemma-3-4b-it's config.json, shrunk; only config.json is read before these errors
GEMMA3_MM_CONFIG = {
    "architectures": ["Gemma3ForConditionalGeneration"],
    "model_type": "gemma3",
    "mm_tokens_per_image": 4,
    "text_config": {"model_type": "gemma3_text", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
                    "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 16, "vocab_size": 262208},
    "vision_config": {"model_type": "siglip_vision_model", "hidden_size": 32, "intermediate_size": 64,
                      "num_hidden_layers": 1, "num_attention_heads": 2, "image_size": 32, "patch_size": 8,
                      "vision_use_head": False},
}


def multimodal_folder(tmp_path: Path, **files: object) -> Path:
    folder = tmp_path / "gemma-3-mm"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(GEMMA3_MM_CONFIG))
    for name, content in files.items():
        (folder / f"{name}.json").write_text(json.dumps(content))
    return folder


def test_a_text_only_checkpoint_has_no_projector(tiny_gemma3_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "mmproj-f16.gguf"
    with pytest.raises(UserError, match="text-only") as error:
        write_mmproj(tiny_gemma3_dir, out)
    assert str(tiny_gemma3_dir) in str(error.value) and "Gemma3ForCausalLM" in str(error.value)
    assert list(tmp_path.iterdir()) == []


def test_the_image_normalization_must_come_with_the_checkpoint(tmp_path: Path) -> None:
    folder = multimodal_folder(tmp_path)
    with pytest.raises(UserError, match="neither preprocessor_config.json nor processor_config.json") as error:
        write_mmproj(folder, tmp_path / "out" / "mmproj-f16.gguf")
    assert str(folder) in str(error.value) and "image_mean" in str(error.value)
    assert not (tmp_path / "out").exists()


def test_a_processor_config_without_mean_and_std_is_refused(tmp_path: Path) -> None:
    folder = multimodal_folder(tmp_path, preprocessor_config={"image_mean": [0.5] * 3},
                               processor_config={"image_processor": {"size": {"height": 32, "width": 32}}})
    with pytest.raises(UserError, match="no image_std"):
        write_mmproj(folder, tmp_path / "mmproj-f16.gguf")
    assert not (tmp_path / "mmproj-f16.gguf").exists()


def test_a_checkpoint_without_weights_is_refused_before_writing(tmp_path: Path) -> None:
    folder = multimodal_folder(tmp_path, preprocessor_config={"image_mean": [0.5] * 3, "image_std": [0.5] * 3})
    with pytest.raises(UserError, match="no weights in"):
        write_mmproj(folder, tmp_path / "mmproj-f16.gguf")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["gemma-3-mm"]
