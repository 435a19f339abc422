import json
from pathlib import Path

import pytest

from gemmaforge.config import DataConfig
from gemmaforge.data.prepare import prepare_data, read_prepared, split
from gemmaforge.errors import UserError

RECORDS = [
    {"instruction": f"问题 {i}", "input": "背景" if i % 3 == 0 else "", "output": f"  回答 {i}\n"} for i in range(20)
]


def test_alpaca_json_array_becomes_messages(tmp_path: Path) -> None:
    src = tmp_path / "d.json"
    src.write_text(json.dumps(RECORDS, ensure_ascii=False), encoding="utf-8")
    stats = prepare_data(DataConfig(path=str(src), val_size=0.2, system="你是助手"), 1, tmp_path / "data")
    assert (stats["format"], stats["train"], stats["val"]) == ("alpaca", 16, 4)
    train = read_prepared(tmp_path / "data" / "train.jsonl")
    val = read_prepared(tmp_path / "data" / "val.jsonl")
    assert len(train) == 16 and len(val) == 4
    by_question = {m[1]["content"]: m for m in train + val}
    assert by_question["问题 3\n\n背景"] == [
        {"role": "system", "content": "你是助手"},
        {"role": "user", "content": "问题 3\n\n背景"},
        {"role": "assistant", "content": "回答 3"},
    ]
    assert json.loads((tmp_path / "data" / "stats.json").read_text())["records"] == 20


def test_jsonl_and_val_count(tmp_path: Path) -> None:
    src = tmp_path / "d.jsonl"
    src.write_text("\n".join(json.dumps(r) for r in RECORDS) + "\n\n", encoding="utf-8")
    stats = prepare_data(DataConfig(path=str(src), val_size=3), 1, tmp_path / "data")
    assert (stats["train"], stats["val"]) == (17, 3)


def test_split_is_seeded() -> None:
    items = list(range(50))
    assert split(items, 0.1, 7) == split(items, 0.1, 7)
    assert split(items, 0.1, 7) != split(items, 0.1, 8)
    with pytest.raises(UserError, match="leaves no training examples"):
        split(items, 50, 7)


BAD_INPUTS = {
    "malformed JSON array": ("d.json", '[{"instruction": "a", "output": "b"},\n {"instruction": }]', r"d\.json line 2 column \d+: malformed JSON"),
    "bad JSONL line": ("d.jsonl", '{"instruction": "a", "output": "b"}\n{oops\n', r"d\.jsonl line 2: malformed JSON"),
    "missing field": ("d.json", '[{"instruction": "a", "output": "b"}, {"instruction": "a"}]', r"d\.json record 1: field 'output' is missing"),
    "empty file": ("d.json", "  \n", r"d\.json: file is empty"),
    "object not list": ("d.jsonl", '[1, 2]', r"d\.jsonl record 0: cannot detect the dataset format"),
    "empty answer": ("d.json", '[{"instruction": "a", "output": "  "}]', r"d\.json record 0: empty instruction or output"),
    "unknown shape": ("d.json", '[{"question": "a", "answer": "b"}]', r"record 0: cannot detect the dataset format \(keys: answer, question\)"),
}


@pytest.mark.parametrize("name", list(BAD_INPUTS))
def test_bad_input_names_file_and_place(tmp_path: Path, name: str) -> None:
    filename, text, pattern = BAD_INPUTS[name]
    src = tmp_path / filename
    src.write_text(text, encoding="utf-8")
    with pytest.raises(UserError, match=pattern):
        prepare_data(DataConfig(path=str(src)), 1, tmp_path / "data")
    assert not (tmp_path / "data").exists()


def test_non_utf8_names_the_line(tmp_path: Path) -> None:
    src = tmp_path / "d.jsonl"
    src.write_bytes(b'{"instruction": "a", "output": "b"}\n{"instruction": "\xff\xfe", "output": "b"}\n')
    with pytest.raises(UserError, match=r"d\.jsonl line 2: not UTF-8"):
        prepare_data(DataConfig(path=str(src)), 1, tmp_path / "data")


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(UserError, match="data file not found"):
        prepare_data(DataConfig(path=str(tmp_path / "nope.json")), 1, tmp_path / "data")
