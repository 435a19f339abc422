"""`gemmaforge eval` on a tiny trained run: the base answers are the base model's, the tuned answers the
merged model's (transformers) and the GGUF's (llama.cpp); report files, exit codes and bad input."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gemmaforge.cli import main
from gemmaforge.evaluate.report import METHOD_ROWS, SUMMARY_ROWS
from gemmaforge.families import FAMILIES
from tests.helpers import write_config

NEW_TOKENS = 12
PROMPTS = ["什么是冷萃咖啡？", "How should I store coffee beans?", "浓缩咖啡为什么会有油脂？"]
SUITE = f"""\
cases:
  - prompt: "{PROMPTS[0]}"
    checks: [{{max_chars: 100000}}]
  - prompt: "{PROMPTS[1]}"
    reference: "In an airtight container, away from light."
    checks: [{{max_chars: 100000}}, {{contains: "never-in-any-answer"}}]
  - prompt: "{PROMPTS[2]}"
"""


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory, tiny_gemma3_dir: Path) -> Path:
    tmp = tmp_path_factory.mktemp("eval")
    (tmp / "suite.yaml").write_text(SUITE, encoding="utf-8")
    config = write_config(tmp, tiny_gemma3_dir, max_steps=2, save_steps=2)
    assert main(["train", str(config)]) == 0
    return tmp / "run"


@pytest.fixture(scope="module")
def results(trained: Path) -> dict:
    suite = trained.parent / "suite.yaml"
    assert main(["eval", str(trained), "--suite", str(suite), f"max_new_tokens={NEW_TOKENS}"]) == 0
    return json.loads((trained / "eval" / "results.json").read_text(encoding="utf-8"))


def load(model_dir: Path, adapter: Path | None) -> tuple[object, object]:
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    return AutoTokenizer.from_pretrained(model_dir), PeftModel.from_pretrained(model, adapter) if adapter else model


def greedy(model_dir: Path, prompts: list[str], adapter: Path | None = None) -> list[tuple[str, int, bool]]:
    """Each prompt alone, greedy, the way the tests in test_end_to_end.py run the merged model:
    (answer, its tokens, whether it ended on a stop token)."""
    import torch

    tokenizer, model = load(model_dir, adapter)
    stops = [tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids("<end_of_turn>")]
    answers = []
    for prompt in prompts:
        text = FAMILIES["gemma3"].chat.render([{"role": "user", "content": prompt}],
                                   add_generation_prompt=True).text
        ids = tokenizer(text, add_special_tokens=False, return_tensors="pt").input_ids
        with torch.no_grad():
            out = model.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=stops,
                                 top_k=None, top_p=None)
        new = out[0, ids.shape[1]:].tolist()
        end = next((k for k, t in enumerate(new) if t in stops), None)
        new = new[:end]
        answers.append((tokenizer.decode(new, skip_special_tokens=True).strip(), len(new), end is not None))
    return answers


def general_text_perplexity(model_dir: Path, adapter: Path | None, cutoff_len: int) -> float:
    """transformers' own labels= loss over every token after <bos> of each paragraph of the shipped sample,
    weighted by its tokens."""
    import math

    import torch

    from gemmaforge.evaluate.scoring import ASSETS

    tokenizer, model = load(model_dir, adapter)
    total = count = 0.0
    sample = (ASSETS / "general_text.txt").read_text(encoding="utf-8")
    for paragraph in filter(None, (p.strip() for p in sample.split("\n\n"))):
        ids = torch.tensor([[tokenizer.bos_token_id, *tokenizer(paragraph, add_special_tokens=False).input_ids]])
        ids = ids[:, :cutoff_len]
        with torch.no_grad():
            total += float(model(input_ids=ids, labels=ids).loss) * (ids.shape[1] - 1)
        count += ids.shape[1] - 1
    return math.exp(total / count)


@pytest.fixture(scope="module")
def sample(trained: Path, tiny_gemma3_dir: Path) -> dict[str, list[tuple[str, int, bool]]]:
    """The suite's prompts answered greedily one by one by the base model and by the base with the adapter."""
    return {"base": greedy(tiny_gemma3_dir, PROMPTS), "tuned": greedy(tiny_gemma3_dir, PROMPTS, trained / "adapter")}


@pytest.mark.slow
def test_results_have_base_and_tuned_with_every_metric(results: dict, trained: Path, tiny_gemma3_dir: Path,
                                                       sample: dict) -> None:
    from gemmaforge.evaluate.metrics import reference_scores

    for side, adapter in (("base", None), ("tuned", trained / "adapter")):
        got = results[side]
        assert got["perplexity"] == pytest.approx(2.718281828 ** got["eval_loss"], rel=1e-3)
        # case 1 always passes, case 2's contains-check never does; case 3 has no checks
        assert got["suite_pass_rate"] == 0.5
        assert got["check_pass_rates"] == {"max_chars": 1.0, "contains": 0.0}
        assert got["general_text_perplexity"] == pytest.approx(general_text_perplexity(tiny_gemma3_dir, adapter, 128),
                                                               rel=1e-3)
        assert got["answer_tokens_mean"] == pytest.approx(sum(n for _, n, _ in sample[side]) / 3, abs=0.05)
        assert got["stopped_rate"] == pytest.approx(sum(stopped for _, _, stopped in sample[side]) / 3, abs=1e-4)
        # the one case with a reference (case 2), scored against it
        scores = reference_scores([sample[side][1][0]], ["In an airtight container, away from light."])
        assert (got["bleu"], got["rouge_l"]) == (scores.bleu, scores.rouge_l)
        probes = results["retention"]
        assert got["retention_accuracy"] == pytest.approx(
            sum(any(a.casefold() in p[side]["answer"].casefold() for a in p["answers"]) for p in probes) / len(probes))
        assert got["prompts_per_second"] > 0
    assert results["suite"] == {"source": str(Path(results["suite"]["source"])), "cases": 3, "with_checks": 2,
                                "with_reference": 1}
    assert [c["tuned"]["passed"] for c in results["cases"]] == [True, False, None]
    assert len(results["retention"]) >= 50
    assert results["tuned"]["eval_loss"] != results["base"]["eval_loss"]
    assert results["tuned"]["general_text_perplexity"] != results["base"]["general_text_perplexity"]


@pytest.mark.slow
def test_eval_loss_is_the_trainers(results: dict, trained: Path) -> None:
    """The tuned eval loss is the one the trainer logged for the final adapter (same objective, same data)."""
    logged = [json.loads(line) for line in (trained / "metrics.jsonl").read_text().splitlines()]
    final = [row["eval_loss"] for row in logged if "eval_loss" in row][-1]
    assert results["tuned"]["eval_loss"] == pytest.approx(final, abs=1e-3)


@pytest.mark.slow
def test_base_answers_are_the_base_models_and_tuned_the_adapters(results: dict, sample: dict) -> None:
    """Batched, left-padded generation with the adapter disabled answers exactly as the base model alone."""
    for side in ("base", "tuned"):
        assert [c[side]["answer"] for c in results["cases"]] == [answer for answer, _, _ in sample[side]]


@pytest.mark.slow
def test_report_files_and_manifest(results: dict, trained: Path) -> None:
    report = (trained / "eval" / "report.md").read_text(encoding="utf-8")
    assert "| suite pass rate (cases whose checks all pass) | 0.500 | 0.500 |" in report
    assert PROMPTS[0] in report and "## Knowledge retention" in report
    rows = [line.split(" | ")[0].removeprefix("| ") for line in report.splitlines() if line.startswith("| ")]
    sft_rows = [label for key, label, _ in SUMMARY_ROWS if key not in METHOD_ROWS]  # no preference rows for sft
    assert sft_rows == [r for r in rows if r in {x[1] for x in SUMMARY_ROWS}]
    page = (trained / "eval" / "report.html").read_text(encoding="utf-8")
    assert "data:image/png;base64," in page and "<th>base</th><th>tuned</th>" in page
    stage = json.loads((trained / "manifest.json").read_text())["stages"]["eval"]
    assert stage["status"] == "done" and stage["tuned"]["suite_pass_rate"] == 0.5


@pytest.mark.slow
def test_fail_under_exits_1_after_writing_the_report(results: dict, trained: Path,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    (trained / "eval" / "results.json").unlink()
    suite = trained.parent / "suite.yaml"
    code = main(["eval", str(trained), "--suite", str(suite), "--fail-under", "0.9", "max_new_tokens=2",
                 "retention=false"])
    assert code == 1
    assert "tuned suite pass rate 0.5 is below eval.fail_under=0.9" in capsys.readouterr().err
    assert json.loads((trained / "eval" / "results.json").read_text())["retention"] == []


@pytest.mark.slow
def test_seeded_sampling_repeats_with_its_seed(results: dict, trained: Path) -> None:
    suite = str(trained.parent / "suite.yaml")

    def sampled(seed: int) -> list[str]:
        assert main(["eval", str(trained), "--suite", suite, "do_sample=true", "temperature=1.5", f"seed={seed}",
                     f"max_new_tokens={NEW_TOKENS}", "retention=false"]) == 0
        got = json.loads((trained / "eval" / "results.json").read_text(encoding="utf-8"))
        assert got["sampling"] == {"do_sample": True, "max_new_tokens": NEW_TOKENS, "temperature": 1.5,
                                   "top_p": 0.95, "seed": seed}
        return [c["tuned"]["answer"] for c in got["cases"]]

    first = sampled(7)
    assert sampled(7) == first
    assert sampled(8) != first
    assert first != [c["tuned"]["answer"] for c in results["cases"]]  # not the greedy answers


@pytest.mark.slow
def test_llamacpp_engine_answers_as_the_merged_model(results: dict, trained: Path) -> None:
    """On a split export: the engine takes the first shard and llama.cpp loads the set (docs/export.md, export gguf)."""
    pytest.importorskip("llama_cpp")
    assert main(["merge", str(trained)]) == 0
    assert main(["export", "gguf", str(trained), "--quant", "f16", "--split-max-tensors", "12"]) == 0
    suite = trained.parent / "suite.yaml"
    assert main(["eval", str(trained), "--suite", str(suite), "--engine", "llamacpp",
                 f"max_new_tokens={NEW_TOKENS}", "retention=false"]) == 0
    got = json.loads((trained / "eval" / "results.json").read_text(encoding="utf-8"))
    assert got["engine"] == "llamacpp" and got["agreement"]["gguf"].endswith("model-f16-00001-of-00003.gguf")
    assert got["agreement"]["merged_answers"] == [c["tuned"]["answer"] for c in results["cases"]]
    assert got["agreement"]["exact_match"] == 1.0, got["agreement"]
    assert "GGUF against the merged model" in (trained / "eval" / "report.md").read_text(encoding="utf-8")


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["--suite", "SUITE_DIR/bad.yaml"],
         "bad.yaml case 1 (line 2): unknown check 'startswith'; known checks: starts_with"),
        (["--suite", "SUITE_DIR/none.yaml"], "none.yaml: suite file not found"),
        (["--fail-under", "1.5"], "eval.fail_under"),
        (["max_new_token=3"], "eval.max_new_token: unknown key; did you mean 'max_new_tokens'?"),
        (["--fail-under", "0.5"], "eval.fail_under=0.5 needs a suite with checks"),
    ],
)
@pytest.mark.slow
def test_bad_eval_input_is_exit_2(trained: Path, args: list[str], expected: str,
                                  capsys: pytest.CaptureFixture[str]) -> None:
    (trained.parent / "bad.yaml").write_text("cases:\n  - prompt: a\n    checks: [{startswith: x}]\n", encoding="utf-8")
    args = [a.replace("SUITE_DIR", str(trained.parent)) for a in args]
    assert main(["eval", str(trained), *args]) == 2
    assert expected in " ".join(capsys.readouterr().err.split())


def test_eval_without_an_adapter_names_the_stage(tmp_path: Path, tiny_gemma3_dir: Path,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    from gemmaforge.config import load_config
    from gemmaforge.runs import RunDir

    RunDir.create(load_config(write_config(tmp_path, tiny_gemma3_dir)))
    assert main(["eval", str(tmp_path / "run")]) == 2
    assert "adapter_config.json is missing: run `gemmaforge train" in " ".join(capsys.readouterr().err.split())
