"""Adapting the image path (lora.freeze_vision_tower / freeze_multi_modal_projector: false): LoRA on the tower,
the projector trained in full, both in the merged checkpoint and the projector GGUF; refused where they cannot go."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from gemmaforge.cli import main
from tests.image_helpers import COLOURS, QUESTION, checkpoint_tensor, picture

TOWER_K = {"gemma3": "vision_tower.vision_model.encoder.layers.0.self_attn.k_proj.weight",
           "gemma4": "model.vision_tower.encoder.layers.0.self_attn.k_proj.linear.weight"}  # hub names, by family
PROJECTOR = {"gemma3": "model.multi_modal_projector", "gemma4": "model.embed_vision"}  # module paths
# each vision tower once: Gemma 3's SigLIP, Gemma 4's on-device one (E2B) and its large one (31B), which 26B-A4B
# shares (tests/checkpoint_kinds.py: the same Gemma4VisionConfig; the text model around it does not reach the tower)
ADAPTED_KINDS = ["gemma3-mm", "gemma4-e2b", "gemma4-dense"]


@pytest.mark.integration
@pytest.mark.parametrize("kind", ADAPTED_KINDS)
def test_adapted_tower_and_projector_reach_the_merged_model_and_projector_gguf(kind: str, checkpoint_of,
                                                                                tmp_path: Path, capsys) -> None:
    """lora.freeze_vision_tower / freeze_multi_modal_projector false: LoRA on the tower's linear layers, the
    projector trained in full; merge keeps both, `export gguf`'s projector file carries the merged tower, and a
    GGUF or vLLM adapter (which cannot carry them) is refused."""
    from gguf import GGUFReader

    base = checkpoint_of(kind)
    rng = np.random.default_rng(0)
    (tmp_path / "data").mkdir()
    rows = []
    for i in range(8):
        picture(list(COLOURS.values())[i % 3], rng).save(tmp_path / "data" / f"{i}.png")
        rows.append({"file_name": f"{i}.png", "instruction": QUESTION, "output": list(COLOURS)[i % 3]})
    (tmp_path / "data" / "metadata.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    config = tmp_path / "run.yaml"
    config.write_text(json.dumps({
        "output_dir": str(tmp_path / "run"), "model": {"name_or_path": str(base)},
        "data": {"path": str(tmp_path / "data"), "val_size": 1},
        "lora": {"r": 4, "target_modules": "all-linear", "freeze_vision_tower": False,
                 "freeze_multi_modal_projector": False},
        "train": {"max_steps": 3, "per_device_train_batch_size": 2, "learning_rate": 1e-2, "save_steps": 1000},
        "export": {"gguf": ["f16"]},
    }))
    run = tmp_path / "run"
    assert main(["train", str(config)]) == 0
    # train.packing (on by default) is set aside for data with pictures, and the run says so
    assert "8 examples hold images or sound: padded batches" in capsys.readouterr().err
    adapter = json.loads((run / "adapter" / "adapter_config.json").read_text())
    family = kind.split("-")[0]
    projector = PROJECTOR[family]
    assert adapter["modules_to_save"] == [projector] and "model\\.vision_tower" in adapter["target_modules"]
    assert main(["merge", str(run)]) == 0 and main(["export", "gguf", str(run)]) == 0
    before, merged = checkpoint_tensor(base, TOWER_K[family]), checkpoint_tensor(run / "merged", TOWER_K[family])
    (written,) = [t for t in GGUFReader(run / "gguf" / "mmproj-f16.gguf").tensors if t.name == "v.blk.0.attn_k.weight"]
    in_gguf = np.asarray(written.data, dtype=np.float32).reshape(merged.shape)
    assert np.abs(merged - before).max() > 1e-3  # training moved the tower
    assert np.allclose(in_gguf, merged, atol=1e-3) and not np.allclose(in_gguf, before, atol=1e-3)
    capsys.readouterr()
    assert main(["export", "gguf", str(run), "--adapter"]) == 2
    assert "adapts the vision tower (lora.freeze_vision_tower: false), which a GGUF adapter cannot carry" in \
        capsys.readouterr().err
    assert main(["export", "vllm", str(run), "--adapter"]) == 2
    assert "adapts the vision tower (lora.freeze_vision_tower: false); vLLM loads LoRA weights only" in \
        capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.parametrize(("kind", "key", "message"), [
    ("text", "freeze_multi_modal_projector", "Gemma3ForCausalLM has no vision projector"),
    ("gemma4-unified", "freeze_vision_tower", "Gemma4UnifiedForConditionalGeneration has no vision tower"),
])
def test_adapting_a_vision_part_a_model_lacks_is_refused(kind: str, key: str, message: str, tiny_gemma3_dir: Path,
                                                         checkpoint_of, tmp_path: Path, capsys) -> None:
    from tests.helpers import write_dataset

    model = tiny_gemma3_dir if kind == "text" else checkpoint_of(kind)
    config = tmp_path / "run.yaml"
    config.write_text(json.dumps({
        "output_dir": str(tmp_path / "run"), "model": {"name_or_path": str(model)},
        "data": {"path": str(write_dataset(tmp_path / "data.json", 8))},
        "lora": {key: False}, "train": {"max_steps": 1}}))
    assert main(["train", str(config)]) == 2
    assert f"lora.{key}: false, but {message}" in capsys.readouterr().err
