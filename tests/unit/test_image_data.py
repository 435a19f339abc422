"""Datasets with images (`gemmaforge data prepare`): LLaMA-Factory's `images` column, OpenAI image_url parts, a
folder of images with a file_name JSONL; images found and checked at prepare time and referenced by path; token
lengths that count each image's tokens as the checkpoint's processor writes them."""

from __future__ import annotations

import base64
import io
import json
from pathlib import Path

import pytest
from PIL import Image

from gemmaforge.cli import main
from gemmaforge.models import load_tokenizer

QUESTION = "Which colour is this?"


def png(colour: tuple[int, int, int], size: tuple[int, int] = (40, 30), mode: str = "RGB") -> bytes:
    out = io.BytesIO()
    Image.new(mode, size, colour if mode == "RGB" else 1.5).save(out, format="PNG" if mode == "RGB" else "TIFF")
    return out.getvalue()


def prepare(source: Path, model: Path, out: Path, *extra: str) -> int:
    return main(["data", "prepare", str(source), "--model", str(model), "-o", str(out), "--val-size", "1", *extra])


def written(out: Path) -> list[dict]:
    return [json.loads(line) for name in ("train.jsonl", "val.jsonl")
            for line in (out / name).read_text(encoding="utf-8").splitlines()]


def test_llamafactory_mllm_demo_prepares_unchanged(llamafactory_data: Path, checkpoint_of, tmp_path: Path) -> None:
    model = checkpoint_of("gemma3-mm")
    assert prepare(llamafactory_data, model, tmp_path / "out", "--dataset", "mllm_demo") == 0
    stats = json.loads((tmp_path / "out" / "stats.json").read_text())
    source = json.loads((llamafactory_data / "mllm_demo.json").read_text())
    assert stats["kept"] == len(source) == 6
    assert stats["images"] == {"conversations": 6, "references": sum(len(r["images"]) for r in source), "files": 3,
                               "most_in_one": max(len(r["images"]) for r in source)}
    rows = written(tmp_path / "out")
    by_first = {row["messages"][0]["content"]: row for row in rows}
    for record in source:  # the same conversation, <image> now the model's own placeholder, images by full path
        row = by_first[record["messages"][0]["content"].replace("<image>", "<start_of_image>")]
        assert [m["content"] for m in row["messages"]] == [
            m["content"].replace("<image>", "<start_of_image>") for m in record["messages"]]
        assert row["images"] == [str((llamafactory_data / p).resolve()) for p in record["images"]]
    assert not (tmp_path / "out" / "images").exists()  # referenced, never copied


@pytest.mark.slow
def test_token_lengths_count_image_tokens_as_the_processor_writes_them(llamafactory_data: Path, checkpoint_of,
                                                                       tmp_path: Path) -> None:
    """stats.json's lengths are the processor's: Gemma 4's per-picture count follows each picture's size."""
    from transformers import AutoImageProcessor

    model = checkpoint_of("gemma4-e2b")
    assert prepare(llamafactory_data, model, tmp_path / "out", "--dataset", "mllm_demo") == 0
    tokenizer, processor = load_tokenizer(model), AutoImageProcessor.from_pretrained(model)
    from gemmaforge.model_spec import read_spec

    family = read_spec(model).family
    lengths, seen = [], set()
    for row in written(tmp_path / "out"):
        pictures = [Image.open(p).convert("RGB") for p in row["images"]]
        counts = processor(images=pictures, return_tensors="pt")["num_soft_tokens_per_image"].tolist()
        seen.update(counts)
        parts = family.chat.render(row["messages"]).text.split("<|image|>")
        text = parts[0] + "".join(f"<|image>{'<|image|>' * n}<image|>{rest}" for n, rest in zip(counts, parts[1:]))
        lengths.append(len(tokenizer(text, add_special_tokens=False).input_ids))
    stats = json.loads((tmp_path / "out" / "stats.json").read_text())
    assert len(seen) > 1  # the demo's pictures differ in shape, and so in tokens
    assert stats["tokens"]["total"] == sum(lengths) and stats["tokens"]["max"] == max(lengths)


def test_openai_parts_local_path_and_data_uri(checkpoint_of, tmp_path: Path) -> None:
    (tmp_path / "pics").mkdir()
    (tmp_path / "pics" / "red.png").write_bytes(png((200, 0, 0)))
    uri = "data:image/png;base64," + base64.b64encode(png((0, 0, 200))).decode()
    records = [
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "pics/red.png"}},
                                                   {"type": "text", "text": QUESTION}]},
                      {"role": "assistant", "content": "red"}]},
        {"messages": [{"role": "user", "content": [{"type": "text", "text": QUESTION + " "},
                                                   {"type": "image_url", "image_url": {"url": uri}}]},
                      {"role": "assistant", "content": "blue"}]},
    ]
    data = tmp_path / "chat.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in records))
    assert prepare(data, checkpoint_of("gemma3-mm"), tmp_path / "out") == 0
    rows = {row["messages"][-1]["content"]: row for row in written(tmp_path / "out")}
    assert rows["red"]["messages"][0]["content"] == "<start_of_image>" + QUESTION
    assert rows["red"]["images"] == [str(tmp_path / "pics" / "red.png")]
    assert rows["blue"]["messages"][0]["content"] == QUESTION + " <start_of_image>"
    (stored,) = rows["blue"]["images"]  # the data URI's picture, written once beside the data, named by its hash
    assert Path(stored).parent == tmp_path / "out" / "images" and Path(stored).read_bytes() == png((0, 0, 200))


def test_file_urls_and_image_parts_filled_from_the_images_column(checkpoint_of, tmp_path: Path) -> None:
    """A `file://` URL names a local picture; the chat-template style `{"type": "image"}` part takes the next entry
    of the record's `images` column, in order."""
    for name, colour in (("red", (200, 0, 0)), ("green", (0, 200, 0)), ("blue", (0, 0, 200))):
        (tmp_path / f"{name}.png").write_bytes(png(colour))
    records = [
        {"messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": (tmp_path / "red.png").as_uri()}},
            {"type": "text", "text": QUESTION}]}, {"role": "assistant", "content": "red"}]},
        {"messages": [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "and"},
                                                   {"type": "image"}]},
                      {"role": "assistant", "content": "green, blue"}],
         "images": ["green.png", "blue.png"]},
    ]
    data = tmp_path / "chat.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in records))
    assert prepare(data, checkpoint_of("gemma3-mm"), tmp_path / "out") == 0
    rows = {row["messages"][-1]["content"]: row for row in written(tmp_path / "out")}
    assert rows["red"]["images"] == [str(tmp_path / "red.png")]
    assert rows["green, blue"]["messages"][0]["content"].count("<start_of_image>") == 2
    assert rows["green, blue"]["images"] == [str(tmp_path / "green.png"), str(tmp_path / "blue.png")]


def test_parquet_image_bytes_are_written_once_named_by_their_hash(checkpoint_of, tmp_path: Path) -> None:
    """A Parquet `images` column of Hugging Face Image structs ({bytes, path}): the bytes go to the data folder's
    images/<sha256>.<ext>; two records with the same picture share the file."""
    import hashlib

    import pyarrow as pa
    import pyarrow.parquet as pq

    red, blue = png((200, 0, 0)), png((0, 0, 200))
    table = pa.table({
        "instruction": [f"<image>{QUESTION}", f"<image>{QUESTION} Again.", f"<image>{QUESTION}"],
        "output": ["red", "red again", "blue"],
        "images": [[{"bytes": red, "path": None}], [{"bytes": red, "path": None}], [{"bytes": blue, "path": None}]],
    })
    pq.write_table(table, tmp_path / "data.parquet")
    assert prepare(tmp_path / "data.parquet", checkpoint_of("gemma3-mm"), tmp_path / "out") == 0
    rows = {row["messages"][-1]["content"]: row for row in written(tmp_path / "out")}
    stored = tmp_path / "out" / "images"
    assert rows["red"]["images"] == rows["red again"]["images"] == [
        str(stored / f"{hashlib.sha256(red).hexdigest()}.png")]
    assert sorted(p.name for p in stored.iterdir()) == sorted(
        f"{hashlib.sha256(b).hexdigest()}.png" for b in (red, blue))
    assert Path(rows["blue"]["images"][0]).read_bytes() == blue


def test_folder_of_images_with_file_names(checkpoint_of, tmp_path: Path) -> None:
    """Hugging Face's imagefolder metadata: the file_name's image opens the first user turn."""
    folder = tmp_path / "shapes"
    folder.mkdir()
    rows = []
    for i, colour in enumerate([(200, 0, 0), (0, 200, 0), (0, 0, 200)]):
        (folder / f"{i}.png").write_bytes(png(colour))
        rows.append({"file_name": f"{i}.png", "instruction": QUESTION, "output": f"colour {i}"})
    rows.append({"instruction": "Say hi.", "output": "hi"})  # text records mix with image records
    (folder / "metadata.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert prepare(folder, checkpoint_of("gemma4-e2b"), tmp_path / "out") == 0
    out = {row["messages"][-1]["content"]: row for row in written(tmp_path / "out")}
    assert out["colour 1"]["messages"][0]["content"] == "<|image|>" + QUESTION
    assert out["colour 1"]["images"] == [str(folder / "1.png")]
    assert "images" not in out["hi"]


def test_the_same_question_of_another_picture_is_no_duplicate(checkpoint_of, tmp_path: Path) -> None:
    for name, colour in (("a", (200, 0, 0)), ("b", (0, 200, 0)), ("c", (200, 0, 0))):
        (tmp_path / f"{name}.png").write_bytes(png(colour))
    records = [{"instruction": f"<image>{QUESTION}", "output": "a colour", "images": [f"{name}.png"]}
               for name in "abc"]  # c is a copy of a's picture: a duplicate
    (tmp_path / "data.json").write_text(json.dumps(records))
    assert prepare(tmp_path / "data.json", checkpoint_of("gemma3-mm"), tmp_path / "out") == 0
    stats = json.loads((tmp_path / "out" / "stats.json").read_text())
    assert stats["kept"] == 2 and stats["dropped"] == {"duplicate": 1}


BAD_RECORDS = {
    "missing": ({"instruction": "<image>Hi", "output": "x", "images": ["nope.png"]}, "image nope.png not found"),
    "remote": ({"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "https://example.com/a.png"}}]},
        {"role": "assistant", "content": "x"}]}, "remote images are not downloaded"),
    "not an image": ({"instruction": "<image>Hi", "output": "x", "images": ["text.png"]},
                     "not a picture PIL can read"),
    "float pixels": ({"instruction": "<image>Hi", "output": "x", "images": ["depth.tif"]}, "has pixel mode F"),
    "too few placeholders": ({"instruction": "Hi", "output": "x", "images": ["ok.png"]},
                             "1 image(s) but 0 <image> placeholder(s)"),
    "image in an answer": ({"instruction": "<image>Hi", "output": "<image>", "images": ["ok.png", "ok.png"]},
                           "outside the user turns"),
    "bad data URI": ({"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "data:image/png,abc"}}]},
        {"role": "assistant", "content": "x"}]}, "expected a base64 data URI"),
}


@pytest.mark.parametrize("case", BAD_RECORDS)
@pytest.mark.slow
def test_bad_images_exit_2_naming_the_record(case: str, checkpoint_of, tmp_path: Path, capsys) -> None:
    (tmp_path / "ok.png").write_bytes(png((1, 2, 3)))
    (tmp_path / "text.png").write_text("not a picture")
    (tmp_path / "depth.tif").write_bytes(png((0, 0, 0), mode="F"))
    record, expected = BAD_RECORDS[case]
    good = {"instruction": "<image>Fine", "output": "y", "images": ["ok.png"]} if "instruction" in record else \
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "ok.png"}}]},
                      {"role": "assistant", "content": "y"}]}  # the first record shows the format
    data = tmp_path / "data.jsonl"
    data.write_text(json.dumps(good) + "\n" + json.dumps(record) + "\n")
    assert prepare(data, checkpoint_of("gemma3-mm"), tmp_path / "out") == 2
    err = capsys.readouterr().err
    assert f"{data} line 2" in err and expected in err, err
    assert not (tmp_path / "out").exists()  # nothing half-written


def test_huge_image_is_refused_from_its_header(checkpoint_of, tmp_path: Path, capsys, monkeypatch) -> None:
    import gemmaforge.intake as intake

    monkeypatch.setattr(intake, "MAX_PIXELS", 1000)
    (tmp_path / "big.png").write_bytes(png((1, 2, 3), size=(50, 40)))
    data = tmp_path / "data.jsonl"
    data.write_text(json.dumps({"instruction": "<image>Hi", "output": "x", "images": ["big.png"]}) + "\n")
    assert prepare(data, checkpoint_of("gemma3-mm"), tmp_path / "out") == 2
    assert "the picture is 50x40 pixels, more than the 1,000 accepted" in capsys.readouterr().err


def test_images_for_a_text_only_model_are_refused(tiny_gemma3_dir: Path, tmp_path: Path, capsys) -> None:
    (tmp_path / "ok.png").write_bytes(png((1, 2, 3)))
    data = tmp_path / "data.jsonl"
    data.write_text(json.dumps({"instruction": "<image>Hi", "output": "x", "images": ["ok.png"]}) + "\n")
    assert prepare(data, tiny_gemma3_dir, tmp_path / "out") == 2
    assert "the record has images, but the model takes none (" in capsys.readouterr().err


def test_video_columns_are_still_refused(llamafactory_data: Path, checkpoint_of, tmp_path: Path, capsys) -> None:
    assert prepare(llamafactory_data, checkpoint_of("gemma3-mm"), tmp_path / "out", "--dataset",
                   "mllm_video_demo") == 2
    assert "columns.videos: video data is not supported" in capsys.readouterr().err


@pytest.mark.slow
def test_inspect_shows_each_image_slot_and_counts_its_tokens(llamafactory_data: Path, checkpoint_of, capsys) -> None:
    """`data inspect` on LLaMA-Factory's file itself: one slot per image with the processor's token count, the same
    lengths `data prepare` records, and --json naming the pictures."""
    model = checkpoint_of("gemma4-e2b")
    source = llamafactory_data / "mllm_demo.json"
    assert main(["data", "inspect", str(source), "--model", str(model), "-n", "1"]) == 0
    shown = capsys.readouterr().out
    assert "conversation 1: " in shown and "2 image(s)" in shown
    assert shown.count("x <|image|>]") == 2  # the first conversation's two pictures, each one slot
    assert main(["data", "inspect", str(source), "--model", str(model), "--json"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    image_id = load_tokenizer(model).image_token_id
    records = json.loads(source.read_text())
    assert [row["images"] for row in rows] == [[str((llamafactory_data / p).resolve()) for p in r["images"]]
                                               for r in records]
    for row in rows:
        supervised = [t for t, label in zip(row["input_ids"], row["labels"]) if label != -100]
        assert image_id in row["input_ids"] and image_id not in supervised
