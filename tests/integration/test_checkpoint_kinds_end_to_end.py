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
from gemmaforge.gguf_file import read_gguf
from gemmaforge.model_spec import read_spec, text_weight_name
from gemmaforge.vision_unified import UnifiedImageProcessor
from tests.helpers import reference_answer, write_config
from tests.llama_cpp_checks import PROMPT, greedy, load, relative_error

pytestmark = pytest.mark.integration

MULTIMODAL = ("gemma3-mm", "gemma4-e2b", "gemma4-moe", "gemma4-dense", "gemma4-unified")
PROCESSOR_FILES = ("preprocessor_config.json", "processor_config.json")


def tensors(folder: Path) -> dict[str, torch.Tensor]:
    out = {}
    for path in sorted(folder.glob("*.safetensors")):
        with safe_open(path, framework="pt") as f:
            out.update({name: f.get_tensor(name) for name in f.keys()})  # noqa: SIM118 (not iterable)
    return out


@pytest.fixture(scope="module", params=MULTIMODAL)
def trained(request: pytest.FixtureRequest, checkpoint_of,
            tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path, Path]:
    kind = request.param
    checkpoint = checkpoint_of(kind)
    tmp = tmp_path_factory.mktemp(f"run-{kind}")
    config = write_config(tmp, checkpoint, max_steps=2, save_steps=2)
    overrides = ["export.gguf=[f16]", "eval.enabled=false"]  # eval runs in tests/unit/test_image_signature.py
    if kind == "gemma4-moe":  # expert LoRA beside the default attention LoRA (write_config has no dropout)
        overrides.append("lora.target_parameters=[experts.gate_up_proj,experts.down_proj]")
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
    adapted = [n for n in before if n.endswith(("q_proj.weight", "experts.gate_up_proj", "experts.down_proj"))
               and text_weight_name(spec, n) is not None]
    assert adapted and not any(torch.equal(after[n], before[n]) for n in adapted)  # the LoRA deltas were merged
    assert any("experts" in n for n in adapted) == (kind == "gemma4-moe")
    # and the training chat template: the merged tokenizer renders a training conversation as training did
    from transformers import AutoTokenizer


    messages = json.loads((run / "data" / "train.jsonl").read_text(encoding="utf-8").splitlines()[0])["messages"]
    assert AutoTokenizer.from_pretrained(merged).apply_chat_template(messages, tokenize=False) == \
        merged_spec.family.chat.render(messages).text


def test_merged_computes_what_base_plus_adapter_computes(trained) -> None:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    _, checkpoint, run = trained
    tokens = torch.tensor([[2, 9413, 563, 1694, 5192, 236881, 107]])
    with torch.no_grad():
        merged = AutoModelForCausalLM.from_pretrained(run / "merged", dtype=torch.float32).eval()(tokens).logits
        base = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
        unmerged = PeftModel.from_pretrained(base, run / "adapter").eval()(tokens).logits
    torch.testing.assert_close(merged, unmerged, rtol=1e-4, atol=1e-4)


def test_merged_reloads_and_an_image_still_goes_through(trained) -> None:
    """The merged folder's image processor (PIL backend: Gemma 4's full processor also wants torchvision for
    video; Gemma 4 Unified's, torchvision only, as gemmaforge/vision_unified.py computes it) and model take an image,
    placed as the processors place it: <boi>, one placeholder per soft token, <eoi>."""
    from PIL import Image
    from transformers import AutoImageProcessor, AutoModelForImageTextToText

    kind, _, run = trained
    merged = run / "merged"
    spec = read_spec(merged)
    image = Image.fromarray(np.random.default_rng(0).integers(0, 255, (48, 64, 3), dtype=np.uint8))
    if kind == "gemma4-unified":
        images = UnifiedImageProcessor.load(merged)(images=[image])
    else:
        images = AutoImageProcessor.from_pretrained(merged, backend="pil")(images=[image], return_tensors="pt")
    config = json.loads((merged / "config.json").read_text())
    soft_tokens = int(images.pop("num_soft_tokens_per_image")[0]) if "num_soft_tokens_per_image" in images \
        else config["mm_tokens_per_image"]  # Gemma 4 sizes by the image, Gemma 3 has a fixed count
    ids = spec.token_ids
    input_ids = torch.tensor([[2, ids["boi_token_id"], *[ids["image_token_id"]] * soft_tokens,
                               ids["eoi_token_id"], 9413]])
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
    modelfile = (run / "ollama" / "Modelfile").read_text()
    froms = [line for line in modelfile.splitlines() if line.startswith("FROM ")]
    assert froms == ["FROM ../gguf/model-f16.gguf", "FROM ../gguf/mmproj-f16.gguf"]  # text, then the projector
    # the Ollama that imports the pair, as docs/checkpoint-kinds.md says: Gemma 3's from 0.11.11, Gemma 4's from 0.30.0
    needed = "0.11.11" if kind.startswith("gemma3") else "0.30.0"
    assert f"# Images: the second FROM is the vision projector; Ollama >= {needed} imports it" in modelfile
    # Gemma 4: Ollama's own renderer and parser (the official template: tools, thinking) instead of a TEMPLATE
    assert ("\nRENDERER gemma4-small\nPARSER gemma4\n" in modelfile) == kind.startswith("gemma4")
    assert ("\nTEMPLATE " in modelfile) == kind.startswith("gemma3")
    assert (run / "gguf" / "mmproj-f16.gguf").is_file()
    assert json.loads((run / "manifest.json").read_text())["stages"]["export_gguf"]["status"] == "done"
    if kind == "gemma4-unified":  # the merged generation_config.json keeps suppress_tokens, and the text file has them
        assert json.loads((merged / "generation_config.json").read_text())["suppress_tokens"] == [258883, 258882]
        suppress = read_gguf(run / "gguf" / "model-f16.gguf").fields["tokenizer.ggml.suppress_tokens"]
        assert suppress.value == [258883, 258882]


def test_serve_answers_from_the_run_and_its_gguf(trained) -> None:
    """`gemmaforge serve` on the run (base + adapter, transformers) and on its text GGUF (llama.cpp), asked
    through the official ollama client: the adapter's answer is PEFT's own greedy generation."""
    import ollama

    _, _, run = trained
    from gemmaforge.models import default_home
    from gemmaforge.serve.server import ServeOptions, background_server, load_registry

    options = ServeOptions(max_batch=4, max_queue=8, dtype="fp32")
    registry = load_registry([f"tuned={run}", f"gguf={run / 'gguf' / 'model-f16.gguf'}"], options, default_home())
    messages = [{"role": "user", "content": "What is a flat white?"}]
    try:
        with background_server(registry, options) as url:
            client = ollama.Client(host=url)
            tuned = client.chat(model="tuned", messages=messages, options={"temperature": 0, "num_predict": 8})
            assert tuned.message.content == reference_answer(registry, "tuned", messages, 8)
            gguf = client.chat(model="gguf", messages=messages, options={"temperature": 0, "num_predict": 8})
            assert gguf.message.content == gguf_reference_answer(registry, messages, 8, run / "merged")
    finally:
        registry.close()


def gguf_reference_answer(registry, messages: list[dict[str, str]], n: int, merged: Path) -> str:
    """llama.cpp's own greedy continuation of the "gguf" model's served prompt, as the merged folder's tokenizer
    encodes it, up to a stop token."""
    from transformers import AutoTokenizer

    from gemmaforge.serve.protocol import chat_prompt

    served = registry.get("gguf")
    ids = AutoTokenizer.from_pretrained(merged)(chat_prompt(served, messages), add_special_tokens=False).input_ids
    tokens = greedy(load(served.engine.path, logits_all=True), ids, n)
    kept = tokens[:next((i for i, t in enumerate(tokens) if t in served.engine.stops), n)]
    return served.engine.llm.detokenize(kept).decode()


def test_export_gguf_of_a_multimodal_folder_writes_text_and_projector(checkpoint_of, text_gguf_of, mmproj_of,
                                                                      tmp_path: Path) -> None:
    """`gemmaforge export gguf PATH` on a Hugging Face folder not trained here, as downloaded from the Hub: its text
    file and its projector carry the tensors (names, types, data) of the files the exporter writes for the same
    checkpoint, named after the folder."""
    import shutil

    folder = shutil.copytree(checkpoint_of("gemma3-mm"), tmp_path / "gemma-3-4b-it")
    assert main(["export", "gguf", str(folder)]) == 0
    pairs = ((folder / "gemma-3-4b-it-f16.gguf", text_gguf_of("gemma3-mm")),
             (folder / "mmproj-gemma-3-4b-it-f16.gguf", mmproj_of("gemma3-mm")))
    for path, reference in pairs:
        ours, theirs = read_gguf(path), read_gguf(reference)
        assert [(t.name, t.tensor_type) for t in ours.tensors] == [(t.name, t.tensor_type) for t in theirs.tensors]
        for mine, want in zip(ours.tensors, theirs.tensors):
            assert np.array_equal(mine.data, want.data), mine.name


def test_moe_goes_through_the_k_quantizer(text_gguf_of, tmp_path: Path) -> None:
    """26B-A4B's experts through llama.cpp's own quantizer (q4_k_m), the router kept exact, the file loaded."""
    from gemmaforge.export.quantize import llama_cpp_quantize

    quantized = llama_cpp_quantize(text_gguf_of("gemma4-moe"), tmp_path / "model-q4_k_m.gguf", "q4_k_m")
    types = {t.name: t.tensor_type.name for t in read_gguf(quantized).tensors}
    assert types["blk.0.ffn_gate_inp.weight"] == "F32"  # the router stays exact, as llama.cpp keeps it
    assert len(greedy(load(quantized), [2, 9413, 563, 1694, 5192], 4)) == 4


def test_export_vllm_serves_the_merged_folder_and_names_what_an_adapter_lacks(trained, capsys) -> None:
    kind, _, run = trained
    assert main(["export", "vllm", str(run)]) == 0
    assert str((run / "merged").resolve()) in (run / "vllm" / "serve.sh").read_text()
    # these runs train the chat-marker rows (the default), and the MoE run its experts: neither has a vLLM LoRA form
    assert main(["export", "vllm", str(run), "--adapter"]) == 2
    reason = "adapts expert weights" if kind == "gemma4-moe" else "trains the chat-marker embedding rows"
    assert reason in capsys.readouterr().err
