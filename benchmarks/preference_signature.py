"""A preference signature on the embedded model: DPO, KTO, ORPO and a reward model learn which of two openings is
preferred, starting from an SFT model that uses both equally.

    python benchmarks/preference_signature.py [--work DIR] [--methods dpo kto orpo rm] [--steps 24] [--dry-run]

Data, written by this script from examples/data/coffee_qa.json (every answer there opens with "咖啡师小贴士："):

* SFT: the even-numbered questions, their answers opening alternately with "咖啡师小贴士：" and with "温馨提示：",
  so the SFT model knows both openings and prefers neither (its held-out preference accuracy is near chance);
* pairs: the odd-numbered questions (unseen by the SFT run), chosen = the answer opening with "咖啡师小贴士：",
  rejected = the same answer opening with "温馨提示：".

Each preference run starts from the SFT run's adapter (`model.adapter`), trains LoRA through the real CLI
(`gemmaforge run`: train, eval, merge, q8_0 GGUF, Modelfile), and is evaluated on its held-out pairs (preference
accuracy, or a reward model's reward accuracy) and on coffee questions none of the runs saw, answered greedily by
the merged model in transformers and by the exported GGUF in llama.cpp (`gemmaforge eval RUN --engine llamacpp`):
the suite passes an answer that opens with "咖啡师小贴士". The target (issue 43): held-out accuracy >= 0.9 and the
answers showing the property, for each method.

--dry-run writes the data, suite and configs and validates the configs (no model is loaded).
"""

from __future__ import annotations

import argparse
import json
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml

from gemmaforge.config import load_config

ROOT = Path(__file__).resolve().parents[1]
COFFEE = ROOT / "examples" / "data" / "coffee_qa.json"
SUITE = ROOT / "examples" / "suites" / "coffee.yaml"
PREFERRED, OTHER = "咖啡师小贴士：", "温馨提示："
# Learning rates: 5e-4 moved a DPO policy so far (reward margin ~40 nats, KL 2.3 from the SFT model) that it
# answered every question with one repeated word; the reward model's score head starts from scratch.
METHODS = {"dpo": {"method": "dpo", "learning_rate": 5e-5}, "kto": {"method": "kto", "learning_rate": 5e-5},
           "orpo": {"method": "dpo", "pref_loss": "orpo", "learning_rate": 1e-4},  # at 5e-5: accuracy 0.84
           "rm": {"method": "rm", "learning_rate": 2e-4}}
LORA = {"r": 16, "lora_alpha": 32, "lora_dropout": 0.0,
        "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]}
TARGET = 0.9


def log(message: str) -> None:
    print(f"[preference_signature] {message}", file=sys.stderr, flush=True)


def write_data(work: Path) -> None:
    """sft.json (alpaca, both openings), pairs.json (TRL's prompt/chosen/rejected) and suite.yaml."""
    records = [r for r in json.loads(COFFEE.read_text(encoding="utf-8")) if r["output"].startswith(PREFERRED)]
    answers = [(r["instruction"], r["output"].removeprefix(PREFERRED)) for r in records]
    sft = [{"instruction": q, "output": (PREFERRED if i % 2 == 0 else OTHER) + a}
           for i, (q, a) in enumerate(answers[0::2])]
    pairs = [{"prompt": q, "chosen": PREFERRED + a, "rejected": OTHER + a} for q, a in answers[1::2]]
    for name, rows in (("sft.json", sft), ("pairs.json", pairs)):
        (work / name).write_text(json.dumps(rows, ensure_ascii=False, indent=1), encoding="utf-8")
    # The quickstart's held-out questions, each checked for the preferred opening only (answers are cut short).
    cases = [{"prompt": case["prompt"], "checks": [{"starts_with": PREFERRED.rstrip("：")}]}
             for case in yaml.safe_load(SUITE.read_text(encoding="utf-8"))["cases"]
             if any("starts_with" in check for check in case["checks"])]
    (work / "suite.yaml").write_text(yaml.safe_dump({"cases": cases}, allow_unicode=True), encoding="utf-8")


def write_config(work: Path, name: str, train: dict[str, Any], data: str, adapter: Path | None,
                 export: bool) -> Path:
    config: dict[str, Any] = {
        "output_dir": str(work / name),
        "model": {"name_or_path": "gemma3-270m", **({"adapter": str(adapter)} if adapter else {})},
        "data": {"path": str(work / data), "val_size": 0.2},
        "lora": LORA,
        "train": {"per_device_train_batch_size": 4, "gradient_accumulation_steps": 1, "cutoff_len": 256,
                  "logging_steps": 4, "seed": 42, "eval_strategy": "no", **train},
        "eval": {"suite": str(work / "suite.yaml"), "max_new_tokens": 16, "retention": False},
        "export": {"gguf": ["q8_0"] if export else [], "ollama": {"name": f"coffee-{name}"}},
    }
    path = work / f"{name}.yaml"
    path.write_text(yaml.safe_dump(config, allow_unicode=True), encoding="utf-8")
    load_config(path)  # refused here, before anything trains, if a key is wrong
    return path


def gemmaforge(work: Path, *args: str) -> None:
    log_file = work / "commands.log"
    with log_file.open("a", encoding="utf-8") as out:
        out.write(f"\n$ gemmaforge {' '.join(args)}\n")
        out.flush()
        code = subprocess.run([sys.executable, "-m", "gemmaforge", *args], cwd=ROOT, stdout=out,
                              stderr=subprocess.STDOUT, check=False).returncode
    if code:
        raise SystemExit(f"gemmaforge {args[0]} failed (exit {code}): see {log_file}")


def answers(results: dict[str, Any]) -> list[str]:
    """The tuned model's suite answers (a reward model's eval has none)."""
    return [case["tuned"]["answer"] for case in results.get("cases", [])]


def summarize(run: Path, llama_cpp: dict[str, Any] | None) -> dict[str, Any]:
    results = json.loads((run / "eval" / "results.json").read_text(encoding="utf-8"))
    stage = json.loads((run / "manifest.json").read_text(encoding="utf-8"))["stages"]["train"]
    accuracy = "reward_accuracy" if stage.get("method") == "rm" else "preference_accuracy"
    row: dict[str, Any] = {"steps": stage["steps"], "train_runtime_s": stage["train_runtime_s"]}
    for side in ("base", "tuned"):
        row[side] = {key: results.get(side, {}).get(key) for key in (accuracy, "reward_margin", "suite_pass_rate")}
    row["tuned_answers"] = answers(results)[:3]
    if llama_cpp is not None:
        row["llama_cpp"] = {"suite_pass_rate": llama_cpp["tuned"]["suite_pass_rate"],
                            "identical_to_merged": llama_cpp["agreement"]["exact_match"],
                            "answers": answers(llama_cpp)[:3]}
    return row


def eval_with_llama_cpp(run: Path) -> dict[str, Any]:
    """`gemmaforge eval --engine llamacpp` on the exported q8_0 GGUF; the run's own eval/ is put back after."""
    kept = run / "eval.transformers"
    shutil.copytree(run / "eval", kept)
    try:
        gemmaforge(run.parent, "eval", str(run), "--engine", "llamacpp", "gguf=q8_0")
        return json.loads((run / "eval" / "results.json").read_text(encoding="utf-8"))
    finally:
        shutil.rmtree(run / "eval")
        kept.rename(run / "eval")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--work", type=Path)
    parser.add_argument("--methods", nargs="+", choices=list(METHODS), default=list(METHODS))
    parser.add_argument("--sft-steps", type=int, default=50)
    parser.add_argument("--steps", type=int, default=24, help="optimizer steps of each preference run (KTO twice)")
    parser.add_argument("--dry-run", action="store_true")
    args = parser.parse_args()
    work = args.work or Path(tempfile.mkdtemp(prefix="preference_signature-"))
    work.mkdir(parents=True, exist_ok=True)
    write_data(work)
    sft_config = write_config(work, "sft", {"max_steps": args.sft_steps, "learning_rate": 1e-3}, "sft.json",
                              None, export=False)
    # KTO trains on the pairs' answers one by one: twice the steps to see as many pairs as the others
    configs = {name: write_config(work, name, {**METHODS[name], "max_steps": args.steps * (2 if name == "kto" else 1)},
                                  "pairs.json", work / "sft", export=name != "rm")
               for name in args.methods}
    if args.dry_run:
        print(json.dumps({"work": str(work), "configs": [str(p) for p in (sft_config, *configs.values())]}))
        return
    start = time.perf_counter()
    summary: dict[str, Any] = {"machine": f"{platform.processor() or platform.machine()}, {platform.system()}",
                               "setup": vars(args) | {"work": str(work)}}
    if not (work / "sft" / "eval" / "results.json").exists():
        log("sft ...")
        gemmaforge(work, "train", str(sft_config))
        gemmaforge(work, "eval", str(work / "sft"))
    sft_results = json.loads((work / "sft" / "eval" / "results.json").read_text(encoding="utf-8"))
    summary["sft"] = {"suite_pass_rate": sft_results["tuned"]["suite_pass_rate"],
                      "tuned_answers": answers(sft_results)[:3]}
    for name, config in configs.items():
        log(f"{name} ...")
        shutil.rmtree(work / name, ignore_errors=True)  # a leftover run would be resumed
        gemmaforge(work, "run", str(config))
        run = work / name
        summary[name] = summarize(run, None if name == "rm" else eval_with_llama_cpp(run))
        accuracy = summary[name]["tuned"].get("reward_accuracy" if name == "rm" else "preference_accuracy") or 0
        shown = name == "rm" or min(summary[name]["tuned"]["suite_pass_rate"],
                                    summary[name]["llama_cpp"]["suite_pass_rate"]) >= TARGET
        summary[name]["target_met"] = accuracy >= TARGET and shown
    summary["wall_s"] = round(time.perf_counter() - start, 1)
    print(json.dumps(summary, indent=2, ensure_ascii=False, default=str))


if __name__ == "__main__":
    main()
