"""A visual signature task (a picture's colour -> its name) that the tiny checkpoint of each multimodal kind learns
through `gemmaforge run`: the base fails it, the tuned model passes on pictures it never saw, in transformers and in
llama.cpp with the exported GGUF and projector."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from tests.image_helpers import COLOURS, KINDS, QUESTION, learned_signature, picture, trained_scale_copy

STEPS = {"gemma3-mm": 200, "gemma4-moe": 200}  # these two learn it later than E2B and 31B, which pass at 100
# (fp32: in bf16 Gemma 3 named one of the six held-out pictures wrongly on an AVX512-BF16 host where an AMX host named
# all six)


@pytest.mark.integration
@pytest.mark.parametrize("kind", KINDS)
def test_visual_signature_is_learned_and_kept_in_gguf(kind: str, checkpoint_of, tmp_path: Path) -> None:
    """A folder of pictures with a file_name JSONL (and text records mixed in) -> `gemmaforge run` -> eval on six
    pictures never seen, in a suite of `image:` cases: the base names none of their colours, the tuned model (the
    adapter in transformers) names all six, and so does llama.cpp with the exported GGUF and projector, word for
    word."""
    model = trained_scale_copy(checkpoint_of(kind), tmp_path / "model")
    rng = np.random.default_rng(0)
    data = tmp_path / "data"
    data.mkdir()
    rows = []
    for i in range(36):
        name = list(COLOURS)[i % 3]
        picture(COLOURS[name], rng).save(data / f"{i}.png")
        rows.append({"file_name": f"{i}.png", "instruction": QUESTION, "output": name})
    rows += [{"instruction": f"Say the number {i}.", "output": str(i)} for i in range(6)]
    (data / "metadata.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "held-out").mkdir()
    cases = []
    for name, colour in COLOURS.items():
        for j in range(2):
            picture(colour, rng).save(tmp_path / "held-out" / f"{name}{j}.png")
            cases.append({"prompt": QUESTION, "image": f"held-out/{name}{j}.png", "checks": [{"regex": f"^{name}$"}]})
    learned_signature(tmp_path, model, data, cases, STEPS.get(kind, 100))
