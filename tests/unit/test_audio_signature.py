"""A sound signature task (a tone's pitch -> its name) that the tiny Gemma 4 E2B checkpoint learns through
`gemmaforge run`: the base fails it, the tuned model passes on clips it never heard, in transformers and in llama.cpp
with the exported GGUF and projector (its audio encoder through mtmd)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from gemmaforge.cli import main
from tests.image_helpers import trained_scale_copy

PITCHES = {"low": 200.0, "middle": 800.0, "high": 3200.0}  # Hz: each two octaves apart
QUESTION = "Which pitch is this sound?"


def tone(hz: float, rng: np.random.Generator) -> np.ndarray:
    """A tone of random length (0.4 to 1.6 s: 10 to 40 audio tokens), loudness and phase: only the pitch tells the
    answer."""
    seconds, loudness, phase = rng.uniform(0.4, 1.6), rng.uniform(0.05, 0.5), rng.uniform(0, 2 * np.pi)
    t = np.arange(int(seconds * 16_000)) / 16_000
    return (loudness * np.sin(2 * np.pi * hz * t + phase)).astype(np.float32)


@pytest.mark.integration
def test_sound_signature_is_learned_and_kept_in_gguf(checkpoint_of, tmp_path: Path) -> None:
    """A folder of clips with a file_name JSONL (audiofolder, text records mixed in) -> `gemmaforge run` -> eval on six
    clips never heard, in a suite of `audio:` cases: the base names none of their pitches, the tuned model (the
    adapter in transformers) names all six, and so does llama.cpp with the exported GGUF and projector, word for
    word."""
    import soundfile

    model = trained_scale_copy(checkpoint_of("gemma4-e2b"), tmp_path / "model")
    rng = np.random.default_rng(0)
    data = tmp_path / "data"
    data.mkdir()
    rows = []
    for i in range(36):
        name = list(PITCHES)[i % 3]
        soundfile.write(data / f"{i}.wav", tone(PITCHES[name], rng), 16_000)
        rows.append({"file_name": f"{i}.wav", "instruction": QUESTION, "output": name})
    rows += [{"instruction": f"Say the number {i}.", "output": str(i)} for i in range(6)]
    (data / "metadata.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "held-out").mkdir()
    cases = []
    for name, hz in PITCHES.items():
        for j in range(2):
            soundfile.write(tmp_path / "held-out" / f"{name}{j}.wav", tone(hz, rng), 16_000)
            cases.append({"prompt": QUESTION, "audio": f"held-out/{name}{j}.wav", "checks": [{"regex": f"^{name}$"}]})
    (tmp_path / "suite.yaml").write_text(json.dumps({"cases": cases}))  # JSON is YAML
    config = tmp_path / "run.yaml"
    config.write_text(json.dumps({
        "output_dir": str(tmp_path / "run"), "model": {"name_or_path": str(model)},
        "data": {"path": str(data), "val_size": 3},
        "lora": {"r": 8, "lora_alpha": 16, "target_modules": "all-linear"},
        "train": {"max_steps": 100, "per_device_train_batch_size": 4, "learning_rate": 5e-3, "cutoff_len": 1024,
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
    assert [case["audios"] for case in results["cases"]] == [[str(tmp_path / c["audio"])] for c in cases]
