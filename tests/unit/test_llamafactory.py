"""LLaMA-Factory data folders load unchanged: dataset_info.json entries with columns and tags."""

import json
from pathlib import Path

import pytest

from gemmaforge.config import DataConfig
from gemmaforge.data.prepare import prepare_data, read_prepared
from gemmaforge.errors import UserError
from gemmaforge.families import FAMILIES

# The shapes of LLaMA-Factory's own data/README: alpaca with mapped columns and a system column,
# sharegpt with default tags, and OpenAI-style messages declared through sharegpt tags.
DATASET_INFO = {
    "shop_alpaca": {
        "file_name": "shop_alpaca.json",
        "columns": {"prompt": "question", "query": "context", "response": "answer", "system": "persona",
                    "history": "past"},
    },
    "shop_sharegpt": {"file_name": "shop_sharegpt.jsonl", "formatting": "sharegpt"},
    "shop_openai": {
        "file_name": "openai_dir",
        "formatting": "sharegpt",
        "columns": {"messages": "messages"},
        "tags": {"role_tag": "role", "content_tag": "content", "user_tag": "user", "assistant_tag": "assistant",
                 "system_tag": "system"},
    },
    "sampled": {"file_name": "shop_sharegpt.jsonl", "formatting": "sharegpt", "num_samples": 3},
    "from_hub": {"hf_hub_url": "someone/dataset"},
    "prefs": {"file_name": "shop_alpaca.json", "ranking": True},
    "typo": {"file_name": "shop_alpaca.json", "colums": {}},
}


@pytest.fixture()
def lf_dir(tmp_path: Path) -> Path:
    root = tmp_path / "lf_data"
    (root / "openai_dir").mkdir(parents=True)
    (root / "dataset_info.json").write_text(json.dumps(DATASET_INFO), encoding="utf-8")
    alpaca = [{"question": f"能退货吗 {i}", "context": "买了 3 天", "answer": "可以，7 天内无理由退货。",
               "persona": "你是客服", "past": [["你好", "您好！"]]} for i in range(4)]
    (root / "shop_alpaca.json").write_text(json.dumps(alpaca, ensure_ascii=False), encoding="utf-8")
    sharegpt = [{"conversations": [{"from": "human", "value": f"运费多少 {i}"},
                                   {"from": "gpt", "value": "满 99 元包邮。"}]}
                for i in range(6)]
    (root / "shop_sharegpt.jsonl").write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in sharegpt),
                                              encoding="utf-8")
    for part in range(2):
        rows = [{"messages": [{"role": "system", "content": "简洁回答"},
                              {"role": "user", "content": f"发票 {part}-{i}"},
                              {"role": "assistant", "content": "可以在订单详情页申请。"}]} for i in range(2)]
        (root / "openai_dir" / f"part{part}.jsonl").write_text("".join(json.dumps(r, ensure_ascii=False) + "\n"
                                                                       for r in rows), encoding="utf-8")
    return root


def load(lf_dir: Path, tmp_path: Path, tok, dataset: str) -> tuple[dict, list]:
    config = DataConfig(path=str(lf_dir), dataset=dataset, val_size=0)
    stats = prepare_data(config, 3, tmp_path / "out", tok, FAMILIES["gemma3"], 512)
    return stats, read_prepared(tmp_path / "out" / "train.jsonl")


def test_entries_with_columns_and_tags_load_unchanged(lf_dir: Path, tmp_path: Path, gemma3_tokenizer) -> None:
    stats, train = load(lf_dir, tmp_path, gemma3_tokenizer, "shop_alpaca,shop_sharegpt,shop_openai")
    assert [s["label"] for s in stats["sources"]] == ["lf_data/shop_alpaca", "lf_data/shop_sharegpt",
                                                      "lf_data/shop_openai"]
    assert [s["kept"] for s in stats["sources"]] == [4, 6, 4]
    assert train[0] == [
        {"role": "system", "content": "你是客服"},
        {"role": "user", "content": "你好"},
        {"role": "assistant", "content": "您好！"},
        {"role": "user", "content": "能退货吗 0\n买了 3 天"},
        {"role": "assistant", "content": "可以，7 天内无理由退货。"},
    ]
    assert train[-1][0] == {"role": "system", "content": "简洁回答"}


def test_num_samples_is_a_seeded_subset(lf_dir: Path, tmp_path: Path, gemma3_tokenizer) -> None:
    stats, train = load(lf_dir, tmp_path, gemma3_tokenizer, "sampled")
    assert stats["records"] == 3 and len(train) == 3
    _, again = load(lf_dir, tmp_path / "again", gemma3_tokenizer, "sampled")
    assert again == train


def test_num_samples_above_the_records_repeats_some(lf_dir: Path, tmp_path: Path, gemma3_tokenizer) -> None:
    """As LLaMA-Factory oversamples: every record, then seeded random repeats (kept when dedup is off)."""
    info = json.loads((lf_dir / "dataset_info.json").read_text())
    info["sampled"]["num_samples"] = 9  # of 6
    (lf_dir / "dataset_info.json").write_text(json.dumps(info))
    config = DataConfig(path=str(lf_dir), dataset="sampled", val_size=0, clean={"dedup": "none"})
    stats = prepare_data(config, 3, tmp_path / "out", gemma3_tokenizer, FAMILIES["gemma3"], 512)
    questions = [c[-2]["content"] for c in read_prepared(tmp_path / "out" / "train.jsonl")]
    assert stats["records"] == len(questions) == 9 and set(questions) == {f"运费多少 {i}" for i in range(6)}


def test_max_samples_takes_the_first_records_of_each_dataset(lf_dir: Path, tmp_path: Path, gemma3_tokenizer) -> None:
    """data.max_samples (LLaMA-Factory's max_samples): the first N of each source, after its num_samples subset."""
    config = DataConfig(path=str(lf_dir), dataset="shop_alpaca,shop_sharegpt,sampled", val_size=0, max_samples=2)
    stats = prepare_data(config, 3, tmp_path / "out", gemma3_tokenizer, FAMILIES["gemma3"], 512)
    assert [s["records"] for s in stats["sources"]] == [2, 2, 2]
    questions = {conversation[-2]["content"] for conversation in read_prepared(tmp_path / "out" / "train.jsonl")}
    assert {"能退货吗 0\n买了 3 天", "能退货吗 1\n买了 3 天", "运费多少 0", "运费多少 1"} <= questions
    assert not questions & {"能退货吗 2\n买了 3 天", "运费多少 5"}


@pytest.mark.parametrize(
    "dataset, pattern",
    [
        ("", r"name the dataset\(s\) to use with data.dataset .*shop_alpaca"),
        ("nope", r"no dataset named 'nope'; defined here: shop_alpaca"),
        ("from_hub", r"dataset 'from_hub': hf_hub_url datasets are not downloaded"),
        ("prefs", r"shop_alpaca.json.*a preference pair \(a chosen and a rejected answer\) trains with "
                  r"train.method: dpo"),
        ("typo", r"dataset 'typo': unknown keys colums"),
    ],
)
def test_bad_entries_are_named(lf_dir: Path, tmp_path: Path, gemma3_tokenizer, dataset: str, pattern: str) -> None:
    with pytest.raises(UserError, match=pattern):
        load(lf_dir, tmp_path, gemma3_tokenizer, dataset)


@pytest.mark.parametrize("dataset", ["glaive_toolcall_en_demo", "glaive_toolcall_zh_demo"])
def test_llamafactory_tool_call_datasets_load_unchanged(llamafactory_data: Path, tmp_path: Path, gemma3_tokenizer,
                                                       dataset: str) -> None:
    """LLaMA-Factory's own tool-call demos (a tools column, function_call and observation turns)."""
    config = DataConfig(path=str(llamafactory_data), dataset=dataset, val_size=0)
    stats = prepare_data(config, 3, tmp_path / "out", gemma3_tokenizer, FAMILIES["gemma3"], 2048)
    records = json.loads((llamafactory_data / f"{dataset}.json").read_text(encoding="utf-8"))
    train = read_prepared(tmp_path / "out" / "train.jsonl")
    assert stats["records"] == len(records) and len(train) == stats["kept"] > 0.8 * len(records)
    assert set(stats["dropped"]) <= {"duplicate", "too_long"}  # the demos repeat some records
    assert stats["kept"] + sum(stats["dropped"].values()) == len(records)
    assert 0 < stats["tool_conversations"] < stats["kept"]  # some offer no tools
    calls = [m for conversation in train for m in conversation if m.get("tool_calls")]
    results = [m for conversation in train for m in conversation if m["role"] == "tool"]
    assert len(calls) > 50 and len(results) > 50  # most demos call a tool and read its result
    first = train[0]
    assert first[0]["role"] == "system" and first[0]["content"] == ""
    assert first[0]["tools"] == [{"type": "function", "function": t} for t in json.loads(records[0]["tools"])]
    called = next(m for m in first if m.get("tool_calls"))
    function_call = next(t for t in records[0]["conversations"] if t["from"] == "function_call")
    assert called == {"role": "assistant", "content": "", "tool_calls": [json.loads(function_call["value"])]}


def test_bad_tool_data_is_named(lf_dir: Path, tmp_path: Path, gemma3_tokenizer) -> None:
    info = json.loads((lf_dir / "dataset_info.json").read_text(encoding="utf-8"))
    info["calls"] = {"file_name": "calls.json", "formatting": "sharegpt", "columns": {"tools": "tools"}}
    (lf_dir / "dataset_info.json").write_text(json.dumps(info), encoding="utf-8")
    def turns(call: str) -> list[dict[str, str]]:
        return [{"from": "human", "value": "hi"}, {"from": "function_call", "value": call},
                {"from": "observation", "value": "ok"}, {"from": "gpt", "value": "done"}]

    good = '{"name": "brew", "arguments": {"shots": 2}}'
    for call, tools, pattern in (
        (good, "[not json", r"calls.json record 0: field 'tools' is not valid JSON"),
        (good, '[{"description": "x"}]', r"calls.json record 0: tools\[0\]: expected a tool definition"),
        ("brew(2)", "[]", r"calls.json record 0: turn 2: a function_call turn must hold its call as JSON"),
        ('{"name": "brew", "arguments": "[1]"}', "[]", r"turn 2: function_call: arguments must be a JSON object"),
    ):
        (lf_dir / "calls.json").write_text(json.dumps([{"conversations": turns(call), "tools": tools}]),
                                           encoding="utf-8")
        with pytest.raises(UserError, match=pattern):
            load(lf_dir, tmp_path, gemma3_tokenizer, "calls")
