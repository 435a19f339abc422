"""`gemmaforge run` on the tiny checkpoint of every multimodal kind (tests/checkpoint_kinds.py): a text dataset
trains LoRA on the language model, the merged folder is the whole checkpoint (towers byte for byte, processor
files, the architecture) and still takes an image, and llama.cpp computes what the merged model computes
from the text GGUF."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import safe_open

from gemmaforge.cli import main
from gemmaforge.model_spec import read_spec, text_weight_name
from tests.helpers import write_config
from tests.integration.test_llama_cpp_gguf import PROMPT, load, relative_error

pytestmark = pytest.mark.integration

MULTIMODAL = ("gemma3-mm", "gemma4-e2b", "gemma4-moe", "gemma4-dense")
PROCESSOR_FILES = ("preprocessor_config.json", "processor_config.json")


def tensors(folder: Path) -> dict[str, torch.Tensor]:
    out = {}
    for path in sorted(folder.glob("*.safetensors")):
        with safe_open(path, framework="pt") as f:
            out.update({name: f.get_tensor(name) for name in f.keys()})  # noqa: SIM118 (not iterable)
    return out


@pytest.fixture(scope="module", params=MULTIMODAL)
def trained(request: pytest.FixtureRequest, checkpoint_of, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path, Path]:
    kind = request.param
    checkpoint = checkpoint_of(kind)
    tmp = tmp_path_factory.mktemp(f"run-{kind}")
    config = write_config(tmp, checkpoint, max_steps=2, save_steps=2)
    overrides = ["export.gguf=[f16]", "eval.retention=false", "eval.num_samples=2", "eval.max_new_tokens=8"]
    assert main(["run", str(config), *overrides]) == 0
    return kind, checkpoint, tmp / "run"


def test_merged_is_the_whole_checkpoint_with_towers_unchanged(trained) -> None:
    kind, checkpoint, run = trained
    merged = run / "merged"
    spec, merged_spec = read_spec(checkpoint), read_spec(merged)
    assert merged_spec.architecture == spec.architecture and merged_spec.towers == spec.towers
    for name in PROCESSOR_FILES:
        if (checkpoint / name).is_file():
            assert (merged / name).read_bytes() == (checkpoint / name).read_bytes(), name
    before, after = tensors(checkpoint), tensors(merged)
    towers = [name for name in before if text_weight_name(spec, name) is None]
    # every tower tensor is kept; of the language model, Gemma 4's KV-shared layers carry k/v projections on the Hub
    # that no computation reads and transformers does not load, so the merged folder has no copy of them
    assert towers and set(towers) <= set(after) and set(after) <= set(before)
    for name in towers:
        assert after[name].dtype == before[name].dtype and torch.equal(after[name], before[name]), name
    adapted = [n for n in before if n.endswith("q_proj.weight") and text_weight_name(spec, n) is not None]
    assert adapted and not any(torch.equal(after[n], before[n]) for n in adapted)  # the LoRA delta was merged


def test_merged_reloads_and_an_image_still_goes_through(trained) -> None:
    """The merged folder's image processor (PIL backend: Gemma 4's full processor also wants torchvision for
    video) and model take an image, placed as the processors place it: <boi>, one placeholder per soft token, <eoi>."""
    from PIL import Image
    from transformers import AutoImageProcessor, AutoModelForImageTextToText

    _, _, run = trained
    merged = run / "merged"
    spec = read_spec(merged)
    image = Image.fromarray(np.random.default_rng(0).integers(0, 255, (48, 64, 3), dtype=np.uint8))
    images = AutoImageProcessor.from_pretrained(merged, backend="pil")(images=[image], return_tensors="pt")
    config = json.loads((merged / "config.json").read_text())
    soft_tokens = int(images.pop("num_soft_tokens_per_image")[0]) if "num_soft_tokens_per_image" in images \
        else config["mm_tokens_per_image"]  # Gemma 4 sizes by the image, Gemma 3 has a fixed count
    ids = spec.token_ids
    input_ids = torch.tensor([[2, ids["boi_token_id"], *[ids["image_token_id"]] * soft_tokens, ids["eoi_token_id"], 9413]])
    model = AutoModelForImageTextToText.from_pretrained(merged, dtype=torch.float32).eval()
    with torch.no_grad():
        with_image = model(input_ids=input_ids, **images).logits
        without = model(input_ids=input_ids).logits
    assert torch.isfinite(with_image).all()
    assert not torch.allclose(with_image[0, -1], without[0, -1])  # the image reached the answer


def test_llama_cpp_computes_what_the_merged_model_computes(trained) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    kind, _, run = trained
    merged = run / "merged"
    tokens = AutoTokenizer.from_pretrained(merged)(PROMPT, add_special_tokens=False).input_ids
    model = AutoModelForCausalLM.from_pretrained(merged, dtype=torch.float32).eval()
    with torch.no_grad():
        want = model(torch.tensor([tokens])).logits[0].numpy()
    error = relative_error(load(run / "gguf" / "model-f16.gguf", logits_all=True), tokens, want)
    print(f"{kind}: f16 GGUF logits relative error {error:.2e}")
    assert error < 5e-3
    modelfile = (run / "ollama" / "Modelfile").read_text().splitlines()
    froms = [line for line in modelfile if line.startswith("FROM ")]
    assert froms == ["FROM ../gguf/model-f16.gguf", "FROM ../gguf/mmproj-f16.gguf"]  # text, then the projector
    assert (run / "gguf" / "mmproj-f16.gguf").is_file()
    assert json.loads((run / "manifest.json").read_text())["stages"]["export_gguf"]["status"] == "done"
