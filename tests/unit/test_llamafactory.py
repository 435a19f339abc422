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


@pytest.mark.parametrize(
    "dataset, pattern",
    [
        ("", r"name the dataset\(s\) to use with data.dataset .*shop_alpaca"),
        ("nope", r"no dataset named 'nope'; defined here: shop_alpaca"),
        ("from_hub", r"dataset 'from_hub': hf_hub_url datasets are not downloaded"),
        ("prefs", r"dataset 'prefs': ranking \(preference\) datasets are not supported"),
        ("typo", r"dataset 'typo': unknown keys colums"),
    ],
)
def test_bad_entries_are_named(lf_dir: Path, tmp_path: Path, gemma3_tokenizer, dataset: str, pattern: str) -> None:
    with pytest.raises(UserError, match=pattern):
        load(lf_dir, tmp_path, gemma3_tokenizer, dataset)
