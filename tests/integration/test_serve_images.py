"""Images through `gemmaforge serve` on real HTTP with the official `ollama` and `openai` clients: a tiny Gemma 3
multimodal checkpoint answers an image prompt as transformers' generate does with the official processor's
inputs (Ollama's `images` on /api/chat and /api/generate, OpenAI's `image_url` data URIs), and its GGUF export
with the projector beside it answers on the llama.cpp engine as the transformers engine does; bad images, remote
URLs and images for a text-only model or a GGUF without projector are refused with a 400 that says why."""

from __future__ import annotations

import base64
import io
import shutil

import httpx
import numpy as np
import pytest
import torch
from PIL import Image

from gemmaforge.models import default_home
from gemmaforge.serve.registry import Registry
from gemmaforge.serve.server import ServeOptions, background_server

pytestmark = pytest.mark.integration
ollama = pytest.importorskip("ollama")
openai = pytest.importorskip("openai")

QUESTION = "Which colour is this?"
N = 10


def png(colour: tuple[int, int, int]) -> bytes:
    out = io.BytesIO()
    Image.new("RGB", (40, 30), colour).save(out, format="PNG")
    return out.getvalue()


RED = png((200, 30, 30))


@pytest.fixture(scope="module")
def served(checkpoint_of, tiny_gemma3_dir, text_gguf_of, mmproj_of, tmp_path_factory: pytest.TempPathFactory):
    """The tiny Gemma 3 multimodal checkpoint on both engines (its f16 GGUF with the projector beside it, as `export
    gguf` writes them), the GGUF alone, a text-only checkpoint, and the tiny Gemma 4 12B Unified on both engines."""
    exported, alone, two, unified = (tmp_path_factory.mktemp(name)
                                     for name in ("gguf", "gguf-alone", "gguf-two", "gguf-unified"))
    (unified / "model-f16.gguf").symlink_to(text_gguf_of("gemma4-unified"))
    (unified / "mmproj-f16.gguf").symlink_to(mmproj_of("gemma4-unified"))
    (exported / "model-f16.gguf").symlink_to(text_gguf_of("gemma3-mm"))
    (exported / "mmproj-f16.gguf").symlink_to(mmproj_of("gemma3-mm"))
    shutil.copy(text_gguf_of("gemma3-mm"), alone / "model-f16.gguf")  # its own file: engines are shared by file
    shutil.copy(text_gguf_of("gemma3-mm"), two / "model-f16.gguf")
    for name in ("mmproj-f16.gguf", "mmproj-model-f32.gguf"):  # which one? not guessed
        (two / name).symlink_to(mmproj_of("gemma3-mm"))
    registry = Registry(default_home())
    registry.add(f"pic={checkpoint_of('gemma3-mm')}")
    registry.add(f"picgguf={exported / 'model-f16.gguf'}")
    registry.add(f"gguf={alone / 'model-f16.gguf'}")
    registry.add(f"two={two / 'model-f16.gguf'}")
    registry.add(f"text={tiny_gemma3_dir}")
    registry.add(f"uni={checkpoint_of('gemma4-unified')}")
    registry.add(f"unigguf={unified / 'model-f16.gguf'}")
    with background_server(registry, ServeOptions()) as url:
        yield url
    registry.close()


@pytest.fixture(scope="module")
def expected(checkpoint_of) -> str:
    """The answer of transformers' generate on the official processor's inputs for the prompt the official
    Gemma 3 template renders for an image part before the question."""
    from transformers import AutoModelForImageTextToText, AutoProcessor

    folder = checkpoint_of("gemma3-mm")
    processor = AutoProcessor.from_pretrained(folder)
    prompt = f"<bos><start_of_turn>user\n<start_of_image>{QUESTION}<end_of_turn>\n<start_of_turn>model\n"
    inputs = processor(text=[prompt], images=[[Image.open(io.BytesIO(RED))]], return_tensors="pt",
                       add_special_tokens=False)
    model = AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float32).eval()
    stops = [processor.tokenizer.eos_token_id, processor.tokenizer.convert_tokens_to_ids("<end_of_turn>")]
    with torch.inference_mode():
        out = model.generate(**inputs, max_new_tokens=N, do_sample=False, eos_token_id=stops)
    answer = processor.tokenizer.decode(out[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True)
    assert answer.strip()
    return answer


def test_ollama_images_answer_as_generate_does(served: str, expected: str) -> None:
    client = ollama.Client(host=served)
    options = {"temperature": 0, "num_predict": N}
    chat = client.chat("pic", messages=[{"role": "user", "content": QUESTION, "images": [RED]}], options=options)
    assert chat.message.content == expected
    assert chat.prompt_eval_count > 4  # the picture's soft tokens are in the prompt
    generated = client.generate("pic", QUESTION, images=[RED], options=options)
    assert generated.response == expected and generated.prompt_eval_count == chat.prompt_eval_count
    blind = client.chat("pic", messages=[{"role": "user", "content": QUESTION}], options=options)
    assert blind.prompt_eval_count < chat.prompt_eval_count
    assert client.show("pic").capabilities == ["completion", "vision"]  # as Ollama lists a model with a projector
    assert client.show("text").capabilities == ["completion"]


def test_openai_image_url_data_uris_answer_as_generate_does(served: str, expected: str) -> None:
    client = openai.OpenAI(base_url=served + "/v1", api_key="unused", max_retries=0)
    uri = "data:image/png;base64," + base64.b64encode(RED).decode()
    content = [{"type": "image_url", "image_url": {"url": uri}}, {"type": "text", "text": QUESTION}]
    answer = client.chat.completions.create(model="pic", messages=[{"role": "user", "content": content}],
                                            temperature=0, max_tokens=N)
    assert answer.choices[0].message.content == expected
    streamed = client.chat.completions.create(model="pic", messages=[{"role": "user", "content": content}],
                                              temperature=0, max_tokens=N, stream=True)
    assert "".join(chunk.choices[0].delta.content or "" for chunk in streamed if chunk.choices) == expected


def test_llama_cpp_with_the_projector_answers_as_the_transformers_engine(served: str) -> None:
    """Pictures of the tower's own size, so both engines see the same pixels; the GGUF's f16 weights are the only
    difference (the logits agree to ~1e-3, below; a random model's flat logits part its greedy answers at near
    ties within a few tokens, so the first two are compared)."""
    client = ollama.Client(host=served)
    options = {"temperature": 0, "num_predict": 2}
    for seed in (1, 2):
        picture = io.BytesIO()
        noise(seed).save(picture, "PNG")
        messages = [{"role": "user", "content": QUESTION, "images": [picture.getvalue()]}]
        want = client.chat("pic", messages=messages, options=options)
        got = client.chat("picgguf", messages=messages, options=options)
        assert got.message.content == want.message.content and got.prompt_eval_count == want.prompt_eval_count
    assert client.show("picgguf").capabilities == ["completion", "vision"]
    text = [{"role": "user", "content": QUESTION}]  # after the pictures, as from a file that never saw one
    options["num_predict"] = N
    assert client.chat("picgguf", messages=text, options=options).message.content == \
        client.chat("gguf", messages=text, options=options).message.content


def noise(seed: int, size: tuple[int, int] = (32, 32)) -> Image.Image:
    """A picture of the tiny tower's own size (32 x 32), which neither llama.cpp nor the processor resizes."""
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (*size[::-1], 3), dtype=np.uint8))


def test_gemma4_unified_pictures_are_served_by_both_engines(served: str) -> None:
    """Gemma 4 12B Unified (no tower: its patches through embed_vision; inputs computed by gemmaforge/vision_unified.py
    on the transformers engine, by mtmd from our projector on llama.cpp): a picture of 7 x 10 model patches (12 px
    each in the tiny checkpoint), which neither side resizes, reaches the prompt and the answer alike."""
    client = ollama.Client(host=served)
    options = {"temperature": 0, "num_predict": 2}
    picture = io.BytesIO()
    noise(3, (120, 84)).save(picture, "PNG")
    messages = [{"role": "user", "content": QUESTION, "images": [picture.getvalue()]}]
    want = client.chat("uni", messages=messages, options=options)
    got = client.chat("unigguf", messages=messages, options=options)
    assert got.message.content == want.message.content and got.prompt_eval_count == want.prompt_eval_count
    blind = client.chat("uni", messages=[{"role": "user", "content": QUESTION}], options=options)
    assert want.prompt_eval_count == blind.prompt_eval_count + 70 + 2  # 70 soft tokens between <|image> and <image|>
    assert client.show("uni").capabilities == ["completion", "tools", "thinking", "vision"]
    # mtmd takes Unified's sound through the projector's audio projection; the transformers engine does not yet
    assert client.show("unigguf").capabilities == ["completion", "tools", "thinking", "vision", "audio"]


def test_llama_cpp_reads_pictures_as_transformers_does(checkpoint_of, text_gguf_of, mmproj_of) -> None:
    """The next-token logits after an image prompt, llama.cpp (f16 text GGUF, our projector) against transformers
    on the official processor's inputs: close for each picture, while two pictures are far apart (the tiny model's
    greedy answers barely depend on the picture, its logits do), and a picture read again after another gives
    what it gave the first time (nothing of a request stays for the next)."""
    import llama_cpp
    from transformers import AutoModelForImageTextToText, AutoProcessor

    from gemmaforge.families import FAMILIES
    from gemmaforge.inference.llamacpp_images import Projector

    folder = checkpoint_of("gemma3-mm")
    processor = AutoProcessor.from_pretrained(folder)
    model = AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float32).eval()
    prompt = f"<bos><start_of_turn>user\n<start_of_image>{QUESTION}<end_of_turn>\n<start_of_turn>model\n"
    llm = llama_cpp.Llama(model_path=str(text_gguf_of("gemma3-mm")), n_ctx=256, n_threads=2, verbose=False)
    projector = Projector(mmproj_of("gemma3-mm"), llm, FAMILIES["gemma3"])

    def theirs(picture: Image.Image) -> tuple[np.ndarray, int]:
        inputs = processor(text=[prompt], images=[[picture]], return_tensors="pt", add_special_tokens=False)
        with torch.inference_mode():
            return model(**inputs).logits[0, -1].numpy(), inputs["input_ids"].shape[1]

    def ours(picture: Image.Image) -> tuple[np.ndarray, int]:
        inputs = projector.inputs(prompt, [picture], [])
        ids = projector.prompt_ids(inputs)
        assert projector.evaluate(llm, inputs)[:len(ids)] != [] and llm.n_tokens == len(ids)
        logits = np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(llm.n_vocab(),)).copy()
        return logits, len(ids)

    def apart(x: np.ndarray, y: np.ndarray) -> float:
        return float(np.linalg.norm(x - y) / np.linalg.norm(y))

    try:
        (a, n_a), (b, _), (a_again, _) = ours(noise(1)), ours(noise(2)), ours(noise(1))
    finally:
        projector.close()
        llm.close()
    (want_a, n_want), (want_b, _) = theirs(noise(1)), theirs(noise(2))
    errors, pictures = (apart(a, want_a), apart(b, want_b)), apart(want_b, want_a)
    print(f"llama.cpp vs transformers: {errors[0]:.1e}, {errors[1]:.1e}; one picture vs the other: {pictures:.1e}")
    assert n_a == n_want and np.array_equal(a, a_again)
    assert max(errors) < 3e-3 and pictures > 100 * max(errors)  # measured 9.6e-4 and 1.8e-3; 0.53


def red_chat(model: str, text: str = "hi") -> dict:
    return {"model": model, "messages": [{"role": "user", "content": text, "images": [base64.b64encode(RED).decode()]}]}


@pytest.mark.parametrize(("path", "body", "message"), [
    ("/v1/chat/completions", {"model": "pic", "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}}]}]},
     "messages[0].content[0].image_url: remote URLs are not fetched by this server"),
    ("/v1/chat/completions", {"model": "pic", "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "cat.png"}}]}]},
     "messages[0].content[0].image_url.url: expected a data URI"),
    ("/v1/chat/completions", {"model": "pic", "messages": [{"role": "user", "content": [
        {"type": "input_audio", "input_audio": {}}]}]},
     "messages[0].content[0].input_audio: this model's chat format takes no sound"),
    ("/v1/chat/completions", {"model": "pic", "messages": [{"role": "user", "content": [
        {"type": "file", "file": {}}]}]},
     "messages[0].content[0]: expected a text, image_url or input_audio part"),
    ("/api/chat", {"model": "pic", "messages": [{"role": "user", "content": "hi", "images": ["not base64!"]}]},
     "messages[0].images[0]: not valid base64"),
    ("/api/chat", {"model": "pic", "messages": [{"role": "user", "content": "hi",
                                                 "images": [base64.b64encode(b"plain text").decode()]}]},
     "messages[0].images[0]: not a picture PIL can read"),
    ("/api/chat", {"model": "pic", "messages": [{"role": "user", "content": "hi"},
                                                {"role": "assistant", "content": "x",
                                                 "images": [base64.b64encode(RED).decode()]}]},
     "messages[1].images: assistant messages carry no images"),
    ("/api/generate", {"model": "pic", "prompt": "<start_of_turn>user\nhi<end_of_turn>\n", "raw": True,
                       "images": [base64.b64encode(RED).decode()]},
     "images: pic:latest: the prompt has 0 image placeholder(s) (<start_of_image>) for 1 "
     "image(s)"),
    ("/api/chat", red_chat("text"), "has no vision tower (a text-only checkpoint)"),
    ("/api/chat", red_chat("gguf"), "images: gguf:latest: no projector (mmproj*.gguf) beside model-f16.gguf"),
    ("/api/chat", red_chat("two"), "images: two:latest: 2 projector files (mmproj*.gguf) beside model-f16.gguf"),
    ("/api/chat", red_chat("pic", "hi <image_soft_token>"),
     "images: pic:latest: the prompt holds image tokens (<image_soft_token>) of its own"),
])
def test_bad_images_are_refused_with_the_reason(served: str, path: str, body: dict, message: str) -> None:
    response = httpx.post(served + path, json={**body, "stream": False}, timeout=60)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert message in (error["message"] if isinstance(error, dict) else error)
