"""A sound signature task (a tone's pitch -> its name) that the tiny Gemma 4 E2B checkpoint learns through
`gemmaforge run`: the base fails it, the tuned model passes on clips it never heard, in transformers and in llama.cpp
with the exported GGUF and projector (its audio encoder through mtmd)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from tests.image_helpers import learned_signature, trained_scale_copy

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
    results = learned_signature(tmp_path, model, data, cases, steps=100)
    assert [case["audios"] for case in results["cases"]] == [[str(tmp_path / c["audio"])] for c in cases]
