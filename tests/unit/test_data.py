"""The data stage end to end on files: every input shape, cleaning counts, split, atomic outputs."""

import json
from pathlib import Path
from typing import Any

import pytest

from gemmaforge.config import CleanConfig, DataConfig
from gemmaforge.data.prepare import prepare_data, read_prepared
from gemmaforge.errors import UserError
from gemmaforge.families import FAMILIES

GEMMA3 = FAMILIES["gemma3"]
RECORDS = [
    {"instruction": f"问题 {i}", "input": "背景" if i % 3 == 0 else "", "output": f"  回答 {i}\n"} for i in range(20)
]


@pytest.fixture(scope="module")
def tok(gemma3_tokenizer):
    return gemma3_tokenizer


def write(path: Path, records: Any, jsonl: bool = False) -> Path:
    if jsonl:
        path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records), encoding="utf-8")
    else:
        path.write_text(json.dumps(records, ensure_ascii=False, indent=1), encoding="utf-8")
    return path


def prepare(tmp_path: Path, tok, cutoff_len: int = 512, **data: Any) -> tuple[dict[str, Any], list, list]:
    out = tmp_path / "data"
    stats = prepare_data(DataConfig(**data), 1, out, tok, GEMMA3, cutoff_len)
    return stats, read_prepared(out / "train.jsonl"), read_prepared(out / "val.jsonl")


def test_alpaca_json_array_becomes_messages(tmp_path: Path, tok) -> None:
    """Also docs/configuration.md (data.system): a record's own system prompt is kept; data.system goes to the others.
    """
    records = [*RECORDS[:-1], {**RECORDS[-1], "system": "你是咖啡师"}]
    src = write(tmp_path / "d.json", records)
    stats, train, val = prepare(tmp_path, tok, path=str(src), val_size=0.2, system="你是助手")
    assert (stats["format"], stats["train"], stats["val"]) == ("alpaca (instruction/input/output)", 16, 4)
    by_question = {m[1]["content"]: m for m in train + val}
    assert by_question["问题 3\n背景"] == [  # instruction and input joined by one newline, as LLaMA-Factory does
        {"role": "system", "content": "你是助手"},
        {"role": "user", "content": "问题 3\n背景"},
        {"role": "assistant", "content": "  回答 3\n"},
    ]
    assert by_question["问题 19"][0] == {"role": "system", "content": "你是咖啡师"}
    assert [m[0] for m in train + val].count({"role": "system", "content": "你是助手"}) == 19
    written = json.loads((tmp_path / "data" / "stats.json").read_text())
    assert written["records"] == 20 and written["kept"] == 20 and written["tokens"]["max"] < 40


def test_alpaca_history_and_system_columns(tmp_path: Path, tok) -> None:
    record = {"instruction": "再说一遍", "input": "", "output": "好的：三分钟。", "system": "你是咖啡师",
              "history": [["萃取要多久？", "三分钟。"]]}
    src = write(tmp_path / "d.jsonl", [record, {**record, "instruction": "另一个问题"}], jsonl=True)
    _, train, val = prepare(tmp_path, tok, path=str(src), val_size=0)
    assert val == []
    assert train[0] == [
        {"role": "system", "content": "你是咖啡师"},
        {"role": "user", "content": "萃取要多久？"},
        {"role": "assistant", "content": "三分钟。"},
        {"role": "user", "content": "再说一遍"},
        {"role": "assistant", "content": "好的：三分钟。"},
    ]


def test_sharegpt_multi_turn_with_system(tmp_path: Path, tok) -> None:
    conv = {"conversations": [
        {"from": "system", "value": "你是客服"}, {"from": "human", "value": "订单到哪了？"},
        {"from": "gpt", "value": "请提供订单号。"}, {"from": "human", "value": "QH001"},
        {"from": "gpt", "value": "已发货。"},
    ]}
    src = write(tmp_path / "d.json", [conv])
    stats, train, _ = prepare(tmp_path, tok, path=str(src), val_size=0)
    assert stats["format"] == "sharegpt (conversations: from/value)"
    assert [m["role"] for m in train[0]] == ["system", "user", "assistant", "user", "assistant"]


def test_openai_messages_jsonl_with_developer_role(tmp_path: Path, tok) -> None:
    rows = [{"messages": [{"role": "developer", "content": "Be brief."}, {"role": "user", "content": f"Q{i}"},
                          {"role": "assistant", "content": f"A{i}"}]} for i in range(10)]
    src = write(tmp_path / "d.jsonl", rows, jsonl=True)
    stats, train, val = prepare(tmp_path, tok, path=str(src), val_size=2)
    assert stats["format"] == "openai (messages: role/content)" and (len(train), len(val)) == (8, 2)
    assert train[0][0] == {"role": "system", "content": "Be brief."}


def test_csv_and_parquet(tmp_path: Path, tok) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    csv_path = tmp_path / "d.csv"
    csv_path.write_text('instruction,input,output\n"多行\n问题",,回答一\n问题二,补充,回答二\n', encoding="utf-8")
    _, train, _ = prepare(tmp_path, tok, path=str(csv_path), val_size=0)
    assert [m[0]["content"] for m in train] == ["多行\n问题", "问题二\n补充"]
    pq.write_table(pa.Table.from_pylist(RECORDS), tmp_path / "d.parquet")
    stats, train, val = prepare(tmp_path, tok, path=str(tmp_path / "d.parquet"), val_size=5)
    assert (stats["records"], len(train), len(val)) == (20, 15, 5)


def test_column_mapping_for_plain_files(tmp_path: Path, tok) -> None:
    src = write(tmp_path / "d.json", [{"q": "一加一？", "a": "二。"}])
    _, train, _ = prepare(
        tmp_path, tok, path=str(src), val_size=0, format="alpaca",
        columns={"prompt": "q", "response": "a", "query": None}
    )
    assert train == [[{"role": "user", "content": "一加一？"}, {"role": "assistant", "content": "二。"}]]


def test_split_is_seeded_and_explicit_eval_file(tmp_path: Path, tok) -> None:
    src = write(tmp_path / "d.json", RECORDS)
    _, train_a, val_a = prepare(tmp_path / "a", tok, path=str(src), val_size=0.25)
    _, _, val_b = prepare(tmp_path / "b", tok, path=str(src), val_size=0.25)
    assert val_a == val_b and len(val_a) == 5 and not any(m in train_a for m in val_a)
    held_out = write(tmp_path / "eval.json", RECORDS[:2] + [{"instruction": "新问题", "output": "新回答"}])
    stats, train, val = prepare(tmp_path / "c", tok, path=str(src), eval_path=str(held_out))
    assert len(train) == 20 and [m[0]["content"] for m in val] == ["新问题"]
    assert stats["sources"][1]["dropped"] == {"duplicate": 2}  # held-out copies of training examples leak


def test_cleaning_counts_every_change_and_drop(tmp_path: Path, tok) -> None:
    records = [
        {"instruction": "<p>HTML&nbsp;问题</p>", "output": "答案<br>第二行 &amp; 更多"},
        {"instruction": "控制\x07字符\u200b", "output": "正常"},
        {"instruction": "代码", "output": "用 `<div>` 包起来：\n```html\n<p>hi</p>\n```"},
        {"instruction": "重复", "output": "一样"},
        {"instruction": "重复", "output": "一样"},
        {"instruction": "只有标签", "output": "<br><p></p>"},
        {"instruction": "长" * 10, "output": "很长的回答。" * 200},
    ]
    src = write(tmp_path / "d.json", records)
    stats, train, _ = prepare(tmp_path, tok, cutoff_len=128, path=str(src), val_size=0)
    assert stats["changed"] == {"html": 2, "control_chars": 1}  # the tag-only answer was changed, then dropped
    assert stats["dropped"] == {"duplicate": 1, "empty_after_cleaning": 1, "too_long": 1}
    contents = {m[0]["content"].strip(): m[1]["content"].strip() for m in train}
    assert contents["HTML\xa0问题"] == "答案\n第二行 & 更多"
    assert contents["控制字符"] == "正常"
    assert contents["代码"] == "用 `<div>` 包起来：\n```html\n<p>hi</p>\n```"  # code is never stripped
    assert stats["kept"] == len(train) == 4


def test_truncate_policy_cuts_the_last_answer_to_fit(tmp_path: Path, tok) -> None:
    src = write(tmp_path / "d.json", [{"instruction": "讲讲咖啡", "output": "咖啡的历史很长。" * 100}])
    clean = CleanConfig(overlong="truncate")
    stats, train, _ = prepare(tmp_path, tok, cutoff_len=64, path=str(src), val_size=0, clean=clean)
    assert stats["changed"] == {"truncated": 1} and stats["tokens"]["max"] <= 64
    answer = train[0][1]["content"]
    assert "咖啡的历史很长。" * 100 != answer and ("咖啡的历史很长。" * 100).startswith(answer)


def test_min_answer_tokens_and_drop_empty(tmp_path: Path, tok) -> None:
    records = [{"instruction": "a", "output": "好"}, {"instruction": "b", "output": "   "},
               {"instruction": "c", "output": "这是一个足够长的回答。"}]
    src = write(tmp_path / "d.json", records)
    with pytest.raises(UserError, match=r"d\.json record 1: empty assistant turn.*drop_empty=true"):
        prepare(tmp_path, tok, path=str(src), val_size=0)
    stats, train, _ = prepare(
        tmp_path, tok, path=str(src), val_size=0, clean=CleanConfig(drop_empty=True, min_answer_tokens=3)
    )
    assert stats["dropped"] == {"empty": 1, "too_short": 1} and len(train) == 1


def test_near_duplicates(tmp_path: Path, tok) -> None:
    base = "手冲咖啡的水温一般在九十到九十六摄氏度之间，浅烘焙的豆子可以用更高的水温来萃取出明亮的酸质。"
    records = [{"instruction": "水温？", "output": base},
               {"instruction": "水温?", "output": base.replace("明亮", "明朗")},
               {"instruction": "研磨？", "output": "研磨度要根据滤杯和冲煮时间来调整，粗细均匀最重要。"}]
    src = write(tmp_path / "d.json", records)
    stats, _, _ = prepare(tmp_path, tok, path=str(src), val_size=0)
    assert stats["dropped"] == {}
    stats, _, _ = prepare(tmp_path, tok, path=str(src), val_size=0,
                          clean=CleanConfig(dedup="near", near_dup_threshold=0.8))
    assert stats["dropped"] == {"near_duplicate": 1}


def test_labels_options_change_supervised_counts(tmp_path: Path, tok) -> None:
    conv = {"conversations": [{"from": "human", "value": "一"}, {"from": "gpt", "value": "二"},
                              {"from": "human", "value": "三"}, {"from": "gpt", "value": "四"}]}
    src = write(tmp_path / "d.json", [conv])
    counts = {}
    for name, options in {"default": {}, "mask_history": {"mask_history": True},
                          "prompt": {"train_on_prompt": True}}.items():
        stats, _, _ = prepare(tmp_path / name, tok, path=str(src), val_size=0, **options)
        counts[name] = stats["supervised_tokens"]["total"]
    assert counts["mask_history"] < counts["default"] < counts["prompt"]
    assert counts == {"default": 4, "mask_history": 2, "prompt": stats["tokens"]["total"] - 1}


def test_failed_prepare_keeps_previous_outputs(tmp_path: Path, tok) -> None:
    good = write(tmp_path / "good.json", RECORDS)
    prepare(tmp_path, tok, path=str(good))
    before = {name: (tmp_path / "data" / name).read_bytes() for name in ("train.jsonl", "val.jsonl", "stats.json")}
    bad = tmp_path / "bad.jsonl"
    bad.write_text("".join(json.dumps(r) + "\n" for r in RECORDS) + "{oops\n", encoding="utf-8")
    with pytest.raises(UserError, match=r"bad\.jsonl line 21: malformed JSON"):
        prepare(tmp_path, tok, path=str(bad))
    assert {name: (tmp_path / "data" / name).read_bytes() for name in before} == before
    assert sorted(p.name for p in (tmp_path / "data").iterdir()) == ["stats.json", "train.jsonl", "val.jsonl"]


BAD_INPUTS = {
    "malformed JSON array": ("d.json", '[{"instruction": "a", "output": "b"},\n {"instruction": }]',
                             r"d\.json line 2 column \d+: malformed JSON"),
    "bad JSONL line": ("d.jsonl", '{"instruction": "a", "output": "b"}\n{oops\n', r"d\.jsonl line 2: malformed JSON"),
    "missing field": ("d.json", '[{"instruction": "a", "output": "b"}, {"instruction": "a"}]',
                      r"d\.json record 1: field 'output' is missing"),
    "empty file": ("d.json", "  \n", r"d\.json: file is empty"),
    "empty array": ("d.json", "[]", r"d\.json: the JSON array is empty"),
    "object not list": ("d.json", '{"instruction": "a",\n "output": "b"}',
                        r"d\.json line 1: malformed JSON .*use a JSON array"),
    "scalar records": ("d.jsonl", "[1, 2]", r"d\.jsonl record 0: cannot detect the dataset format \(keys: int\)"),
    "empty answer": ("d.json", '[{"instruction": "a", "output": "  "}]', r"d\.json record 0: empty assistant turn"),
    "unknown shape": ("d.json", '[{"question": "a", "answer": "b"}]',
                      r"record 0: cannot detect the dataset format \(keys: answer, question\)"),
    "unknown role": ("d.jsonl",
                     '{"conversations": [{"from": "human", "value": "a"}, {"from": "bot", "value": "b"}]}',
                     r"d\.jsonl line 1: turn 2 has unknown role 'bot' \(from\)"),
    "roles not alternating": ("d.jsonl",
                              '{"messages": [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]}',
                              r"d\.jsonl line 1: turn 2 has role 'user', expected 'assistant'"),
    "ends with user": ("d.jsonl", '{"messages": [{"role": "user", "content": "a"}]}',
                       r"d\.jsonl line 1: the last turn is from the user"),
    "late system": ("d.jsonl", '{"messages": [{"role": "user", "content": "a"}, {"role": "system", "content": "b"}]}',
                    r"turn 2 is a system message"),
    "tool turn": ("d.jsonl", '{"messages": [{"role": "user", "content": "a"}, {"role": "tool", "content": "b"}]}',
                  r"turn 2 has role 'tool', expected 'assistant' \(tool results follow an assistant message"),
    "csv ragged": ("d.csv", "instruction,output\na,b,c\n", r"d\.csv line 2: more cells than the 2 header columns"),
}


@pytest.mark.parametrize("name", list(BAD_INPUTS))
def test_bad_input_names_file_and_place(tmp_path: Path, tok, name: str) -> None:
    filename, text, pattern = BAD_INPUTS[name]
    src = tmp_path / filename
    src.write_text(text, encoding="utf-8")
    with pytest.raises(UserError, match=pattern):
        prepare(tmp_path, tok, path=str(src))
    assert not (tmp_path / "data").exists()


def test_non_utf8_names_the_line(tmp_path: Path, tok) -> None:
    src = tmp_path / "d.jsonl"
    src.write_bytes(b'{"instruction": "a", "output": "b"}\n{"instruction": "\xff\xfe", "output": "b"}\n')
    with pytest.raises(UserError, match=r"d\.jsonl line 2: not UTF-8"):
        prepare(tmp_path, tok, path=str(src))
    src = tmp_path / "d.json"
    src.write_bytes(b'[{"instruction": "a",\n "output": "\xff"}]')
    with pytest.raises(UserError, match=r"d\.json line 2: not UTF-8"):
        prepare(tmp_path, tok, path=str(src))


def test_missing_file_and_bad_val_size(tmp_path: Path, tok) -> None:
    with pytest.raises(UserError, match="data file not found"):
        prepare(tmp_path, tok, path=str(tmp_path / "nope.json"))
    src = write(tmp_path / "d.json", RECORDS[:3])
    with pytest.raises(UserError, match="leaves no training examples out of 3"):
        prepare(tmp_path, tok, path=str(src), val_size=3)
