"""Training on images (Gemma 3 and Gemma 4 tiny checkpoints of the real structure): image tokens as the processor
writes them and never supervised, the vision tower run on every batch with images and frozen, batches that mix
text and image records, and the memory planner's price of an adapted tower per picture."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from gemmaforge.chat.conversation import IGNORE_INDEX
from gemmaforge.model_spec import read_spec
from gemmaforge.models import load_tokenizer
from gemmaforge.senses import Senses
from gemmaforge.train.collate import MediaBatches, RightPadCollator, tokenize_conversations
from gemmaforge.vision import ImagePrompt
from tests.helpers import run_config
from tests.image_helpers import KINDS, QUESTION, TOWER_KINDS, picture
from tests.tensor_memory import saved_bytes


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
                                           senses=Senses(vision))
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


@pytest.mark.parametrize("kind", KINDS)
def test_prompt_tokens_counts_what_pictures_add_to_a_prompt(kind: str, checkpoint_of, tmp_path: Path) -> None:
    """What eval sizes its context by: the tokens a conversation's pictures add, frame included, against the
    tokenized difference with and without them: never fewer, and at most a merged margin per picture more."""
    _, spec, tokenizer, vision, rows = examples(kind, checkpoint_of, tmp_path)
    without = tokenize_conversations(
        [[{"role": "user", "content": QUESTION}, {"role": "assistant", "content": "a colour"}]],
        tokenizer, spec.family, 1024, "test")[0][0]
    for row in rows[1:]:
        sizes = [Image.open(p).size for p in row["images"]]
        added = len(row["input_ids"]) - len(without["input_ids"])
        assert added > sum(vision.soft_token_counts(sizes))
        assert added <= vision.prompt_tokens(sizes, tokenizer) <= added + len(sizes)


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
                                           senses=Senses(ImagePrompt.load(model, spec, tokenizer)))
    assert rows == [] and dropped == 1


@pytest.mark.parametrize("kind", KINDS)
def test_mixed_batch_runs_the_frozen_tower_and_its_pixels_matter(kind: str, checkpoint_of, tmp_path: Path) -> None:
    from gemmaforge.models import resolve_model
    from gemmaforge.train.wrapping import build_peft_model

    model_dir, spec, tokenizer, vision, rows = examples(kind, checkpoint_of, tmp_path)
    config = run_config(model={"name_or_path": str(model_dir)}, lora={"target_modules": "all-linear"},
                        train={"packing": False})
    model = build_peft_model(config, resolve_model(str(model_dir), tmp_path), tokenizer, "fp32")
    tower = model.get_base_model().get_submodule(spec.architecture.tower_prefixes[0])  # Unified: embed_vision
    calls = []
    tower.register_forward_hook(lambda *_: calls.append(1))
    collate = MediaBatches(RightPadCollator(tokenizer.pad_token_id), Senses(vision))
    batch = collate(rows[:2])  # a text conversation beside one with a picture
    loss = model(**batch).loss
    loss.backward()
    assert calls, "the vision tower never ran"
    assert not any(p.requires_grad for p in tower.parameters())  # frozen: no LoRA, no gradient
    assert all(p.grad is not None for n, p in model.named_parameters() if p.requires_grad and "lora_" in n)
    with torch.no_grad():  # the same tokens with the picture's negative: another picture, another loss
        assert not torch.isclose(model(**{**batch, "pixel_values": -batch["pixel_values"]}).loss, loss.detach())


def test_val_loss_is_scored_with_the_pictures(checkpoint_of, tmp_path: Path) -> None:
    """eval's loss over val conversations with pictures runs them through the tower: the same tokens about other
    pictures (same sizes, other pixels) score another loss."""
    from gemmaforge.evaluate.scoring import mean_loss
    from gemmaforge.models import load_causal_lm

    model_dir, spec, tokenizer, vision, rows = examples("gemma3-mm", checkpoint_of, tmp_path)
    model = load_causal_lm(model_dir, spec, torch.float32)
    others = []
    for i, row in enumerate(rows[1:]):
        (path,) = row["images"]
        Image.fromarray(255 - np.asarray(Image.open(path))).save(tmp_path / f"other{i}.png")
        others.append({**row, "images": [tmp_path / f"other{i}.png"]})
    own = mean_loss(model, rows[1:], tokenizer.pad_token_id, 2, Senses(vision))
    assert own is not None and own != pytest.approx(mean_loss(model, others, tokenizer.pad_token_id, 2, Senses(vision)))


@pytest.mark.parametrize("kind", TOWER_KINDS)
@pytest.mark.slow
def test_planner_prices_what_an_adapted_tower_keeps_per_picture(kind: str, checkpoint_of, tmp_path: Path) -> None:
    """The plan's bytes per picture (a probe of the tower alone) against a real training forward of the tiny
    checkpoint with tower and projector adapted: a conversation with the largest picture, minus the same tokens
    without its pixels. A frozen image path keeps nothing."""
    from transformers import AutoConfig

    from gemmaforge.models import resolve_model
    from gemmaforge.train.tower_activations import LARGEST_PICTURE, bytes_per_picture
    from gemmaforge.train.wrapping import build_peft_model

    model_dir = checkpoint_of(kind)
    spec, tokenizer = read_spec(model_dir), load_tokenizer(model_dir)
    vision = ImagePrompt.load(model_dir, spec, tokenizer)
    Image.new("RGB", LARGEST_PICTURE, (90, 20, 200)).save(tmp_path / "big.png")
    rows, _ = tokenize_conversations(
        [[{"role": "user", "content": spec.family.chat.image + QUESTION}, {"role": "assistant", "content": "x"}]],
        tokenizer, spec.family, 4096, "test", images=[[tmp_path / "big.png"]], senses=Senses(vision))
    batch = MediaBatches(RightPadCollator(tokenizer.pad_token_id), Senses(vision))(rows)
    adapted = run_config(model={"name_or_path": str(model_dir)}, train={"packing": False},
                         lora={"target_modules": "all-linear", "freeze_vision_tower": False,
                               "freeze_multi_modal_projector": False})
    model = build_peft_model(adapted, resolve_model(str(model_dir), tmp_path), tokenizer, "fp32")
    without = {k: v for k, v in batch.items() if k not in ("pixel_values", "image_position_ids")}
    measured = saved_bytes(model, batch) - saved_bytes(model, without)
    config = AutoConfig.from_pretrained(model_dir)
    planned = bytes_per_picture(config, model_dir, spec.family, adapted, torch.float32)
    assert measured > 0 and abs(planned / measured - 1) < 1e-3, (planned, measured)  # docs/images.md: within 0.02%
    frozen = run_config(model={"name_or_path": str(model_dir)})
    assert bytes_per_picture(config, model_dir, spec.family, frozen, torch.float32) == 0.0
