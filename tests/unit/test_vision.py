"""Images in prompts (gemmaforge/vision.py): placeholders expanded and image inputs computed exactly as the
official processors do (Gemma3Processor; Gemma4Processor), and the serving engine answering image prompts as
transformers' own generate does with the processor's inputs, beside a text request in the same batch."""

from __future__ import annotations

import asyncio
import io
from pathlib import Path
from unittest import mock

import pytest
import torch
from PIL import Image

from gemmaforge.inference.jobs import Job, Params
from gemmaforge.model_spec import read_spec
from gemmaforge.vision import ImagePrompt
from tests.engine_recording import RecordingEngine, ask

PROMPTS = {  # two images: one before the text, one inside it, as the official templates place image parts
    "gemma3-mm": "<bos><start_of_turn>user\n<start_of_image>Which colour? And here:<start_of_image><end_of_turn>\n"
                 "<start_of_turn>model\n",
    "gemma4-e2b": "<bos><|turn>user\n<|image|>Which colour? And here:<|image|><turn|>\n<|turn>model\n",
}
PROMPTS["gemma4-dense"] = PROMPTS["gemma4-e2b"]


def pictures() -> list[Image.Image]:
    """A wide red picture and a tall noisy one: different sizes give Gemma 4 different soft-token counts."""
    noise = torch.randint(0, 256, (90, 30, 3), generator=torch.Generator().manual_seed(0), dtype=torch.uint8)
    return [Image.new("RGB", (64, 48), (200, 30, 30)), Image.fromarray(noise.numpy())]


def official_processor(kind: str, folder: Path, tokenizer) -> object:
    """The checkpoint's own processor. Gemma4Processor insists on its video processor (torchvision, not installed
    here) and audio feature extractor, which image prompts never touch: its class check is lifted to build it."""
    from transformers import AutoImageProcessor, AutoProcessor
    from transformers.models.gemma4.processing_gemma4 import Gemma4Processor
    from transformers.processing_utils import ProcessorMixin

    if kind == "gemma3-mm":
        return AutoProcessor.from_pretrained(folder)
    with mock.patch.object(ProcessorMixin, "check_argument_for_proper_class", lambda *args: None):
        return Gemma4Processor(feature_extractor=None, image_processor=AutoImageProcessor.from_pretrained(folder),
                               tokenizer=tokenizer, video_processor=None)


@pytest.mark.parametrize("kind", ["gemma3-mm", "gemma4-e2b", "gemma4-dense"])
@pytest.mark.slow
def test_image_prompts_equal_the_official_processor_and_generate(kind: str, checkpoint_of) -> None:
    from transformers import AutoModelForImageTextToText, AutoTokenizer

    folder = checkpoint_of(kind)
    spec = read_spec(folder)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    vision = ImagePrompt.load(folder, spec, tokenizer)
    images = pictures()
    text, inputs = vision.expand(PROMPTS[kind], images)
    ids = torch.tensor([tokenizer(text, add_special_tokens=False).input_ids])
    inputs.update(vision.token_types(ids))
    want = official_processor(kind, folder, tokenizer)(text=[PROMPTS[kind]], images=[images], return_tensors="pt",
                                                       add_special_tokens=False)
    want.pop("attention_mask")
    assert sorted(want) == sorted(["input_ids", *inputs])
    assert torch.equal(want.pop("input_ids"), ids)
    for key, value in want.items():
        assert torch.equal(inputs[key], value), key

    model = AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float32).eval()
    stops = [tokenizer.eos_token_id, *tokenizer.convert_tokens_to_ids(list(spec.family.stop))]
    n = 12
    with torch.inference_mode():
        expected = model.generate(ids, **inputs, max_new_tokens=n, do_sample=False, eos_token_id=stops)
        blind = model.generate(ids, max_new_tokens=n, do_sample=False, eos_token_id=stops)  # the soft tokens alone
    expected, blind = expected[0, ids.shape[1]:].tolist(), blind[0, ids.shape[1]:].tolist()
    assert expected != blind  # the pictures change the answer: the test can tell whether they reached the towers
    text_prompt = tokenizer("<bos>coffee or tea?", add_special_tokens=False).input_ids
    with torch.inference_mode():
        text_expected = model.generate(torch.tensor([text_prompt]), max_new_tokens=n, do_sample=False,
                                       eos_token_id=stops)[0, len(text_prompt):].tolist()

    engine = RecordingEngine(model, tokenizer, spec.family, vision=vision)
    prompt_ids, image_inputs = engine.encode_media(PROMPTS[kind], images)
    assert prompt_ids == ids[0].tolist()

    async def both() -> list[Job]:
        loop = asyncio.get_running_loop()
        jobs = [Job(prompt_ids, Params(max_tokens=n, temperature=0), None, loop, media=image_inputs),
                Job(text_prompt, Params(max_tokens=n, temperature=0), None, loop)]
        await asyncio.gather(*(ask(engine, job, [], i) for i, job in enumerate(jobs)))
        return jobs

    try:
        jobs = asyncio.run(both())
    finally:
        engine.close()
    assert engine.chosen[id(jobs[0])] == expected and engine.chosen[id(jobs[1])] == text_expected


def test_the_placeholders_and_the_images_must_agree(checkpoint_of) -> None:
    from transformers import AutoTokenizer

    folder = checkpoint_of("gemma3-mm")
    vision = ImagePrompt.load(folder, read_spec(folder), AutoTokenizer.from_pretrained(folder))
    with pytest.raises(ValueError, match=r"has 2 image placeholder\(s\) \(<start_of_image>\) for 1 image\(s\)"):
        vision.expand(PROMPTS["gemma3-mm"], pictures()[:1])


def test_a_text_only_checkpoint_takes_no_images(tiny_gemma3_dir: Path) -> None:
    with pytest.raises(ValueError, match="has no vision tower"):
        ImagePrompt.load(tiny_gemma3_dir, read_spec(tiny_gemma3_dir), tokenizer=None)


def test_a_requests_images_share_one_pixel_budget() -> None:
    """Each picture is within the limit alone; the second is refused for what the first left (Pictures, the
    decoder the Ollama and OpenAI routes share)."""
    import base64

    from gemmaforge.serve.protocol import ApiError, Pictures

    big = io.BytesIO()
    Image.new("1", (8000, 5000)).save(big, format="PNG")  # 40 M pixels, a few KiB on the wire
    sent = base64.b64encode(big.getvalue()).decode()
    pictures = Pictures()
    assert pictures.decode(sent, "images[0]").size == (8000, 5000)
    with pytest.raises(ApiError, match=r"images\[1\]: the picture is 8000x5000 pixels, more than the 24,000,000 "
                                       r"accepted \(what is left of the 64,000,000"):
        pictures.decode(sent, "images[1]")
