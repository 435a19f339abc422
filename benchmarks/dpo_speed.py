"""DPO training speed and peak memory: gemmaforge against TRL's DPOTrainer, same data, LoRA and batch.

    python benchmarks/dpo_speed.py [--steps 8] [--batch-size 4] [--cutoff 256] [--precision fp32|bf16]
                                   [--gradient-checkpointing] [--work DIR]

Both LoRA-tune the embedded Gemma 3 270M with DPO (sigmoid loss, beta 0.1, the reference the base with the
adapter disabled) for the same number of optimizer steps on the same train split of preference pairs made from
examples/data/coffee_qa.json: the chosen answer is the shipped one (it opens with the barista's "咖啡师小贴士："),
the rejected one is the same answer without that opening. LoRA r=8, alpha 16, no dropout, on q/k/v/o_proj;
learning rate 5e-5; no gradient accumulation; the pairs cut at --cutoff tokens per side.

* trl: `trl.DPOTrainer` with a `peft_config`, its defaults otherwise (prompt and answers rendered by the chat
  template it is given: the family's own);
* gemmaforge: `python -m gemmaforge train CONFIG` through the real CLI, `train.method: dpo`; gradient
  checkpointing as its memory plan decides, or on with --gradient-checkpointing (TRL's default).

Each trains in its own process. Reported: pairs/s of the training loop (model loading excluded) and the process's
peak resident memory (ru_maxrss). The target (issue 43): gemmaforge >= 1.5x TRL's pairs/s at <= its memory.
"""

from __future__ import annotations

import argparse
import json
import platform
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[1]
COFFEE = ROOT / "examples" / "data" / "coffee_qa.json"
OPENING = "咖啡师小贴士："
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj"]
LORA = {"r": 8, "lora_alpha": 16, "lora_dropout": 0.0}
BETA, LEARNING_RATE, SEED, VAL_SIZE = 0.1, 5e-5, 42, 16


def log(message: str) -> None:
    print(f"[dpo_speed] {message}", file=sys.stderr, flush=True)


def write_pairs(path: Path) -> None:
    records = json.loads(COFFEE.read_text(encoding="utf-8"))
    pairs = [{"prompt": r["instruction"], "chosen": r["output"], "rejected": r["output"].removeprefix(OPENING)}
             for r in records if r["output"].startswith(OPENING)]
    path.write_text(json.dumps(pairs, ensure_ascii=False), encoding="utf-8")


def gemmaforge_config(work: Path, args: argparse.Namespace) -> Path:
    config = {
        "output_dir": str(work / "gemmaforge" / "run"),
        "model": {"name_or_path": "gemma3-270m"},
        "data": {"path": str(work / "pairs.json"), "val_size": VAL_SIZE},
        "lora": {**LORA, "target_modules": TARGETS},
        "train": {"method": "dpo", "pref_beta": BETA, "max_steps": args.steps,
                  "per_device_train_batch_size": args.batch_size, "gradient_accumulation_steps": 1,
                  "learning_rate": LEARNING_RATE, "cutoff_len": args.cutoff, "precision": args.precision,
                  "seed": SEED, "save_steps": 10_000, "eval_strategy": "no", "logging_steps": 1,
                  **({"gradient_checkpointing": True} if args.gradient_checkpointing else {})},
    }
    path = work / "gemmaforge.yaml"
    path.write_text(yaml.safe_dump(config, allow_unicode=True), encoding="utf-8")
    return path


def train_trl(work: Path, args: argparse.Namespace) -> dict[str, Any]:
    """In its own process: TRL's DPOTrainer on the pairs gemmaforge's data stage kept for training."""
    import torch
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import DPOConfig, DPOTrainer

    from gemmaforge.models import default_home, resolve_model

    base = resolve_model("gemma3-270m", default_home())
    tokenizer = AutoTokenizer.from_pretrained(base.path)
    tokenizer.chat_template = base.family.chat.jinja()
    lines = (work / "gemmaforge" / "run" / "data" / "train.jsonl").read_text(encoding="utf-8").splitlines()
    rows = [json.loads(line) for line in lines if line]
    dataset = Dataset.from_list([{"prompt": row["messages"], "chosen": [row["chosen"]],
                                  "rejected": [row["rejected"]]} for row in rows])
    model = AutoModelForCausalLM.from_pretrained(base.path, dtype=torch.float32)
    config = DPOConfig(output_dir=str(work / "trl"), beta=BETA, max_length=args.cutoff, max_steps=args.steps,
                       per_device_train_batch_size=args.batch_size, gradient_accumulation_steps=1,
                       learning_rate=LEARNING_RATE, use_cpu=True, bf16=args.precision == "bf16", seed=SEED,
                       save_strategy="no", report_to=[], logging_steps=1)
    trainer = DPOTrainer(model=model, args=config, train_dataset=dataset, processing_class=tokenizer,
                         peft_config=LoraConfig(task_type="CAUSAL_LM", target_modules=TARGETS, **LORA))
    start = time.perf_counter()
    result = trainer.train()
    seconds = time.perf_counter() - start
    return {"steps": result.global_step, "pairs": result.global_step * args.batch_size,
            "train_runtime_s": round(seconds, 2),
            "pairs_per_second": round(result.global_step * args.batch_size / seconds, 3),
            "peak_memory_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}


def run_gemmaforge(work: Path, args: argparse.Namespace) -> dict[str, Any]:
    shutil.rmtree(work / "gemmaforge", ignore_errors=True)  # a leftover run would be resumed
    config = gemmaforge_config(work, args)
    log = work / "gemmaforge.log"
    with log.open("w", encoding="utf-8") as out:
        code = subprocess.run([sys.executable, "-m", "gemmaforge", "train", str(config)], cwd=ROOT, stdout=out,
                              stderr=subprocess.STDOUT, check=False).returncode
    if code:
        raise SystemExit(f"gemmaforge train failed (exit {code}): see {log}")
    stage = json.loads((work / "gemmaforge" / "run" / "manifest.json").read_text(encoding="utf-8"))["stages"]["train"]
    return {"steps": stage["steps"], "pairs": stage["steps"] * args.batch_size,
            "train_runtime_s": stage["train_runtime_s"], "pairs_per_second": stage["samples_per_second"],
            "peak_memory_bytes": stage["peak_memory_bytes"], "precision": stage["precision"]}


def run_trl(work: Path, args: argparse.Namespace) -> dict[str, Any]:
    command = [sys.executable, __file__, "--child", "--work", str(work), "--steps", str(args.steps),
               "--batch-size", str(args.batch_size), "--cutoff", str(args.cutoff), "--precision", args.precision]
    subprocess.run(command, check=True, cwd=ROOT)
    return json.loads((work / "trl.json").read_text(encoding="utf-8"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--cutoff", type=int, default=256)
    parser.add_argument("--precision", choices=["fp32", "bf16"], default="fp32")
    parser.add_argument("--gradient-checkpointing", action="store_true",
                        help="gemmaforge checkpoints gradients as TRL does by default (else its memory plan decides)")
    parser.add_argument("--work", type=Path)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    work = args.work or Path(tempfile.mkdtemp(prefix="dpo_speed-"))
    if args.child:
        (work / "trl.json").write_text(json.dumps(train_trl(work, args)), encoding="utf-8")
        return
    work.mkdir(parents=True, exist_ok=True)
    write_pairs(work / "pairs.json")
    log("gemmaforge ...")
    ours = run_gemmaforge(work, args)  # first: its data stage writes the split both train on
    log("trl ...")
    theirs = run_trl(work, args)
    speedup = ours["pairs_per_second"] / theirs["pairs_per_second"]
    memory = ours["peak_memory_bytes"] / theirs["peak_memory_bytes"]
    print(json.dumps({"machine": f"{platform.processor() or platform.machine()}, {platform.system()}",
                      "setup": vars(args) | {"work": str(work)}, "gemmaforge": ours, "trl": theirs,
                      "speedup": round(speedup, 2), "memory_ratio": round(memory, 2),
                      "target_met": speedup >= 1.5 and memory <= 1.0}, indent=2, default=str))


if __name__ == "__main__":
    main()
