"""`gemmaforge data prepare` and `gemmaforge data inspect` through the real command line."""

from __future__ import annotations

import json
from pathlib import Path

from gemmaforge.families import FAMILIES
from gemmaforge.templates import encode_for_training
from tests.helpers import run_cli

EXAMPLES = Path(__file__).parents[2] / "examples" / "data"
SHAREGPT = EXAMPLES / "customer_service_sharegpt.json"


def test_prepare_writes_outputs_and_stats(tmp_path: Path) -> None:
    proc = run_cli("data", "prepare", str(SHAREGPT), "-o", "out", "--val-size", "20", "clean.dedup=near", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "detected format sharegpt (conversations: from/value)" in proc.stderr
    stats = json.loads((tmp_path / "out" / "stats.json").read_text())
    records = len(json.loads(SHAREGPT.read_text(encoding="utf-8")))
    assert stats["records"] == records and stats["val"] == 20 and stats["train"] + stats["val"] == stats["kept"]
    assert stats["options"]["dedup"] == "near" and stats["template"] == "gemma3"
    lines = (tmp_path / "out" / "train.jsonl").read_text(encoding="utf-8").splitlines()
    assert len(lines) == stats["train"] and all(json.loads(line)["messages"][-1]["role"] == "assistant"
                                                for line in lines)


def test_inspect_json_is_exactly_what_training_sees(tmp_path: Path, gemma3_tokenizer) -> None:
    proc = run_cli("data", "inspect", str(SHAREGPT), "--json", "-n", "3", "--mask-history", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    rows = [json.loads(line) for line in proc.stdout.splitlines()]
    conversations = json.loads(SHAREGPT.read_text(encoding="utf-8"))[:3]
    assert len(rows) == 3 and all(set(row) == {"text", "input_ids", "labels"} for row in rows)
    for row, record in zip(rows, conversations):
        roles = {"system": "system", "human": "user", "gpt": "assistant"}
        messages = [{"role": roles[t["from"]], "content": t["value"]} for t in record["conversations"]]
        ids, labels = encode_for_training(messages, gemma3_tokenizer, FAMILIES["gemma3"], 512, mask_history=True)
        assert (row["input_ids"], row["labels"]) == (ids, labels)
        assert row["text"].startswith("<bos><start_of_turn>") and \
            gemma3_tokenizer(row["text"], add_special_tokens=False).input_ids == ids


def test_inspect_text_shows_samples_and_summary(tmp_path: Path) -> None:
    proc = run_cli("data", "inspect", str(SHAREGPT), "-n", "1", "--template", "gemma4", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "conversation 1:" in proc.stdout and "<|turn>user" in proc.stdout and "conversation 2:" not in proc.stdout
    assert "per conversation" in proc.stdout and "over cutoff_len=512" in proc.stdout
    assert "not one token" in proc.stderr  # gemma4 markers are not in the Gemma 3 vocabulary


def test_bad_input_and_bad_keys_are_exit_2(tmp_path: Path) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"messages": [{"role": "user", "content": "a"}, {"role": "bot", "content": "b"}]}\n',
                   encoding="utf-8")
    proc = run_cli("data", "prepare", str(bad), "-o", "out", cwd=tmp_path)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "bad.jsonl line 1: turn 2 has unknown role 'bot' (role)" in proc.stderr
    assert not (tmp_path / "out").exists()
    proc = run_cli("data", "prepare", str(SHAREGPT), "clean.dedupe=near", cwd=tmp_path)
    assert proc.returncode == 2 and "data.clean.dedupe: unknown key; did you mean 'dedup'?" in proc.stderr
