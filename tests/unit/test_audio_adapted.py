"""Adapting the sound path (lora.freeze_audio_tower / freeze_audio_projector: false): LoRA on the audio tower, the
projector trained in full, both in the merged checkpoint and the projector GGUF; the memory plan prices what they keep
per audio token; refused where they cannot go."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from gemmaforge.cli import main
from gemmaforge.model_spec import read_spec
from gemmaforge.models import load_tokenizer
from tests.audio_helpers import encoded, tone
from tests.image_helpers import checkpoint_tensor

TOWER_K = "model.audio_tower.layers.0.self_attn.k_proj.linear.weight"  # hub name; llama.cpp's a.blk.0.attn_k.weight
PROJECTOR = "model.embed_audio.embedding_projection.weight"


@pytest.mark.integration
def test_adapted_audio_tower_and_projector_reach_the_merged_model_and_projector_gguf(checkpoint_of, tmp_path: Path,
                                                                                      capsys) -> None:
    from gguf import GGUFReader

    base = checkpoint_of("gemma4-e2b")
    (tmp_path / "data").mkdir()
    rows = []
    for i in range(8):
        (tmp_path / "data" / f"{i}.wav").write_bytes(encoded(tone(0.5 + 0.1 * i, (220, 880)[i % 2])))
        rows.append({"file_name": f"{i}.wav", "instruction": "Which pitch?", "output": ("low", "high")[i % 2]})
    (tmp_path / "data" / "metadata.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    config = tmp_path / "run.yaml"
    config.write_text(json.dumps({
        "output_dir": str(tmp_path / "run"), "model": {"name_or_path": str(base)},
        "data": {"path": str(tmp_path / "data"), "val_size": 1},
        "lora": {"r": 4, "target_modules": "all-linear", "freeze_audio_tower": False, "freeze_audio_projector": False},
        "train": {"max_steps": 3, "per_device_train_batch_size": 2, "learning_rate": 1e-2, "save_steps": 1000},
        "export": {"gguf": ["f16"]},
    }))
    run = tmp_path / "run"
    assert main(["train", str(config)]) == 0
    assert "8 examples hold images or sound: padded batches" in capsys.readouterr().err
    adapter = json.loads((run / "adapter" / "adapter_config.json").read_text())
    assert adapter["modules_to_save"] == ["model.embed_audio"] and "model\\.audio_tower" in adapter["target_modules"]
    assert "vision_tower" not in adapter["target_modules"]
    assert main(["merge", str(run)]) == 0 and main(["export", "gguf", str(run)]) == 0
    before, merged = checkpoint_tensor(base, TOWER_K), checkpoint_tensor(run / "merged", TOWER_K)
    assert np.abs(merged - before).max() > 1e-3  # training moved the tower
    moved = checkpoint_tensor(run / "merged", PROJECTOR) - checkpoint_tensor(base, PROJECTOR)
    assert np.abs(moved).max() > 1e-3  # and the projector
    (written,) = [t for t in GGUFReader(run / "gguf" / "mmproj-f16.gguf").tensors if t.name == "a.blk.0.attn_k.weight"]
    in_gguf = np.asarray(written.data, dtype=np.float32).reshape(merged.shape)
    assert np.allclose(in_gguf, merged, atol=1e-3) and not np.allclose(in_gguf, before, atol=1e-3)
    capsys.readouterr()
    assert main(["export", "gguf", str(run), "--adapter"]) == 2
    assert "adapts the audio tower (lora.freeze_audio_tower: false), which a GGUF adapter cannot carry" in \
        capsys.readouterr().err


@pytest.mark.slow
def test_planner_prices_what_an_adapted_audio_tower_keeps_per_token(checkpoint_of, tmp_path: Path) -> None:
    """The plan's bytes per audio token (a probe of the tower alone on a 30 s clip) against a real training forward of
    the tiny checkpoint with tower and projector adapted: a conversation with a 12 s clip, minus the same tokens
    without its features. A frozen sound path keeps nothing."""
    from transformers import AutoConfig

    from gemmaforge.models import resolve_model
    from gemmaforge.senses import Senses
    from gemmaforge.train.collate import MediaBatches, RightPadCollator, tokenize_conversations
    from gemmaforge.train.tower_activations import bytes_per_audio_token
    from gemmaforge.train.wrapping import build_peft_model
    from tests.helpers import run_config
    from tests.tensor_memory import saved_bytes

    model_dir = checkpoint_of("gemma4-e2b")
    spec, tokenizer = read_spec(model_dir), load_tokenizer(model_dir)
    senses = Senses.of(model_dir, spec, tokenizer)
    (tmp_path / "long.wav").write_bytes(encoded(tone(12.0, 500)))
    rows, _ = tokenize_conversations(
        [[{"role": "user", "content": spec.family.chat.audio + "Which pitch?"}, {"role": "assistant", "content": "x"}]],
        tokenizer, spec.family, 4096, "test", audios=[[tmp_path / "long.wav"]], senses=senses)
    batch = MediaBatches(RightPadCollator(tokenizer.pad_token_id), senses)(rows)
    tokens = rows[0]["input_ids"].count(senses.audio.audio_token_id)
    adapted = run_config(model={"name_or_path": str(model_dir)}, train={"packing": False},
                         lora={"target_modules": "all-linear", "freeze_audio_tower": False,
                               "freeze_audio_projector": False})
    model = build_peft_model(adapted, resolve_model(str(model_dir), tmp_path), tokenizer, "fp32")
    without = {k: v for k, v in batch.items() if k not in ("input_features", "input_features_mask")}
    measured = saved_bytes(model, batch) - saved_bytes(model, without)
    config = AutoConfig.from_pretrained(model_dir)
    planned = tokens * bytes_per_audio_token(config, model_dir, spec.family, adapted, torch.float32)
    print(f"per {tokens} audio tokens: planned {planned:,.0f} bytes, measured {measured:,}")
    assert tokens == 300 and measured > 0 and abs(planned / measured - 1) < 0.05, (planned, measured)
    frozen = run_config(model={"name_or_path": str(model_dir)})
    assert bytes_per_audio_token(config, model_dir, spec.family, frozen, torch.float32) == 0.0


@pytest.mark.slow
def test_adapting_the_audio_path_of_a_model_without_one_is_refused(checkpoint_of, tmp_path: Path, capsys) -> None:
    from tests.helpers import write_dataset

    config = tmp_path / "run.yaml"
    config.write_text(json.dumps({
        "output_dir": str(tmp_path / "run"), "model": {"name_or_path": str(checkpoint_of("gemma4-dense"))},
        "data": {"path": str(write_dataset(tmp_path / "data.json", 8))},
        "lora": {"freeze_audio_tower": False}, "train": {"max_steps": 1}}))
    assert main(["train", str(config)]) == 2
    assert "lora.freeze_audio_tower: false, but Gemma4ForConditionalGeneration has no audio tower" in \
        capsys.readouterr().err
