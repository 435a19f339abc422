"""Sound in datasets and prompts (gemmaforge/audio.py, intake.py, data/media_files.py, train/collate.py): clips decoded
by libsndfile, mixed down and resampled to the feature extractor's rate; each `<audio>` expanded to exactly the tokens
Gemma4Processor writes for that clip, never supervised; LLaMA-Factory's audio demo, OpenAI input_audio parts and an
audiofolder prepared; bad clips refused naming the record; the frozen audio tower run on every batch with sound."""

from __future__ import annotations

import base64
import json
from pathlib import Path
from unittest import mock

import numpy as np
import pytest
import torch

from gemmaforge.audio import AudioPrompt
from gemmaforge.cli import main
from gemmaforge.errors import UserError
from gemmaforge.intake import decode_sound
from gemmaforge.model_spec import read_spec
from gemmaforge.models import load_tokenizer
from tests.audio_helpers import RATE, encoded, tone

PROMPT = "<bos><|turn>user\n<|audio|>What is it? And this:<|audio|><turn|>\n<|turn>model\n"

def official_processor(folder: Path):
    """Gemma4Processor with the checkpoint's feature extractor (its video processor needs torchvision, absent here:
    its class check is lifted, as tests/unit/test_vision.py does), on a tokenizer of its own: it adds a token."""
    from transformers import AutoFeatureExtractor, AutoImageProcessor, AutoTokenizer
    from transformers.models.gemma4.processing_gemma4 import Gemma4Processor
    from transformers.processing_utils import ProcessorMixin

    with mock.patch.object(ProcessorMixin, "check_argument_for_proper_class", lambda *args: None):
        return Gemma4Processor(feature_extractor=AutoFeatureExtractor.from_pretrained(folder),
                               image_processor=AutoImageProcessor.from_pretrained(folder),
                               tokenizer=AutoTokenizer.from_pretrained(folder), video_processor=None)


def test_audio_prompts_equal_the_official_processor(checkpoint_of) -> None:
    """Token ids, features, their mask and the token types of two clips of different lengths, and the token count
    of clip lengths around each boundary (the first token, a conv step, the 30 s cap), equal Gemma4Processor's."""
    folder = checkpoint_of("gemma4-e2b")
    tokenizer = load_tokenizer(folder)
    audio = AudioPrompt.load(folder, read_spec(folder), tokenizer)
    processor = official_processor(folder)
    rng = np.random.default_rng(0)
    clips = [(rng.standard_normal(n) * 0.1).astype(np.float32) for n in (16_000, 7_777)]
    want = processor(text=[PROMPT], audio=clips, return_tensors="pt", add_special_tokens=False)
    text, _ = audio.expand_rendered(PROMPT, [], [audio.soft_token_count(len(c)) for c in clips])
    ids = torch.tensor([tokenizer(text, add_special_tokens=False).input_ids])
    got = {**audio.features(clips), **audio.token_types(ids)}
    assert torch.equal(want["input_ids"], ids)
    for key in ("input_features", "input_features_mask", "mm_token_type_ids"):
        assert torch.equal(got[key], want[key]), key
    assert int((ids == audio.audio_token_id).sum()) == 25 + 12  # 1 s and 0.49 s
    for n in (160, 161, 319, 320, 641, 46_421, 479_999, 480_000, 600_000):
        clip = np.zeros(n, dtype=np.float32)
        counted = processor(text=["<|audio|>"], audio=[clip], return_tensors="pt")["input_ids"]
        assert audio.soft_token_count(n) == int((counted == audio.audio_token_id).sum()), n
    assert audio.soft_token_count(audio.shortest_samples()) == 1 > audio.soft_token_count(audio.shortest_samples() - 1)
    assert audio.max_seconds == 30


def test_a_checkpoint_without_an_audio_tower_says_why(checkpoint_of, tiny_gemma3_dir: Path) -> None:
    with pytest.raises(ValueError, match="has no audio tower"):
        AudioPrompt.load(tiny_gemma3_dir, read_spec(tiny_gemma3_dir), tokenizer=None)
    folder = checkpoint_of("gemma4-unified")
    with pytest.raises(ValueError, match="audio for Gemma 4 12B Unified is not supported yet"):
        AudioPrompt.load(folder, read_spec(folder), tokenizer=None)


def test_sound_is_mixed_down_and_resampled_to_the_models_rate(llamafactory_data: Path) -> None:
    """A stereo 44.1 kHz tone comes out as the same tone at 16 kHz, one channel (the mean of the two); LLaMA-Factory's
    demo clips (MP3 at 48 kHz stereo, WAV and FLAC at 16 kHz) decode to their length at 16 kHz."""
    stereo = tone(1.0, rate=44_100, channels=2)
    stereo[:, 1] *= 0.5  # the mean of the channels: 0.75 of the left one
    mono = decode_sound(encoded(stereo, 44_100, "FLAC"), "x", RATE, 30)
    assert mono.dtype == np.float32 and len(mono) == RATE
    reference = 0.75 * tone(1.0)
    assert np.abs(mono[200:-200] - reference[200:-200]).max() < 2e-3  # past the resampler's edges
    demo = llamafactory_data / "mllm_demo_data"
    lengths = {name: len(decode_sound((demo / name).read_bytes(), name, RATE, 30))
               for name in ("1.mp3", "2.wav", "3.flac")}
    assert lengths == {"1.mp3": 193_536 // 3, "2.wav": 46_421, "3.flac": 93_680}


@pytest.mark.parametrize(("data", "expected"), [
    (b"RIFF not really a wav file", "not a sound libsndfile can read"),
    (encoded(np.zeros(0, dtype=np.float32)), "the clip is empty"),
    (encoded(np.zeros(31 * 8_000, dtype=np.float32), 8_000), "the clip lasts 31.0 s, more than the 30 s"),
])
def test_clips_that_cannot_be_heard_are_refused(data: bytes, expected: str) -> None:
    with pytest.raises(UserError, match=expected):
        decode_sound(data, "line 3: audio 1", RATE, 30)


def prepare(source: Path, model: Path, out: Path, *extra: str) -> int:
    return main(["data", "prepare", str(source), "--model", str(model), "-o", str(out), "--val-size", "1", *extra])


def written(out: Path) -> list[dict]:
    return [json.loads(line) for name in ("train.jsonl", "val.jsonl")
            for line in (out / name).read_text(encoding="utf-8").splitlines()]


def test_llamafactory_audio_demo_prepares_unchanged(llamafactory_data: Path, checkpoint_of, tmp_path: Path) -> None:
    """LLaMA-Factory's mllm_audio_demo (its `audios` column, `<audio>` in the text) on Gemma 4 E2B: every record kept,
    the model's marker in place of `<audio>`, the clips referenced by full path, their tokens counted in the
    lengths as the processor writes them."""
    model = checkpoint_of("gemma4-e2b")
    assert prepare(llamafactory_data, model, tmp_path / "out", "--dataset", "mllm_audio_demo") == 0
    stats = json.loads((tmp_path / "out" / "stats.json").read_text())
    source = json.loads((llamafactory_data / "mllm_audio_demo.json").read_text())
    assert stats["kept"] == len(source) == 3
    tokenizer = load_tokenizer(model)
    audio = AudioPrompt.load(model, read_spec(model), tokenizer)
    counts = {r["audios"][0]: audio.soft_token_count(len(decode_sound((llamafactory_data / r["audios"][0])
                                                                      .read_bytes(), "x", RATE, 30)))
              for r in source}
    assert stats["audios"] == {"conversations": 3, "references": 3, "files": 3,
                               "most_tokens_in_one": max(counts.values())}
    rows = {row["messages"][0]["content"]: row for row in written(tmp_path / "out")}
    lengths = []
    for record in source:
        row = rows[record["messages"][0]["content"].replace("<audio>", "<|audio|>")]
        assert row["audios"] == [str((llamafactory_data / record["audios"][0]).resolve())]
        n = counts[record["audios"][0]]
        text = read_spec(model).family.chat.render(row["messages"]).text.replace(
            "<|audio|>", "<|audio>" + "<|audio|>" * n + "<audio|>")
        lengths.append(len(tokenizer(text, add_special_tokens=False).input_ids))
    assert stats["tokens"]["total"] == sum(lengths) and stats["tokens"]["max"] == max(lengths)
    assert not (tmp_path / "out" / "audios").exists()  # referenced, never copied


def test_an_audiofolder_and_input_audio_parts(checkpoint_of, tmp_path: Path) -> None:
    """Hugging Face's audiofolder metadata (file_name: the clip opens the first user turn), beside text records; and
    OpenAI's input_audio parts (base64 in the record: written once into audios/, named by its hash)."""
    folder = tmp_path / "clips"
    folder.mkdir()
    (folder / "low.wav").write_bytes(encoded(tone(0.5, 220)))
    rows = [{"file_name": "low.wav", "instruction": "Which pitch?", "output": "low"},
            {"instruction": "Say hi.", "output": "hi"}]
    (folder / "metadata.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    model = checkpoint_of("gemma4-e2b")
    assert prepare(folder, model, tmp_path / "folder") == 0
    out = {row["messages"][-1]["content"]: row for row in written(tmp_path / "folder")}
    assert out["low"]["messages"][0]["content"] == "<|audio|>Which pitch?"
    assert out["low"]["audios"] == [str(folder / "low.wav")]
    assert "audios" not in out["hi"]

    high = encoded(tone(0.7, 880, rate=8_000), 8_000, "FLAC")
    parts = [{"type": "text", "text": "Which pitch?"},
             {"type": "input_audio", "input_audio": {"data": base64.b64encode(high).decode(), "format": "flac"}}]
    chats = [{"messages": [{"role": "user", "content": parts}, {"role": "assistant", "content": "high"}]},
             {"messages": [{"role": "user", "content": "Say hi."}, {"role": "assistant", "content": "hi"}]}]
    (tmp_path / "chats.jsonl").write_text("".join(json.dumps(row) + "\n" for row in chats))
    assert prepare(tmp_path / "chats.jsonl", model, tmp_path / "parts") == 0
    out = {row["messages"][-1]["content"]: row for row in written(tmp_path / "parts")}
    assert out["high"]["messages"][0]["content"] == "Which pitch?<|audio|>"
    (stored,) = out["high"]["audios"]
    assert Path(stored).parent == tmp_path / "parts" / "audios" and Path(stored).read_bytes() == high
    assert Path(stored).name.endswith(".flac")


BAD_RECORDS = {
    "missing": ({"instruction": "<audio>Hi", "output": "x", "audios": ["nope.wav"]}, "audio nope.wav not found"),
    "not a sound": ({"instruction": "<audio>Hi", "output": "x", "audios": ["text.wav"]},
                    "not a sound libsndfile can read"),
    "too short": ({"instruction": "<audio>Hi", "output": "x", "audios": ["click.wav"]},
                  "too short for one audio token (at least 10.0625 ms)"),
    "too few placeholders": ({"instruction": "Hi", "output": "x", "audios": ["ok.wav"]},
                             "1 audio(s) but 0 <audio> placeholder(s)"),
    "sound in an answer": ({"instruction": "<audio>Hi", "output": "<audio>", "audios": ["ok.wav", "ok.wav"]},
                           "outside the user turns"),
    "input_audio without data": ({"messages": [{"role": "user", "content": [
        {"type": "input_audio", "input_audio": {"format": "wav"}}]}, {"role": "assistant", "content": "x"}]},
        "expected input_audio.data"),
}


@pytest.mark.parametrize("case", BAD_RECORDS)
@pytest.mark.slow
def test_bad_clips_exit_2_naming_the_record(case: str, checkpoint_of, tmp_path: Path, capsys) -> None:
    (tmp_path / "ok.wav").write_bytes(encoded(tone(0.2)))
    (tmp_path / "click.wav").write_bytes(encoded(tone(0.005)))
    (tmp_path / "text.wav").write_text("not a sound")
    record, expected = BAD_RECORDS[case]
    good = {"instruction": "<audio>Fine", "output": "y", "audios": ["ok.wav"]} if "instruction" in record else \
        {"messages": [{"role": "user", "content": "Fine"}, {"role": "assistant", "content": "y"}]}
    data = tmp_path / "data.jsonl"
    data.write_text(json.dumps(good) + "\n" + json.dumps(record) + "\n")
    assert prepare(data, checkpoint_of("gemma4-e2b"), tmp_path / "out") == 2
    err = capsys.readouterr().err
    assert f"{data} line 2" in err and expected in err, err
    assert not (tmp_path / "out").exists()  # nothing half-written


@pytest.mark.parametrize("kind", ["gemma4-dense", "text"])
def test_sound_for_a_model_that_does_not_hear_is_refused(kind: str, checkpoint_of, tiny_gemma3_dir: Path,
                                                         tmp_path: Path, capsys) -> None:
    (tmp_path / "ok.wav").write_bytes(encoded(tone(0.2)))
    data = tmp_path / "data.jsonl"
    data.write_text(json.dumps({"instruction": "<audio>Hi", "output": "x", "audios": ["ok.wav"]}) + "\n")
    model = tiny_gemma3_dir if kind == "text" else checkpoint_of(kind)
    assert prepare(data, model, tmp_path / "out") == 2
    assert f"{data} line 1: the record has audios, but the model takes none (" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_inspect_shows_each_clip_slot_and_counts_its_tokens(llamafactory_data: Path, checkpoint_of, capsys) -> None:
    model = checkpoint_of("gemma4-e2b")
    source = llamafactory_data / "mllm_audio_demo.json"
    assert main(["data", "inspect", str(source), "--model", str(model), "-n", "1"]) == 0
    shown = capsys.readouterr().out
    assert "1 clip(s)" in shown and "<|audio>[101 x <|audio|>]<audio|>What's that sound?" in shown  # 4.03 s
    assert main(["data", "inspect", str(source), "--model", str(model), "--json"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    audio_id = load_tokenizer(model).audio_token_id
    assert [row["audios"] for row in rows] == [[str((llamafactory_data / p).resolve()) for p in r["audios"]]
                                               for r in json.loads(source.read_text())]
    for row in rows:
        supervised = [t for t, label in zip(row["input_ids"], row["labels"]) if label != -100]
        assert audio_id in row["input_ids"] and audio_id not in supervised


@pytest.mark.slow
def test_a_batch_with_sound_runs_the_frozen_audio_tower_and_the_sound_matters(checkpoint_of, tmp_path: Path) -> None:
    """A text conversation, one with a picture and one with a clip in one batch: the audio tower runs, frozen, the
    LoRA weights get gradients, the clip's tokens carry no loss, and other sound (the features negated) gives
    another loss; a cutoff inside the clip's tokens drops the example."""
    from PIL import Image

    from gemmaforge.models import resolve_model
    from gemmaforge.senses import Senses
    from gemmaforge.train.collate import MediaBatches, RightPadCollator, tokenize_conversations
    from gemmaforge.train.wrapping import build_peft_model
    from tests.helpers import run_config

    model_dir = checkpoint_of("gemma4-e2b")
    spec, tokenizer = read_spec(model_dir), load_tokenizer(model_dir)
    senses = Senses.of(model_dir, spec, tokenizer)
    (tmp_path / "a.wav").write_bytes(encoded(tone(1.3, 330)))
    Image.new("RGB", (40, 30), (200, 0, 0)).save(tmp_path / "a.png")
    chat = spec.family.chat
    conversations = [
        [{"role": "user", "content": "Hello"}, {"role": "assistant", "content": "Hi"}],
        [{"role": "user", "content": chat.image + "Which colour?"}, {"role": "assistant", "content": "red"}],
        [{"role": "user", "content": chat.audio + "Which pitch?"}, {"role": "assistant", "content": "low"}],
    ]
    rows, dropped = tokenize_conversations(conversations, tokenizer, spec.family, 1024, "test",
                                           images=[[], [tmp_path / "a.png"], []], audios=[[], [], [tmp_path / "a.wav"]],
                                           senses=senses)
    assert dropped == 0 and rows[2]["audios"] == [str(tmp_path / "a.wav")]
    audio_ids = senses.audio.audio_token_ids(tokenizer)
    assert sum(t == senses.audio.audio_token_id for t in rows[2]["input_ids"]) == 33  # 1.3 s: 32.5 -> 33
    assert all(label == -100 for t, label in zip(rows[2]["input_ids"], rows[2]["labels"]) if t in audio_ids)
    cut, dropped = tokenize_conversations(conversations[2:], tokenizer, spec.family, 12, "test",
                                          audios=[[tmp_path / "a.wav"]], senses=senses, train_on_prompt=True)
    assert cut == [] and dropped == 1

    config = run_config(model={"name_or_path": str(model_dir)}, lora={"target_modules": "all-linear"},
                        train={"packing": False})
    model = build_peft_model(config, resolve_model(str(model_dir), tmp_path), tokenizer, "fp32")
    tower = model.get_base_model().model.audio_tower
    calls = []
    tower.register_forward_hook(lambda *_: calls.append(1))
    batch = MediaBatches(RightPadCollator(tokenizer.pad_token_id), senses)(rows)
    types = batch["mm_token_type_ids"]
    assert set(types[1].unique().tolist()) == {0, 1} and set(types[2].unique().tolist()) == {0, 3}
    loss = model(**batch).loss
    loss.backward()
    assert calls, "the audio tower never ran"
    assert not any(p.requires_grad for p in tower.parameters())  # frozen: no LoRA, no gradient
    assert all(p.grad is not None for n, p in model.named_parameters() if p.requires_grad and "lora_" in n)
    with torch.no_grad():
        assert not torch.isclose(model(**{**batch, "input_features": -batch["input_features"]}).loss, loss.detach())
