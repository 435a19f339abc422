"""Continued pretraining (`train.method: pt`): raw text in the shapes people have (a `text` column, .txt files,
LLaMA-Factory's c4_demo and wiki_demo, each record's first prompt), prepared with the same cleaning, dedup and split
as conversations; every token a label, texts cut into pieces of cutoff_len; LLaMA-Factory's pretraining example
running as it is; the report's perplexity on held-out text."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from gemmaforge.chat.conversation import IGNORE_INDEX
from gemmaforge.cli import main
from gemmaforge.data.prepare import prepare_data, read_prepared, read_prepared_texts
from gemmaforge.errors import UserError
from gemmaforge.families import FAMILIES
from gemmaforge.models import load_tokenizer
from gemmaforge.recipe.pt import encode_texts

TEXTS = [f"Document {i}: the roaster turns green beans brown at {180 + i} degrees." for i in range(12)]


@pytest.fixture(scope="module")
def tokenizer(tiny_gemma3_dir: Path):
    return load_tokenizer(tiny_gemma3_dir)


def prepared(tmp_path: Path, source: Path, tokenizer, **data: object) -> tuple[dict, list[str], list[str]]:
    from gemmaforge.config import DataConfig

    out = tmp_path / "out"
    stats = prepare_data(DataConfig(path=str(source), val_size=2, **data), 0, out, tokenizer, FAMILIES["gemma3"],
                         64, method="pt")
    return stats, read_prepared_texts(out / "train.jsonl"), read_prepared_texts(out / "val.jsonl")


def test_a_txt_file_is_a_text_per_line_cleaned_and_deduplicated(tmp_path: Path, tokenizer) -> None:
    source = tmp_path / "notes.txt"
    source.write_text("\n".join([TEXTS[0], "", TEXTS[1], TEXTS[0], "<b>Bold</b> &amp; " + TEXTS[2], *TEXTS[3:]]),
                      encoding="utf-8")
    stats, train, val = prepared(tmp_path, source, tokenizer)
    assert stats["method"] == "pt" and stats["records"] == len(TEXTS) + 1  # the empty line is no record
    assert stats["dropped"] == {"duplicate": 1} and stats["changed"] == {"html": 1}
    assert sorted(train + val) == sorted([TEXTS[0], TEXTS[1], "Bold & " + TEXTS[2], *TEXTS[3:]])
    assert len(val) == 2 and stats["supervised_tokens"]["total"] == stats["tokens"]["total"] - len(TEXTS)


def test_a_text_column_and_llamafactory_entries_read_the_first_prompt(tmp_path: Path, tokenizer) -> None:
    source = tmp_path / "web.jsonl"
    source.write_text("".join(json.dumps({"text": t, "url": "x"}) + "\n" for t in TEXTS), encoding="utf-8")
    assert sorted(sum(prepared(tmp_path, source, tokenizer)[1:], [])) == sorted(TEXTS)
    chats = tmp_path / "chats.json"  # a conversation file read for pretraining: its first prompt
    chats.write_text(json.dumps([{"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": t},
                                               {"role": "assistant", "content": "a"}]} for t in TEXTS]))
    assert sorted(sum(prepared(tmp_path, chats, tokenizer)[1:], [])) == sorted(TEXTS)


def test_llamafactory_c4_demo_and_wiki_demo_prepare_as_raw_text(tmp_path: Path, tokenizer,
                                                                 llamafactory_data: Path) -> None:
    for name, records in (("c4_demo", 300), ("wiki_demo", 30)):
        stats, train, val = prepared(tmp_path / name, llamafactory_data, tokenizer, dataset=[name])
        assert stats["records"] == records and len(train) + len(val) == stats["kept"] > 0.9 * records
        assert all(text.strip() for text in train)


def test_conversation_methods_refuse_raw_text_and_the_other_way_round(tmp_path: Path, tokenizer) -> None:
    from gemmaforge.config import DataConfig

    source = tmp_path / "notes.txt"
    source.write_text("\n".join(TEXTS), encoding="utf-8")
    with pytest.raises(UserError, match=r"notes.txt line 1: a record of raw text .* train.method: pt"):
        prepare_data(DataConfig(path=str(source)), 0, tmp_path / "sft", tokenizer, FAMILIES["gemma3"], 64)
    assert not (tmp_path / "sft").exists()  # nothing written
    prepared(tmp_path, source, tokenizer)
    with pytest.raises(UserError, match=r"train.jsonl holds raw text .*prepare the data again"):
        read_prepared(tmp_path / "out" / "train.jsonl")
    empty = tmp_path / "empty.txt"
    empty.write_text("\n\n", encoding="utf-8")
    with pytest.raises(UserError, match=r"empty.txt: file is empty; expected a line of text per document"):
        prepared(tmp_path, empty, tokenizer)


def test_every_token_is_a_label_and_long_texts_are_cut_into_pieces(tokenizer) -> None:
    long_text = " ".join(TEXTS * 3)
    pieces = encode_texts([TEXTS[0], long_text], tokenizer, cutoff_len=32)
    first = tokenizer(TEXTS[0], add_special_tokens=False)["input_ids"]
    assert pieces[0]["input_ids"] == [tokenizer.bos_token_id, *first, tokenizer.eos_token_id]
    assert all(p["labels"] == p["input_ids"] and IGNORE_INDEX not in p["labels"] for p in pieces)
    rest = pieces[1:]
    whole = [tokenizer.bos_token_id, *tokenizer(long_text, add_special_tokens=False)["input_ids"],
             tokenizer.eos_token_id]
    assert [len(p["input_ids"]) for p in rest[:-1]] == [32] * (len(rest) - 1)
    assert sum((p["input_ids"] for p in rest), []) == whole  # cut, never dropped or reordered


@pytest.mark.slow
def test_pt_runs_through_eval_merge_and_gguf_and_reports_perplexity(tmp_path: Path, tiny_gemma3_dir: Path) -> None:
    source = tmp_path / "notes.txt"
    source.write_text("\n".join(TEXTS * 2 + [t.upper() for t in TEXTS]), encoding="utf-8")
    config = {"output_dir": str(tmp_path / "run"), "model": {"name_or_path": str(tiny_gemma3_dir)},
              "data": {"path": str(source), "val_size": 4},
              "lora": {"r": 4, "lora_alpha": 8, "lora_dropout": 0.0},
              "train": {"method": "pt", "max_steps": 6, "per_device_train_batch_size": 4, "learning_rate": 5e-3,
                        "logging_steps": 1, "save_steps": 6, "cutoff_len": 64, "precision": "fp32"},
              "eval": {"retention": False, "max_new_tokens": 8},
              "export": {"gguf": ["f16"]}}
    path = tmp_path / "pt.yaml"
    path.write_text(yaml.safe_dump(config))
    assert main(["run", str(path)]) == 0
    run = tmp_path / "run"
    manifest = json.loads((run / "manifest.json").read_text())
    assert manifest["stages"]["train"]["method"] == "pt"
    results = json.loads((run / "eval" / "results.json").read_text())
    assert results["suite"]["cases"] == 0 and "continued-pretraining" in results["suite"]["source"]
    base, tuned = results["base"]["perplexity"], results["tuned"]["perplexity"]
    assert tuned < base, (base, tuned)  # the held-out text became likelier
    losses = [json.loads(line)["loss"] for line in (run / "metrics.jsonl").read_text().splitlines()
              if "loss" in json.loads(line)]
    assert losses[-1] < losses[0]
    assert main(["export", "verify", str(run)]) == 0  # llama.cpp against the merged model, on the held-out text
    assert json.loads((run / "gguf" / "verify.json").read_text())["prompts"] == 4
