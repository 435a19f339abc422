"""Time the quickstart end to end and show answers before and after fine-tuning.

    python benchmarks/quickstart.py [--config examples/quickstart.yaml] [--questions 3] [--agreement]

Runs `gemmaforge run CONFIG` in a subprocess (wall clock of the whole pipeline, per-stage times
from manifest.json), prints the eval report's base and tuned figures (eval/results.json), then answers
held-out validation questions greedily with the base model (transformers) and with the exported q8_0
GGUF in llama.cpp, the file Ollama would serve. With --agreement it also runs `gemmaforge eval RUN
--engine llamacpp gguf=QUANT` for each exported GGUF and prints how many suite answers llama.cpp gives
character for character as the merged model does (the run's own eval/ is put back afterwards).
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

from gemmaforge.config import load_config
from gemmaforge.families import FAMILIES
from gemmaforge.models import default_home, resolve_model

MAX_NEW_TOKENS = 96
# eval/results.json keys shown, in report.md's order
REPORT_KEYS = ("suite_pass_rate", "eval_loss", "perplexity", "stopped_rate", "retention_accuracy",
               "general_text_perplexity")


def answer_with_transformers(model_dir: Path, prompts: list[str]) -> list[str]:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    stop = [tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids("<end_of_turn>")]
    answers = []
    for prompt in prompts:
        ids = tokenizer(prompt, add_special_tokens=False, return_tensors="pt").input_ids
        with torch.no_grad():
            out = model.generate(ids, max_new_tokens=MAX_NEW_TOKENS, do_sample=False, eos_token_id=stop)
        answers.append(tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True).strip())
    return answers


def answer_with_llama_cpp(gguf: Path, prompts: list[str]) -> list[str]:
    from llama_cpp import Llama

    llm = Llama(model_path=str(gguf), n_ctx=512, verbose=False)
    answers = []
    for prompt in prompts:
        # The GGUF's own BOS is added by llama.cpp, as in Ollama: drop ours from the text.
        out = llm.create_completion(prompt.removeprefix("<bos>"), max_tokens=MAX_NEW_TOKENS, temperature=0,
                                    stop=["<end_of_turn>"])
        answers.append(out["choices"][0]["text"].strip())
    return answers


def print_report(results: dict) -> None:
    print(f"\n{'eval/results.json':26s} {'base':>8s} {'tuned':>8s}")
    for key in REPORT_KEYS:
        print(f"  {key:24s} {results['base'][key]!s:>8s} {results['tuned'][key]!s:>8s}")


def print_agreement(run: Path, quants: list[str]) -> None:
    """Each GGUF's suite answers (llama.cpp) against the merged model's, with eval/ restored afterwards."""
    kept = run / "eval.benchmark-kept"
    shutil.copytree(run / "eval", kept)
    try:
        for quant in quants:
            subprocess.run([sys.executable, "-m", "gemmaforge", "eval", str(run), "--engine", "llamacpp",
                            f"gguf={quant}"], check=True)
            results = json.loads((run / "eval" / "results.json").read_text())
            a = results["agreement"]
            total = len(a["merged_answers"])
            print(f"  llama.cpp {quant}: {round(a['exact_match'] * total)} of {total} answers identical to the merged "
                  f"model's, ROUGE-L {a['rouge_l']}, tuned suite pass rate {results['tuned']['suite_pass_rate']}")
    finally:
        shutil.rmtree(run / "eval")
        kept.rename(run / "eval")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", type=Path, default=Path("examples/quickstart.yaml"))
    parser.add_argument("--questions", type=int, default=3)
    parser.add_argument("--agreement", action="store_true", help="also eval each GGUF with llama.cpp")
    args = parser.parse_args()

    start = time.perf_counter()
    subprocess.run([sys.executable, "-m", "gemmaforge", "run", str(args.config)], check=True)
    wall = time.perf_counter() - start
    config = load_config(args.config)
    run = Path(config.output_dir)
    manifest = json.loads((run / "manifest.json").read_text())
    print(f"\nquickstart wall clock: {wall:.0f} s")
    for name, stage in manifest["stages"].items():
        print(f"  {name:14s} {stage['runtime_s']:7.1f} s")
    print(f"  train: {json.dumps({k: manifest['stages']['train'][k] for k in ('steps', 'train_loss', 'eval_loss')})}")

    print_report(json.loads((run / "eval" / "results.json").read_text()))
    if args.agreement:
        print_agreement(run, list(config.export.gguf))

    val = [json.loads(line)["messages"] for line in (run / "data" / "val.jsonl").read_text().splitlines()]
    questions = [m[:-1] for m in val[: args.questions]]
    prompts = [FAMILIES["gemma3"].chat.render(q, add_generation_prompt=True).text for q in questions]
    before = answer_with_transformers(resolve_model(config.model.name_or_path, default_home()).path, prompts)
    after = answer_with_llama_cpp(run / "gguf" / "model-q8_0.gguf", prompts)
    for q, b, a in zip(questions, before, after):
        print(f"\nQ: {q[-1]['content']}\n  before (base, transformers): {b}\n  after  (q8_0 GGUF, llama.cpp): {a}")


if __name__ == "__main__":
    main()
