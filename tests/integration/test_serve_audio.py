"""Sound through `gemmaforge serve` on real HTTP with the official `ollama` and `openai` clients: the tiny Gemma 4 E2B
checkpoint answers a clip as transformers' generate does with the official processor's inputs (Ollama's `images`,
which carry clips as Ollama's do; OpenAI's `input_audio` parts; OpenAI's /v1/audio/transcriptions with Ollama's
instructions), its GGUF export with the projector beside it reads the clip on the llama.cpp engine as transformers
does; clips that do not decode, sound for a model that does not hear and bad transcription forms get a 400 that says
why."""

from __future__ import annotations

import base64
import io
import shutil
from unittest import mock

import httpx
import numpy as np
import pytest
import torch

from gemmaforge.models import default_home
from gemmaforge.serve.registry import Registry
from gemmaforge.serve.server import ServeOptions, background_server

pytestmark = pytest.mark.integration
ollama = pytest.importorskip("ollama")
openai = pytest.importorskip("openai")

QUESTION = "What is this sound?"
N = 8
CAP = 24  # the server's max_tokens


def wav(seconds: float, hz: float, rate: int = 16_000, channels: int = 1) -> bytes:
    import soundfile

    t = np.arange(int(seconds * rate)) / rate
    wave = (0.3 * np.sin(2 * np.pi * hz * t)).astype(np.float32)
    out = io.BytesIO()
    soundfile.write(out, np.stack([wave] * channels, axis=1) if channels > 1 else wave, rate, format="WAV")
    return out.getvalue()


TONE = wav(1.2, 440)


def official_processor(folder):
    from transformers import AutoFeatureExtractor, AutoImageProcessor, AutoTokenizer
    from transformers.models.gemma4.processing_gemma4 import Gemma4Processor
    from transformers.processing_utils import ProcessorMixin

    with mock.patch.object(ProcessorMixin, "check_argument_for_proper_class", lambda *args: None):
        return Gemma4Processor(feature_extractor=AutoFeatureExtractor.from_pretrained(folder),
                               image_processor=AutoImageProcessor.from_pretrained(folder),
                               tokenizer=AutoTokenizer.from_pretrained(folder), video_processor=None)


@pytest.fixture(scope="module")
def served(checkpoint_of, text_gguf_of, mmproj_of, tiny_gemma3_dir, tmp_path_factory: pytest.TempPathFactory):
    """The tiny Gemma 4 E2B checkpoint on both engines (its f16 GGUF with the projector beside it), Gemma 4 31B
    (no audio tower) and a Gemma 3 text model (no audio in its chat format)."""
    exported = tmp_path_factory.mktemp("gguf")
    shutil.copy(text_gguf_of("gemma4-e2b"), exported / "model-f16.gguf")  # its own file: engines are shared by file
    (exported / "mmproj-f16.gguf").symlink_to(mmproj_of("gemma4-e2b"))
    registry = Registry(default_home())
    registry.add(f"hear={checkpoint_of('gemma4-e2b')}")
    registry.add(f"heargguf={exported / 'model-f16.gguf'}")
    registry.add(f"deaf={checkpoint_of('gemma4-dense')}")
    registry.add(f"text={tiny_gemma3_dir}")
    # a random model never stops: answers (a transcription's, which no field bounds) end at the server's cap
    with background_server(registry, ServeOptions(max_tokens=CAP)) as url:
        yield url
    registry.close()


def generate(folder, prompt: str, clip: bytes, n: int = N) -> str:
    """transformers' generate on Gemma4Processor's inputs for `prompt` (its <|audio|> where the clip goes)."""
    import soundfile
    from transformers import AutoModelForImageTextToText

    samples, rate = soundfile.read(io.BytesIO(clip), dtype="float32")
    assert rate == 16_000
    processor = official_processor(folder)
    inputs = processor(text=[prompt], audio=[samples], return_tensors="pt", add_special_tokens=False)
    model = AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float32).eval()
    tokenizer = processor.tokenizer
    stops = [tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids("<turn|>")]
    with torch.inference_mode():
        out = model.generate(**inputs, max_new_tokens=n, do_sample=False, eos_token_id=stops)
    return tokenizer.decode(out[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True)


@pytest.fixture(scope="module")
def expected(checkpoint_of) -> str:
    """What the official template renders for an audio part before the question (Gemma 4: `<|audio|>`, no margin),
    answered by generate."""
    prompt = f"<bos><|turn>user\n<|audio|>{QUESTION}<turn|>\n<|turn>model\n"
    answer = generate(checkpoint_of("gemma4-e2b"), prompt, TONE)
    assert answer.strip()
    return answer


def test_ollama_images_carry_clips_as_ollamas_do(served: str, expected: str) -> None:
    client = ollama.Client(host=served)
    options = {"temperature": 0, "num_predict": N}
    chat = client.chat("hear", messages=[{"role": "user", "content": QUESTION, "images": [TONE]}], options=options)
    assert chat.message.content == expected
    assert chat.prompt_eval_count > 30 + 2  # the clip's 30 soft tokens (1.2 s) and their frame are in the prompt
    generated = client.generate("hear", QUESTION, images=[TONE], options=options)
    assert generated.response == chat.message.content and generated.prompt_eval_count == chat.prompt_eval_count
    assert client.show("hear").capabilities == ["completion", "tools", "thinking", "vision", "audio"]
    assert client.show("deaf").capabilities == ["completion", "tools", "thinking", "vision"]
    assert client.show("heargguf").capabilities == ["completion", "tools", "thinking", "vision", "audio"]


def test_openai_input_audio_answers_as_generate_does(served: str, expected: str) -> None:
    client = openai.OpenAI(base_url=served + "/v1", api_key="unused", max_retries=0)
    content = [{"type": "input_audio", "input_audio": {"data": base64.b64encode(TONE).decode(), "format": "wav"}},
               {"type": "text", "text": QUESTION}]
    answer = client.chat.completions.create(model="hear", messages=[{"role": "user", "content": content}],
                                            temperature=0, max_tokens=N)
    assert answer.choices[0].message.content == expected
    streamed = client.chat.completions.create(model="hear", messages=[{"role": "user", "content": content}],
                                              temperature=0, max_tokens=N, stream=True)
    assert "".join(chunk.choices[0].delta.content or "" for chunk in streamed if chunk.choices) == expected


def test_a_stereo_44khz_clip_is_heard_as_its_16khz_mono_mix(served: str) -> None:
    """The intake mixes down and resamples as prepare does: the same tone at 44.1 kHz in two channels reads as the
    16 kHz one (the same prompt length; the features differ only by resampling)."""
    client = ollama.Client(host=served)
    options = {"temperature": 0, "num_predict": 1}
    ask = [{"role": "user", "content": QUESTION, "images": [TONE]}]
    stereo = [{"role": "user", "content": QUESTION, "images": [wav(1.2, 440, 44_100, 2)]}]
    assert client.chat("hear", messages=stereo, options=options).prompt_eval_count == \
        client.chat("hear", messages=ask, options=options).prompt_eval_count


def test_transcriptions_ask_ollamas_question_of_the_clip(served: str, checkpoint_of) -> None:
    """/v1/audio/transcriptions through the official client: the answer is the model's greedy answer to Ollama's
    transcription chat (its system instruction, language and context, the clip before its question), trimmed; as
    JSON with the token usage, or as plain text."""
    from gemmaforge.serve.routes.audio import INSTRUCTION
    from gemmaforge.serve.routes.audio import QUESTION as ASKED

    client = openai.OpenAI(base_url=served + "/v1", api_key="unused", max_retries=0)
    got = client.audio.transcriptions.create(model="hear", file=("tone.wav", TONE), language="en",
                                             prompt="a tuning fork")
    system = f"{INSTRUCTION} The audio is in en. Context: a tuning fork"
    prompt = f"<bos><|turn>system\n{system}<turn|>\n<|turn>user\n<|audio|>{ASKED}<turn|>\n<|turn>model\n"
    want = generate(checkpoint_of("gemma4-e2b"), prompt, TONE, n=CAP).strip()
    assert got.text == want and want
    assert got.usage.input_tokens > 30 and got.usage.output_tokens > 0
    plain = client.audio.transcriptions.create(model="hear", file=("tone.wav", TONE), language="en",
                                               prompt="a tuning fork", response_format="text")
    assert plain == want


def test_llama_cpp_with_the_projector_reads_a_clip_as_transformers_does(served: str) -> None:
    """The same prompt length, and the first token of both engines' greedy answers to two clips (the GGUF's f16
    weights and llama.cpp's audio encoder are the difference: the logits agree to under 1e-2, below; a random model's
    flat logits part greedy answers at near ties a token or two in)."""
    client = ollama.Client(host=served)
    options = {"temperature": 0, "num_predict": 1}
    for hz in (300, 1500):
        messages = [{"role": "user", "content": QUESTION, "images": [wav(0.8, hz)]}]
        want = client.chat("hear", messages=messages, options=options)
        got = client.chat("heargguf", messages=messages, options=options)
        assert got.message.content == want.message.content and got.prompt_eval_count == want.prompt_eval_count


def test_llama_cpp_reads_sound_as_transformers_does(checkpoint_of, text_gguf_of, mmproj_of) -> None:
    """The next-token logits after a clip, llama.cpp (f16 text GGUF, our projector's audio encoder) against
    transformers on the official processor's inputs: close for each clip, while two clips are far apart."""
    import llama_cpp
    import soundfile
    from transformers import AutoModelForImageTextToText

    from gemmaforge.families import FAMILIES
    from gemmaforge.inference.llamacpp_images import Projector

    folder = checkpoint_of("gemma4-e2b")
    processor = official_processor(folder)
    model = AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float32).eval()
    prompt = f"<bos><|turn>user\n<|audio|>{QUESTION}<turn|>\n<|turn>model\n"
    llm = llama_cpp.Llama(model_path=str(text_gguf_of("gemma4-e2b")), n_ctx=256, n_threads=2, verbose=False)
    projector = Projector(mmproj_of("gemma4-e2b"), llm, FAMILIES["gemma4"])
    assert projector.audio_rate == 16_000
    clips = [soundfile.read(io.BytesIO(wav(1.0, hz)), dtype="float32")[0] for hz in (300, 1500)]

    def theirs(clip: np.ndarray) -> tuple[np.ndarray, int]:
        inputs = processor(text=[prompt], audio=[clip], return_tensors="pt", add_special_tokens=False)
        with torch.inference_mode():
            return model(**inputs).logits[0, -1].numpy(), inputs["input_ids"].shape[1]

    def ours(clip: np.ndarray) -> tuple[np.ndarray, int]:
        inputs = projector.inputs(prompt, [], [clip])
        ids = projector.prompt_ids(inputs)
        projector.evaluate(llm, inputs)
        assert llm.n_tokens == len(ids)
        return np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(llm.n_vocab(),)).copy(), len(ids)

    def apart(x: np.ndarray, y: np.ndarray) -> float:
        return float(np.linalg.norm(x - y) / np.linalg.norm(y))

    try:
        (a, n_a), (b, _) = ours(clips[0]), ours(clips[1])
    finally:
        projector.close()
        llm.close()
    (want_a, n_want), (want_b, _) = theirs(clips[0]), theirs(clips[1])
    errors, sounds = (apart(a, want_a), apart(b, want_b)), apart(want_b, want_a)
    print(f"llama.cpp vs transformers: {errors[0]:.1e}, {errors[1]:.1e}; one clip vs the other: {sounds:.1e}")
    assert n_a == n_want
    assert max(errors) < 1e-2 and sounds > 20 * max(errors)


def chat_with(model: str, clip: bytes) -> dict:
    clips = [base64.b64encode(clip).decode()]
    return {"model": model, "messages": [{"role": "user", "content": "hi", "images": clips}]}


def input_audio(model: str, data: str) -> dict:
    return {"model": model, "messages": [{"role": "user", "content": [
        {"type": "input_audio", "input_audio": {"data": data, "format": "wav"}}]}]}


@pytest.mark.parametrize(("path", "body", "message"), [
    ("/api/chat", chat_with("hear", b"RIFF\x00\x00\x00\x00WAVEjunk"),
     "messages[0].images[0]: not a sound libsndfile can read (Error in WAV file. No 'data' chunk marker.)"),
    ("/api/chat", chat_with("deaf", TONE), "has no audio tower (only Gemma 4 E2B and E4B hear)"),
    ("/api/chat", chat_with("text", TONE),
     "messages[0].images[0]: a clip, and this model's chat format takes no sound"),
    ("/api/chat", chat_with("hear", wav(31, 50, rate=4_000)), "the clip lasts 31.0 s, more than the 30 s"),
    ("/v1/chat/completions", input_audio("hear", "not base64!"), "messages[0].content[0].input_audio.data: not valid "
                                                                 "base64"),
    ("/v1/chat/completions", input_audio("hear", ""), "messages[0].content[0].input_audio.data: expected the clip"),
    ("/v1/chat/completions", {"model": "hear", "messages": [{"role": "assistant", "content": [
        {"type": "input_audio", "input_audio": {"data": base64.b64encode(TONE).decode()}}]}]},
     "messages[0].content: assistant messages carry no sound"),
])
def test_bad_sound_is_a_400_that_says_why(served: str, path: str, body: dict, message: str) -> None:
    response = httpx.post(served + path, json=body, timeout=60)
    assert response.status_code == 400, response.text
    assert message in response.text, response.text


@pytest.mark.parametrize(("form", "files", "message"), [
    ({"model": "hear"}, None, "file is required"),
    ({"model": "hear"}, {"file": ("empty.wav", b"")}, "the audio file is empty"),
    ({}, {"file": ("tone.wav", TONE)}, "model is required"),
    ({"model": "hear", "response_format": "srt"}, {"file": ("tone.wav", TONE)}, "'srt' is not supported"),
    ({"model": "text"}, {"file": ("tone.wav", TONE)}, "model: text:latest does not hear"),
    ({"model": "deaf"}, {"file": ("tone.wav", TONE)}, "has no audio tower (only Gemma 4 E2B and E4B hear)"),
    ({"model": "hear"}, {"file": ("notes.txt", b"plain text")}, "file: not a sound libsndfile can read"),
])
def test_bad_transcription_forms_are_a_400_that_says_why(served: str, form: dict, files: dict | None,
                                                        message: str) -> None:
    response = httpx.post(served + "/v1/audio/transcriptions", data=form, files=files or {"x": ("x", b"")},
                          timeout=60)
    assert response.status_code == 400, response.text
    assert message in response.text, response.text
