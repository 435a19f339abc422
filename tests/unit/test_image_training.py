"""Training on images (Gemma 3 and Gemma 4 tiny checkpoints of the real structure): image tokens as the processor
writes them and never supervised, the vision tower run on every batch with images and frozen, batches that mix
text and image records, and a visual signature task (a picture's colour -> its name) that the base model fails
and the tuned one passes on pictures it never saw."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from gemmaforge.cli import main
from gemmaforge.model_spec import read_spec
from gemmaforge.models import load_tokenizer
from gemmaforge.templates import IGNORE_INDEX
from gemmaforge.train.collate import ImageBatches, RightPadCollator, tokenize_conversations
from gemmaforge.vision import ImagePrompt
from tests.helpers import run_config

KINDS = ["gemma3-mm", "gemma4-e2b"]
COLOURS = {"red": (220, 30, 30), "green": (30, 200, 40), "blue": (30, 40, 220)}
QUESTION = "Which colour is this picture?"
FINAL_NORMS = ("language_model.norm.weight", "language_model.model.norm.weight")  # Gemma 4's, Gemma 3's hub name


def picture(colour: tuple[int, int, int], rng: np.random.Generator) -> Image.Image:
    """A noisy picture of one colour, of a random size (Gemma 4 gives each size its own token count)."""
    width, height = (int(n) for n in rng.integers(40, 120, 2))
    return Image.fromarray(np.clip(np.array(colour) + rng.normal(0, 25, (height, width, 3)), 0, 255).astype("uint8"))


def trained_scale_copy(source: Path, target: Path) -> Path:
    """The checkpoint with its final norm at a trained model's scale. Drawn at random it leaves the logits below 1
    over a 262k vocabulary, where no answer can ever be the most likely token (real Gemma checkpoints' final norms
    are tens, see tests/unit/test_loss_families.py)."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(source, target)
    scaled = []
    for file in target.glob("*.safetensors"):
        tensors = load_file(file)
        for key in [k for k in tensors if k.endswith(FINAL_NORMS)]:
            tensors[key] = torch.full_like(tensors[key], 30.0)
            scaled.append(key)
        save_file(tensors, file, metadata={"format": "pt"})
    assert len(scaled) == 1, scaled
    return target


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
    (tmp_path / "suite.yaml").write_text(json.dumps({"cases": cases}))  # JSON is YAML
    config = tmp_path / "run.yaml"
    config.write_text(json.dumps({
        "output_dir": str(tmp_path / "run"), "model": {"name_or_path": str(model)},
        "data": {"path": str(data), "val_size": 3},
        "lora": {"r": 8, "lora_alpha": 16, "target_modules": "all-linear"},
        "train": {"max_steps": 200, "per_device_train_batch_size": 4, "learning_rate": 5e-3, "cutoff_len": 1024,
                  "logging_steps": 10, "save_steps": 1000, "seed": 1},
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
    assert sorted(p.name for p in (tmp_path / "run" / "gguf").glob("mmproj*.gguf")) == ["mmproj-f16.gguf"]


def examples(kind: str, checkpoint_of, tmp_path: Path, train_on_prompt: bool = False):
    """A text conversation and two with a picture each (two sizes), tokenized as training does."""
    model = checkpoint_of(kind)
    spec, tokenizer = read_spec(model), load_tokenizer(model)
    vision = ImagePrompt.load(model, spec, tokenizer)
    rng = np.random.default_rng(1)
    paths = []
    for i, colour in enumerate([(200, 0, 0), (0, 0, 200)]):
        paths.append(tmp_path / f"{i}.png")
        picture(colour, rng).save(paths[-1])
    conversations = [[{"role": "user", "content": "Hello"}, {"role": "assistant", "content": "Hi"}]] + [
        [{"role": "user", "content": spec.family.chat.image + QUESTION}, {"role": "assistant", "content": "a colour"}]
        for _ in paths]
    rows, dropped = tokenize_conversations(conversations, tokenizer, spec.family, 1024, "test",
                                           train_on_prompt=train_on_prompt, images=[[], [paths[0]], [paths[1]]],
                                           vision=vision)
    assert dropped == 0
    return model, spec, tokenizer, vision, rows


@pytest.mark.parametrize("kind", KINDS)
def test_image_tokens_are_the_processors_and_never_supervised(kind: str, checkpoint_of, tmp_path: Path) -> None:
    _, _, tokenizer, vision, rows = examples(kind, checkpoint_of, tmp_path, train_on_prompt=True)
    image_ids = vision.image_token_ids(tokenizer)
    for row in rows[1:]:
        sizes = [Image.open(p).size for p in row["images"]]
        assert sum(t == vision.image_token_id for t in row["input_ids"]) == sum(vision.soft_token_counts(sizes))
        assert all(label == IGNORE_INDEX for t, label in zip(row["input_ids"], row["labels"]) if t in image_ids)
        assert sum(label != IGNORE_INDEX for label in row["labels"]) > 10  # the prompt's text is trained here


def test_gemma4_token_counts_follow_the_image_processor(checkpoint_of) -> None:
    model = checkpoint_of("gemma4-e2b")
    vision = ImagePrompt.load(model, read_spec(model), load_tokenizer(model))
    from transformers import AutoImageProcessor

    processor = AutoImageProcessor.from_pretrained(model)
    sizes = [(64, 48), (40, 300), (1000, 30), (17, 17), (900, 900)]
    counts = processor(images=[Image.new("RGB", s) for s in sizes], return_tensors="pt")["num_soft_tokens_per_image"]
    assert vision.soft_token_counts(sizes) == counts.tolist() and len(set(counts.tolist())) > 1


def test_a_cutoff_inside_an_image_drops_the_example(checkpoint_of, tmp_path: Path) -> None:
    model = checkpoint_of("gemma3-mm")
    spec, tokenizer = read_spec(model), load_tokenizer(model)
    picture((1, 2, 3), np.random.default_rng(0)).save(tmp_path / "a.png")
    conversation = [{"role": "user", "content": spec.family.chat.image + QUESTION},
                    {"role": "assistant", "content": "x"}]
    rows, dropped = tokenize_conversations([conversation], tokenizer, spec.family, 8, "test", train_on_prompt=True,
                                           images=[[tmp_path / "a.png"]],
                                           vision=ImagePrompt.load(model, spec, tokenizer))
    assert rows == [] and dropped == 1


@pytest.mark.parametrize("kind", KINDS)
def test_mixed_batch_runs_the_frozen_tower_and_its_pixels_matter(kind: str, checkpoint_of, tmp_path: Path) -> None:
    from gemmaforge.models import resolve_model
    from gemmaforge.train.wrapping import build_peft_model

    model_dir, spec, tokenizer, vision, rows = examples(kind, checkpoint_of, tmp_path)
    config = run_config(model={"name_or_path": str(model_dir)}, lora={"target_modules": "all-linear"},
                        train={"packing": False})
    model = build_peft_model(config, resolve_model(str(model_dir), tmp_path), tokenizer, "fp32")
    tower = model.get_base_model().model.vision_tower
    calls = []
    tower.register_forward_hook(lambda *_: calls.append(1))
    collate = ImageBatches(RightPadCollator(tokenizer.pad_token_id), vision)
    batch = collate(rows[:2])  # a text conversation beside one with a picture
    loss = model(**batch).loss
    loss.backward()
    assert calls, "the vision tower never ran"
    assert not any(p.requires_grad for p in tower.parameters())  # frozen: no LoRA, no gradient
    assert all(p.grad is not None for n, p in model.named_parameters() if p.requires_grad and "lora_" in n)
    with torch.no_grad():  # the same tokens with the picture's negative: another picture, another loss
        assert not torch.isclose(model(**{**batch, "pixel_values": -batch["pixel_values"]}).loss, loss.detach())


TOWER_K = {"gemma3-mm": "vision_tower.vision_model.encoder.layers.0.self_attn.k_proj.weight",
           "gemma4-e2b": "model.vision_tower.encoder.layers.0.self_attn.k_proj.linear.weight"}  # hub names


@pytest.mark.integration
@pytest.mark.parametrize("kind", KINDS)
def test_adapted_tower_and_projector_reach_the_merged_model_and_projector_gguf(kind: str, checkpoint_of,
                                                                                tmp_path: Path, capsys) -> None:
    """lora.freeze_vision_tower / freeze_multi_modal_projector false: LoRA on the tower's linear layers, the
    projector trained in full; merge keeps both, `export gguf`'s projector file carries the merged tower, and a
    GGUF adapter (which cannot carry them) is refused."""
    from gguf import GGUFReader
    from safetensors import safe_open

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
    adapter = json.loads((run / "adapter" / "adapter_config.json").read_text())
    projector = {"gemma3-mm": "model.multi_modal_projector", "gemma4-e2b": "model.embed_vision"}[kind]
    assert adapter["modules_to_save"] == [projector] and "model\\.vision_tower" in adapter["target_modules"]
    assert main(["merge", str(run)]) == 0 and main(["export", "gguf", str(run)]) == 0

    def tensor(folder: Path, name: str) -> np.ndarray:
        for file in folder.glob("*.safetensors"):
            with safe_open(file, "pt") as f:
                if name in f.keys():
                    return f.get_tensor(name).float().numpy()
        raise KeyError(name)

    before, merged = tensor(base, TOWER_K[kind]), tensor(run / "merged", TOWER_K[kind])
    (written,) = [t for t in GGUFReader(run / "gguf" / "mmproj-f16.gguf").tensors if t.name == "v.blk.0.attn_k.weight"]
    in_gguf = np.asarray(written.data, dtype=np.float32).reshape(merged.shape)
    assert np.abs(merged - before).max() > 1e-3  # training moved the tower
    assert np.allclose(in_gguf, merged, atol=1e-3) and not np.allclose(in_gguf, before, atol=1e-3)
    capsys.readouterr()
    assert main(["export", "gguf", str(run), "--adapter"]) == 2
    assert "adapts the vision tower (lora.freeze_vision_tower: false), which a GGUF adapter cannot carry" in \
        capsys.readouterr().err


def test_adapting_a_vision_part_of_a_text_model_is_refused(tiny_gemma3_dir: Path, tmp_path: Path, capsys) -> None:
    from tests.helpers import write_dataset

    config = tmp_path / "run.yaml"
    config.write_text(json.dumps({
        "output_dir": str(tmp_path / "run"), "model": {"name_or_path": str(tiny_gemma3_dir)},
        "data": {"path": str(write_dataset(tmp_path / "data.json", 8))},
        "lora": {"freeze_multi_modal_projector": False}, "train": {"max_steps": 1}}))
    assert main(["train", str(config)]) == 2
    assert "lora.freeze_multi_modal_projector: false, but Gemma3ForCausalLM has no vision projector" in \
        capsys.readouterr().err


def saved_bytes(model, batch: dict) -> int:
    """What autograd keeps in one training forward (distinct storages, parameters not counted)."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}
    held: list = []

    def keep(tensor):
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in params:
            seen.setdefault(storage.data_ptr(), storage.nbytes())
        held.append(tensor)
        return len(held) - 1

    with torch.autograd.graph.saved_tensors_hooks(keep, held.__getitem__):
        model(**batch)
    held.clear()
    return sum(seen.values())


@pytest.mark.parametrize("kind", KINDS)
def test_planner_prices_what_an_adapted_tower_keeps_per_picture(kind: str, checkpoint_of, tmp_path: Path) -> None:
    """The plan's bytes per picture (a probe of the tower alone) against a real training forward of the tiny
    checkpoint with tower and projector adapted: a conversation with the largest picture, minus the same tokens
    without its pixels. A frozen image path keeps nothing."""
    from transformers import AutoConfig

    from gemmaforge.models import resolve_model
    from gemmaforge.train.vision_activations import LARGEST_PICTURE, bytes_per_picture
    from gemmaforge.train.wrapping import build_peft_model

    model_dir = checkpoint_of(kind)
    spec, tokenizer = read_spec(model_dir), load_tokenizer(model_dir)
    vision = ImagePrompt.load(model_dir, spec, tokenizer)
    Image.new("RGB", LARGEST_PICTURE, (90, 20, 200)).save(tmp_path / "big.png")
    rows, _ = tokenize_conversations(
        [[{"role": "user", "content": spec.family.chat.image + QUESTION}, {"role": "assistant", "content": "x"}]],
        tokenizer, spec.family, 4096, "test", images=[[tmp_path / "big.png"]], vision=vision)
    batch = ImageBatches(RightPadCollator(tokenizer.pad_token_id), vision)(rows)
    adapted = run_config(model={"name_or_path": str(model_dir)}, train={"packing": False},
                         lora={"target_modules": "all-linear", "freeze_vision_tower": False,
                               "freeze_multi_modal_projector": False})
    model = build_peft_model(adapted, resolve_model(str(model_dir), tmp_path), tokenizer, "fp32")
    without = {k: v for k, v in batch.items() if k not in ("pixel_values", "image_position_ids")}
    measured = saved_bytes(model, batch) - saved_bytes(model, without)
    config = AutoConfig.from_pretrained(model_dir)
    planned = bytes_per_picture(config, model_dir, spec.family, adapted, torch.float32)
    assert measured > 0 and abs(planned / measured - 1) < 0.2, (planned, measured)
    frozen = run_config(model={"name_or_path": str(model_dir)})
    assert bytes_per_picture(config, model_dir, spec.family, frozen, torch.float32) == 0.0
