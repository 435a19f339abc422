"""`gemmaforge data prepare` and `gemmaforge data inspect` through the real command line."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from gemmaforge.cli import main
from gemmaforge.families import FAMILIES
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
        ids, labels = FAMILIES["gemma3"].chat.encode(messages, gemma3_tokenizer, 512, mask_history=True)
        assert (row["input_ids"], row["labels"]) == (ids, labels)
        assert row["text"].startswith("<bos><start_of_turn>") and \
            gemma3_tokenizer(row["text"], add_special_tokens=False).input_ids == ids


def test_inspect_text_shows_samples_and_summary(tmp_path: Path) -> None:
    proc = run_cli("data", "inspect", str(SHAREGPT), "-n", "1", "--template", "gemma4", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "conversation 1:" in proc.stdout and "<|turn>user" in proc.stdout and "conversation 2:" not in proc.stdout
    assert "per conversation" in proc.stdout and "over cutoff_len=512" in proc.stdout
    assert "not one token" in proc.stderr  # gemma4 markers are not in the Gemma 3 vocabulary


@pytest.mark.slow
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


def turns(question: str, answer: str) -> dict[str, list[dict[str, str]]]:
    """One openai-shaped record: a question and its answer."""
    return {"messages": [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]}


def write_jsonl(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records), encoding="utf-8")
    return path


def test_prepare_reads_a_plain_folder_of_json_lines_files(tmp_path: Path, capsys) -> None:
    """docs/data.md: INPUT may be a folder of JSON Lines files without dataset_info.json: every record of both files is
    prepared and split, none lost, none twice."""
    folder = tmp_path / "chats"
    folder.mkdir()
    write_jsonl(folder / "a.jsonl", [turns(f"question {i}", f"answer {i}") for i in range(5)])
    write_jsonl(folder / "b.jsonl", [turns(f"question {i}", f"answer {i}") for i in range(5, 12)])
    assert main(["data", "prepare", str(folder), "-o", str(tmp_path / "out"), "--val-size", "3"]) == 0, \
        capsys.readouterr().err
    stats = json.loads((tmp_path / "out" / "stats.json").read_text())
    assert (stats["records"], stats["kept"], stats["train"], stats["val"]) == (12, 12, 9, 3)
    prepared = [json.loads(line)["messages"] for name in ("train.jsonl", "val.jsonl")
                for line in (tmp_path / "out" / name).read_text(encoding="utf-8").splitlines()]
    assert sorted(p[0]["content"] for p in prepared) == sorted(f"question {i}" for i in range(12))


@pytest.mark.slow
def test_prepare_format_and_column_keys_name_other_columns(tmp_path: Path, capsys) -> None:
    """docs/data.md: `--format` and `columns.prompt=question`-style keys name other columns: a question/answer file,
    which detection refuses, becomes user/assistant turns."""
    src = tmp_path / "qa.jsonl"
    src.write_text('{"question": "How hot is the water?", "answer": "92 to 96 C."}\n'
                   '{"question": "How long?", "answer": "Three minutes."}\n', encoding="utf-8")
    assert main(["data", "prepare", str(src), "-o", str(tmp_path / "plain")]) == 2
    assert "cannot detect the dataset format (keys: answer, question)" in capsys.readouterr().err
    assert main(["data", "prepare", str(src), "-o", str(tmp_path / "out"), "--format", "alpaca",
                 "columns.prompt=question", "columns.response=answer", "--val-size", "0"]) == 0
    lines = (tmp_path / "out" / "train.jsonl").read_text(encoding="utf-8").splitlines()
    assert [json.loads(line)["messages"] for line in lines] == [
        [{"role": "user", "content": "How hot is the water?"}, {"role": "assistant", "content": "92 to 96 C."}],
        [{"role": "user", "content": "How long?"}, {"role": "assistant", "content": "Three minutes."}],
    ]


def test_inspect_text_highlights_the_answer_not_the_prompt(tmp_path: Path, capsys, monkeypatch) -> None:
    """docs/data.md: `data inspect` shows the rendered conversation with the supervised tokens highlighted: in a
    terminal exactly the answer and its end-of-turn marker are bold green, the prompt is dim."""
    src = write_jsonl(tmp_path / "d.jsonl", [turns("What water temperature?", "Ninety-two degrees.")])
    monkeypatch.setenv("FORCE_COLOR", "1")
    monkeypatch.setenv("TERM", "xterm")
    monkeypatch.delenv("NO_COLOR", raising=False)
    assert main(["data", "inspect", str(src), "-n", "1"]) == 0
    shown = capsys.readouterr().out.split("1 conversations")[0]  # the conversation, before the summary table
    green = "".join(re.findall(r"\x1b\[1;32m(.*?)\x1b\[0m", shown))
    dim = "".join(re.findall(r"\x1b\[2m(.*?)\x1b\[0m", shown))
    assert green == "Ninety-two degrees.<end_of_turn>"
    assert dim == "<bos><start_of_turn>userWhat water temperature?<end_of_turn><start_of_turn>model"


@pytest.mark.slow
def test_inspect_train_on_prompt_supervises_the_prompt(tmp_path: Path, capsys, gemma3_tokenizer) -> None:
    """docs/data.md: `--train-on-prompt` shows that loss option: with it the question's tokens carry labels in `--json`,
    without it they are -100."""
    question = "What water temperature?"
    src = write_jsonl(tmp_path / "d.jsonl", [turns(question, "Ninety-two degrees.")])
    rows = {}
    for flags in ((), ("--train-on-prompt",)):
        assert main(["data", "inspect", str(src), "--json", *flags]) == 0
        (rows[flags],) = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    plain, on_prompt = rows[()], rows[("--train-on-prompt",)]
    assert plain["input_ids"] == on_prompt["input_ids"]
    start = plain["text"].index(question)
    offsets = gemma3_tokenizer(plain["text"], add_special_tokens=False, return_offsets_mapping=True).offset_mapping
    in_question = [i for i, (s, e) in enumerate(offsets) if start <= s and e <= start + len(question)]
    assert len(in_question) >= 3
    assert all(plain["labels"][i] == -100 for i in in_question)
    assert all(on_prompt["labels"][i] == on_prompt["input_ids"][i] for i in in_question)
    assert on_prompt["labels"][1:] == on_prompt["input_ids"][1:] and on_prompt["labels"][0] == -100  # all but <bos>


@pytest.mark.slow
def test_inspect_model_gives_the_tokenizer_and_the_template(tmp_path: Path, capsys, checkpoint_of,
                                                            gemma3_tokenizer) -> None:
    """docs/data.md: the tokenizer comes from `--model` and the template from its family: a Gemma 4 checkpoint renders
    `<|turn>` turns and its own tokenizer reads `<|turn>` as one token (the default Gemma 3 one cannot)."""
    from gemmaforge.models import load_tokenizer

    model = checkpoint_of("gemma4-e2b")
    src = write_jsonl(tmp_path / "d.jsonl", [turns("What water temperature?", "Ninety-two degrees.")])
    assert main(["data", "inspect", str(src), "--json", "--model", str(model)]) == 0
    captured = capsys.readouterr()
    (row,) = [json.loads(line) for line in captured.out.splitlines()]
    assert row["text"].startswith("<bos><|turn>user\nWhat water temperature?") and "not one token" not in captured.err
    tokenizer = load_tokenizer(model)
    assert row["input_ids"] == tokenizer(row["text"], add_special_tokens=False).input_ids
    assert row["input_ids"][1] == tokenizer.convert_tokens_to_ids("<|turn>")
    assert row["input_ids"] != gemma3_tokenizer(row["text"], add_special_tokens=False).input_ids


@pytest.mark.slow
def test_llamafactory_tool_data_prepares_and_inspects(tmp_path: Path, llamafactory_data: Path, gemma3_tokenizer,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    """The command the walkthroughs' users run on LLaMA-Factory's tool-call demo, then what training sees of it:
    the tool prompt and the results are prompt, the `Action:` calls and the answers carry the loss. (In this
    process: the command line in a process of its own is the tests above.)"""
    out = tmp_path / "out"
    assert main(["data", "prepare", str(llamafactory_data), "--dataset", "glaive_toolcall_en_demo", "-o",
                 str(out)]) == 0
    capsys.readouterr()
    assert main(["data", "inspect", str(out / "train.jsonl"), "--json"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    with_call = next(row for row in rows if "\nAction Input: " in row["text"])
    assert "You have access to the following tools:\n> Tool Name: " in with_call["text"]
    supervised = gemma3_tokenizer.decode([i for i, label in zip(with_call["input_ids"], with_call["labels"],
                                                                strict=True) if label != -100])
    assert "Action: " in supervised and "<start_of_turn>tool" not in supervised
    assert "You have access" not in supervised
    assert main(["data", "inspect", str(out / "train.jsonl"), "-n", "1"]) == 0
    shown = capsys.readouterr().out
    assert "conversation 1:" in shown and "Tool Name:" in shown
