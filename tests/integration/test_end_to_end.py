"""The whole pipeline on the real embedded Gemma 3 270M, checked by llama.cpp.

A short run (a few steps) through the CLI; then llama.cpp loads both exported GGUF files and its
greedy continuation of chat prompts from the f16 file must equal the merged transformers model's.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from gemmaforge.cli import main
from gemmaforge.families import FAMILIES
from tests.helpers import write_config
from tests.llama_cpp_checks import greedy, load, relative_error

pytest.importorskip("llama_cpp")
pytestmark = pytest.mark.integration

PROMPTS = ["什么是冷萃咖啡？", "How should I store coffee beans?", "浓缩咖啡为什么会有油脂？"]
NEW_TOKENS = 24


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory, embedded_model) -> Path:
    tmp = tmp_path_factory.mktemp("e2e")
    config = write_config(tmp, "gemma3-270m", max_steps=2, learning_rate=1e-3, save_steps=2)
    # retention (60 probes and the general text, ~100 s a side on 2 cores) is scored in test_eval_run
    assert main(["run", str(config), "eval.max_new_tokens=48", "eval.retention=false"]) == 0
    return tmp / "run"


def test_eval_compares_base_and_tuned_on_the_real_model(run_dir: Path) -> None:
    import json

    results = json.loads((run_dir / "eval" / "results.json").read_text(encoding="utf-8"))
    assert results["suite"]["source"].startswith("val sample") and len(results["cases"]) == 4
    for side in ("base", "tuned"):
        assert 1.0 < results[side]["perplexity"] < 1e4 and results[side]["retention_accuracy"] is None
        assert all(case[side]["answer"] for case in results["cases"])
    # two steps of LoRA at 1e-3 already fit the val split better
    assert results["tuned"]["eval_loss"] < results["base"]["eval_loss"]
    assert (run_dir / "eval" / "report.md").read_text(encoding="utf-8").startswith("# Evaluation: base vs tuned")


def greedy_transformers(model_dir: Path, prompts: list[str]) -> list[list[int]]:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    outputs = []
    for text in prompts:
        ids = tokenizer(text, add_special_tokens=False, return_tensors="pt").input_ids
        with torch.no_grad():
            out = model.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None)
        outputs.append(out[0, ids.shape[1]:].tolist())
    return outputs


@pytest.fixture(scope="module")
def chat_prompts() -> list[str]:
    return [
        FAMILIES["gemma3"].chat.render([{"role": "user", "content": p}], add_generation_prompt=True).text
        for p in PROMPTS
    ]


@pytest.fixture(scope="module")
def merged_greedy(run_dir: Path, chat_prompts: list[str]) -> list[list[int]]:
    return greedy_transformers(run_dir / "merged", chat_prompts)


def test_llama_cpp_continues_chat_prompts_exactly_like_the_merged_model(
    run_dir: Path, chat_prompts: list[str], merged_greedy: list[list[int]]
) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(run_dir / "merged")
    llm = load(run_dir / "gguf" / "model-f16.gguf", logits_all=True)
    for prompt, expected in zip(chat_prompts, merged_greedy):  # same prompt ids for both runtimes
        assert greedy(llm, tokenizer(prompt, add_special_tokens=False).input_ids, NEW_TOKENS) == expected


def test_llama_cpp_runs_the_q8_0_file_close_to_the_merged_model(
    run_dir: Path, chat_prompts: list[str], merged_greedy: list[list[int]]
) -> None:
    """8-bit weights may flip a near-tie, so compare logits along prompt + merged continuation:
    close overall, and wherever llama.cpp's top token differs, the merged model itself scored
    that token within half a logit of its best."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(run_dir / "merged")
    model = AutoModelForCausalLM.from_pretrained(run_dir / "merged", dtype=torch.float32)
    llm = load(run_dir / "gguf" / "model-q8_0.gguf", logits_all=True)
    assert llm.metadata["general.architecture"] == "gemma3"
    assert "<start_of_turn>" in llm.metadata["tokenizer.chat_template"]
    for prompt, continuation in zip(chat_prompts, merged_greedy):
        tokens = tokenizer(prompt, add_special_tokens=False).input_ids + continuation
        with torch.no_grad():
            want = model(torch.tensor([tokens])).logits[0].numpy()  # (T, V)
        # 8% of the logits' spread: measured 0.069 on a host without bf16 (trained in fp32, one thread per test
        # worker), below 0.06 where it trained in bf16; the top-token check below is the sharp one
        assert relative_error(llm, tokens, want) < 8e-2
        got_top = np.asarray(llm.scores[: len(tokens)]).argmax(axis=1)
        gaps = want.max(axis=1) - want[np.arange(len(tokens)), got_top]
        # q8_0 may only swap near-ties: a pick within one logit of the best (its logits differ from the
        # merged model's by < 8% of their spread, above; observed gaps so far: 0 to 0.51)
        assert gaps.max() < 1.0, f"q8_0 picked a token the merged model scored {gaps.max():.2f} below its best"


def test_k_quant_export_and_verify_on_the_real_model(run_dir: Path) -> None:
    """q4_k_m through llama.cpp's quantizer, then every file proven against the merged model."""
    import json

    assert main(["export", "gguf", str(run_dir), "--quant", "q4_k_m"]) == 0
    assert main(["export", "verify", str(run_dir)]) == 0
    files = json.loads((run_dir / "gguf" / "verify.json").read_text())["files"]
    assert set(files) == {"f16", "q8_0", "q4_k_m"}
    assert files["f16"]["top1_agreement"] >= 0.99
    assert "Q4_K" in files["q4_k_m"]["tensor_types"] and "Q6_K" in files["q4_k_m"]["tensor_types"]
    # fewer bits, further from the merged model (measured on the quickstart: KL 0.007 for q8_0, 0.25 for q4_k_m)
    assert files["f16"]["mean_kl"] < files["q8_0"]["mean_kl"] < files["q4_k_m"]["mean_kl"] < 1.0
    assert files["q4_k_m"]["top1_agreement"] > 0.5
