"""LoRA training throughput, peak memory, MFU and eval loss: the walkthrough recipe, TRL and gemmaforge.

    python benchmarks/train_throughput.py [--steps 5] [--contenders recipe,trl,gemmaforge] [--work DIR]
                                          [--ours-override train.packing=false ...]

All three contenders LoRA-train the embedded Gemma 3 270M on the same train split of
examples/data/coffee_qa.json (`gemmaforge data prepare ... --val-size 25 --seed 42`), with LoRA r=8,
alpha 32, dropout 0.1 on q/k/v/o_proj, batch 4 x gradient accumulation 4, cutoff 512, learning rate 2e-4,
seed 42 and the same number of optimizer steps:

* recipe: the first walkthrough's PEFT recipe. pad = eos, every conversation rendered with the Gemma chat
  template and padded to 512 tokens, DataCollatorForLanguageModeling(mlm=False) (loss on every non-pad
  token), a plain transformers Trainer with bf16 autocast on an fp32 model (the walkthrough's fp16 AMP on a GPU).
* trl: TRL's SFTTrainer with its defaults for a conversational {"messages"} dataset (skipped when TRL is
  missing: pip install trl==1.16.0).
* gemmaforge: `python -m gemmaforge train CONFIG` through the real CLI, with its defaults (packing, loss on
  answers only, chat-marker rows trained) plus any --ours-override.

Each contender trains in its own process (peak RSS is that process's). Reported per contender:

* samples/s: examples trained per second of the training loop (trainer.train(), model loading excluded);
* supervised tokens/s: samples/s x the mean number of tokens that carry loss in gemmaforge's definition
  (answer + <end_of_turn>, `encode_for_training`) per train example, the same divisor for everyone;
* MFU: 6 x parameters x tokens pushed through the model per second (padding included) / this machine's measured
  matmul rate in the contender's precision (fp32 or bf16; best of 8 multiplies of 2048 x 2048). It is the
  usual 6N approximation, which over-credits LoRA (frozen weights get no weight gradient: closer to 4N) and
  gemmaforge (its 262k-row output layer runs only at supervised positions), so values near or above 100% mean
  "as fast as this CPU's matmul rate allows", not an error;
* eval loss: mean cross-entropy over the supervised tokens of the val split, computed here the same way
  for every trained adapter (fp32, no grad), and for the base model as a reference.

It ends with the gemmaforge / recipe ratios and whether the target is met: >= 6x samples/s at <= 0.5x
peak memory with an eval loss no worse than the recipe's. --batch-size and --grad-accum shrink the
steps for a quick smoke test (then the comparison is not the one above).
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import resource
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import yaml

from gemmaforge.chat.conversation import IGNORE_INDEX, Message
from gemmaforge.models import ResolvedModel, default_home, resolve_model

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_DATA = ROOT / "examples" / "data" / "coffee_qa.json"
CONTENDERS = ("recipe", "trl", "gemmaforge")
MODEL = "gemma3-270m"
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj"]
LORA = {"r": 8, "lora_alpha": 32, "lora_dropout": 0.1}
CUTOFF = 512
VAL_SIZE = 25
LEARNING_RATE = 2e-4
SEED = 42
TARGET_SPEEDUP, TARGET_MEMORY = 6.0, 0.5
TRL_HINT = "pip install trl==1.16.0"


@dataclass(frozen=True)
class Setup:
    steps: int
    batch_size: int
    grad_accum: int
    library_precision: str = "bf16"  # recipe and TRL: bf16 autocast (the choice) or plain fp32
    cutoff: int = CUTOFF
    learning_rate: float = LEARNING_RATE
    seed: int = SEED


# ---------------------------------------------------------------------------- shared helpers


def log(message: str) -> None:
    print(f"[train_throughput] {message}", file=sys.stderr, flush=True)


def base_model() -> ResolvedModel:
    return resolve_model(MODEL, default_home())


def read_split(work: Path, name: str) -> list[list[Message]]:
    lines = (work / "data" / f"{name}.jsonl").read_text(encoding="utf-8").splitlines()
    return [json.loads(line)["messages"] for line in lines if line]


def lora_config() -> Any:
    from peft import LoraConfig

    return LoraConfig(task_type="CAUSAL_LM", target_modules=TARGETS, bias="none", **LORA)


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


class StepCounter:
    """Counts the examples and the (padded) tokens every training step pushes through the model. Counted in
    trainer.training_step, not in the collator: accelerate's data loader collates one batch ahead."""

    def __init__(self, trainer: Any):
        self.examples = 0
        self.tokens = 0
        inner = trainer.training_step

        def training_step(model: Any, inputs: dict[str, Any], *args: Any, **kwargs: Any) -> Any:
            self.examples += int(inputs["input_ids"].shape[0])
            self.tokens += int(inputs["input_ids"].numel())
            return inner(model, inputs, *args, **kwargs)

        trainer.training_step = training_step


def precision_name(bf16: bool) -> str:
    return "bf16 autocast (fp32 weights)" if bf16 else "fp32"


def time_training(trainer: Any) -> dict[str, Any]:
    """Run trainer.train() and what the loop did: examples, padded tokens, seconds, peak RSS."""
    counter = StepCounter(trainer)
    start = time.perf_counter()
    result = trainer.train()
    seconds = time.perf_counter() - start
    return {
        "steps": result.global_step,
        "examples": counter.examples,
        "tokens_processed": counter.tokens,
        "train_runtime_s": round(seconds, 2),
        "peak_memory_bytes": peak_rss_bytes(),
        "train_loss_own_definition": round(result.training_loss, 4),
    }


# ---------------------------------------------------------------------------- contenders (child processes)


def train_recipe(work: Path, setup: Setup, out: Path) -> dict[str, Any]:
    import torch
    from datasets import Dataset
    from peft import get_peft_model
    from transformers import (
        AutoModelForCausalLM,
        AutoTokenizer,
        DataCollatorForLanguageModeling,
        Trainer,
        TrainingArguments,
        set_seed,
    )

    base = base_model()
    tokenizer = AutoTokenizer.from_pretrained(base.path)
    tokenizer.pad_token = tokenizer.eos_token
    texts = [base.family.chat.render(m).text for m in read_split(work, "train")]
    dataset = Dataset.from_dict({"text": texts}).map(
        lambda batch: tokenizer(batch["text"], add_special_tokens=False, padding="max_length", truncation=True,
                                max_length=setup.cutoff),
        batched=True, remove_columns=["text"],
    )
    set_seed(setup.seed)  # the LoRA initialisation draws from the global RNG
    model = AutoModelForCausalLM.from_pretrained(base.path, dtype=torch.float32)
    model = get_peft_model(model, lora_config())
    args = TrainingArguments(
        output_dir=str(out / "trainer"), max_steps=setup.steps, per_device_train_batch_size=setup.batch_size,
        gradient_accumulation_steps=setup.grad_accum, learning_rate=setup.learning_rate,
        bf16=setup.library_precision == "bf16", use_cpu=True, logging_steps=1, save_strategy="no", report_to=[],
        seed=setup.seed,
    )
    collator = DataCollatorForLanguageModeling(tokenizer, mlm=False)
    trainer = Trainer(model=model, args=args, train_dataset=dataset, data_collator=collator)
    result = time_training(trainer)
    model.save_pretrained(out / "adapter")
    return {**result, "precision": precision_name(args.bf16), "loss_on": "every non-pad token"}


def train_trl(work: Path, setup: Setup, out: Path) -> dict[str, Any]:
    from datasets import Dataset
    from transformers import AutoTokenizer
    from trl import SFTConfig, SFTTrainer

    base = base_model()
    tokenizer = AutoTokenizer.from_pretrained(base.path)
    tokenizer.chat_template = base.family.chat.jinja()
    dataset = Dataset.from_list([{"messages": m} for m in read_split(work, "train")])
    args = SFTConfig(
        output_dir=str(out / "trainer"), max_length=setup.cutoff, max_steps=setup.steps,
        per_device_train_batch_size=setup.batch_size, gradient_accumulation_steps=setup.grad_accum,
        learning_rate=setup.learning_rate, use_cpu=True, logging_steps=1, save_strategy="no", report_to=[],
        seed=setup.seed, bf16=setup.library_precision == "bf16",
    )
    trainer = SFTTrainer(model=str(base.path), args=args, train_dataset=dataset, processing_class=tokenizer,
                         peft_config=lora_config())
    result = time_training(trainer)
    trainer.model.save_pretrained(out / "adapter")
    return {**result, "precision": precision_name(args.bf16), "loss_on": "every non-pad token (TRL default)",
            "gradient_checkpointing": args.gradient_checkpointing}


def run_child(name: str, work: Path, setup: Setup) -> None:
    """`--contender NAME`: train one contender in this process and write WORK/NAME/result.json."""
    out = work / name
    trainer = {"recipe": train_recipe, "trl": train_trl}[name]
    result = trainer(work, setup, out)
    (out / "result.json").write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")


# ---------------------------------------------------------------------------- parent: data, runs


def prepare_split(work: Path, data: Path) -> dict[str, Any]:
    out = work / "data"
    command = [sys.executable, "-m", "gemmaforge", "data", "prepare", str(data), "-o", str(out),
               "--val-size", str(VAL_SIZE), "--seed", str(SEED), "--cutoff-len", str(CUTOFF)]
    subprocess.run(command, check=True, cwd=ROOT, stdout=subprocess.DEVNULL)
    return json.loads((out / "stats.json").read_text(encoding="utf-8"))


def run_logged(command: list[str], logfile: Path) -> int:
    logfile.parent.mkdir(parents=True, exist_ok=True)
    with logfile.open("w", encoding="utf-8") as f:
        return subprocess.run(command, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, check=False).returncode


def failure(code: int, logfile: Path) -> dict[str, Any]:
    tail = logfile.read_text(encoding="utf-8", errors="replace").splitlines()[-15:]
    log(f"failed (exit {code}); last lines of {logfile}:\n" + "\n".join(tail))
    return {"error": f"exit code {code}, see {logfile}"}


def trl_missing() -> str | None:
    try:
        import trl  # noqa: F401
    except ImportError as exc:
        return f"TRL is not installed ({exc}); install it with `{TRL_HINT}` to benchmark it"
    return None


def run_library_contender(name: str, work: Path, setup: Setup, reuse: bool) -> dict[str, Any]:
    if name == "trl" and (reason := trl_missing()):
        log(f"skipping trl: {reason}")
        return {"skipped": reason}
    out = work / name
    if reuse and (out / "result.json").is_file():
        log(f"reusing {out / 'result.json'}")
        return read_library_result(out)
    shutil.rmtree(out, ignore_errors=True)
    command = [sys.executable, str(Path(__file__).resolve()), "--contender", name, "--work", str(work),
               "--steps", str(setup.steps), "--batch-size", str(setup.batch_size),
               "--grad-accum", str(setup.grad_accum), "--library-precision", setup.library_precision]
    code = run_logged(command, out / "log.txt")
    if code:
        return failure(code, out / "log.txt")
    return read_library_result(out)


def read_library_result(out: Path) -> dict[str, Any]:
    result = json.loads((out / "result.json").read_text(encoding="utf-8"))
    return {**result, "adapter": str(out / "adapter"), "log": str(out / "log.txt")}


def gemmaforge_config(work: Path, data: Path, setup: Setup) -> Path:
    config = {
        "output_dir": str(work / "gemmaforge" / "run"),
        "model": {"name_or_path": MODEL},
        "data": {"path": str(data), "val_size": VAL_SIZE},
        "lora": {**LORA, "target_modules": TARGETS},
        "train": {
            "max_steps": setup.steps, "per_device_train_batch_size": setup.batch_size,
            "gradient_accumulation_steps": setup.grad_accum, "learning_rate": setup.learning_rate,
            "cutoff_len": setup.cutoff, "eval_strategy": "no", "save_strategy": "no", "logging_steps": 1,
            "seed": setup.seed,
        },
    }
    path = work / "gemmaforge" / "config.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(config, sort_keys=False), encoding="utf-8")
    return path


def run_gemmaforge(work: Path, data: Path, setup: Setup, overrides: list[str], split: dict[str, Any],
                   reuse: bool) -> dict[str, Any]:
    run, logfile = work / "gemmaforge" / "run", work / "gemmaforge" / "log.txt"
    if reuse and (run / "adapter").is_dir() and (run / "metrics.jsonl").is_file():
        log(f"reusing {run}")
        return read_gemmaforge(run, logfile, overrides, split)
    shutil.rmtree(work / "gemmaforge", ignore_errors=True)  # a leftover run dir would be resumed
    config = gemmaforge_config(work, data, setup)
    code = run_logged([sys.executable, "-m", "gemmaforge", "train", str(config), *overrides], logfile)
    if code:
        return failure(code, logfile)
    return read_gemmaforge(run, logfile, overrides, split)


def read_gemmaforge(run: Path, logfile: Path, overrides: list[str], split: dict[str, Any]) -> dict[str, Any]:
    manifest = json.loads((run / "manifest.json").read_text(encoding="utf-8"))
    stage, data_stage = manifest["stages"]["train"], manifest["stages"]["data"]
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text(encoding="utf-8").splitlines() if line]
    return {
        "steps": stage["steps"],
        "examples": round(stage["samples_per_second"] * stage["train_runtime_s"], 1),
        "train_runtime_s": stage["train_runtime_s"],
        "samples_per_second_manifest": stage["samples_per_second"],
        "supervised_tokens_per_second_manifest": stage["supervised_tokens_per_second"],
        "peak_memory_bytes": stage["peak_memory_bytes"],
        "precision": stage["precision"],
        "packing": stage["packing"],
        "train_loss_own_definition": stage["train_loss"],
        "eval_loss_own": stage.get("eval_loss"),
        "logged_losses": [row["loss"] for row in metrics if "loss" in row],
        "overrides": overrides,
        "same_split": all(data_stage[key] == split[key] for key in ("train_sha256", "val_sha256")),
        "loss_on": "answers + <end_of_turn> (gemmaforge default)",
        "adapter": str(run / "adapter"),
        "log": str(logfile),
    }


# ---------------------------------------------------------------------------- parent: measurements


def matmul_flops(dtype_name: str = "fp32", size: int = 2048, repeats: int = 8) -> float:
    """This machine's matmul rate in fp32 or bf16 (FLOP/s, the best of `repeats` multiplies: the peak, least
    disturbed by other load on a shared machine) with torch's default threads."""
    import torch

    dtype = torch.bfloat16 if dtype_name == "bf16" else torch.float32
    a, b = torch.randn(size, size, dtype=dtype), torch.randn(size, size, dtype=dtype)
    torch.matmul(a, b)  # warm-up
    rates = []
    for _ in range(repeats):
        start = time.perf_counter()
        torch.matmul(a, b)
        rates.append(2 * size**3 / (time.perf_counter() - start))
    return max(rates)


def encode_split(messages: list[list[Message]], tokenizer: Any, base: ResolvedModel) -> list[dict[str, list[int]]]:
    rows = []
    for conversation in messages:
        ids, labels = base.family.chat.encode(conversation, tokenizer, CUTOFF)
        rows.append({"input_ids": ids, "labels": labels})
    return rows


def supervised_count(row: dict[str, list[int]]) -> int:
    return sum(label != IGNORE_INDEX for label in row["labels"])


def padded_tokens_per_example(rows: list[tuple[int, int]], batch_size: int, trials: int = 4000) -> float:
    """Expected tokens a right-padding collator pushes through the model per example, for random batches of
    `batch_size` rows, each row given as (tokens, examples it holds)."""
    rng = random.Random(SEED)
    tokens = examples = 0
    for _ in range(trials):
        pick = rng.sample(rows, min(batch_size, len(rows)))
        tokens += len(pick) * max(length for length, _ in pick)
        examples += sum(n for _, n in pick)
    return tokens / examples


def gemmaforge_tokens_per_example(train_rows: list[dict[str, list[int]]], packing: bool, batch_size: int) -> float:
    """gemmaforge's rows: packed into <= cutoff tokens (train.packing) or one example each, padded per batch."""
    if not packing:
        return padded_tokens_per_example([(len(r["input_ids"]), 1) for r in train_rows], batch_size)
    from gemmaforge.train.packing import pack_examples

    packed = pack_examples([r for r in train_rows if supervised_count(r)], CUTOFF)
    return padded_tokens_per_example([(len(r["input_ids"]), r["examples"][0]) for r in packed], batch_size)


def eval_loss(base: ResolvedModel, val_rows: list[dict[str, list[int]]], adapter: Path | None) -> tuple[float, int]:
    """Mean next-token cross-entropy over the supervised tokens of `val_rows` (fp32, eval mode, no grad), and
    the model's parameter count (base + adapter)."""
    import torch
    import torch.nn.functional as F
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base.path, dtype=torch.float32)
    if adapter is not None:
        model = PeftModel.from_pretrained(model, str(adapter))
    model.eval()
    total, count = 0.0, 0
    with torch.no_grad():
        for row in val_rows:
            logits = model(input_ids=torch.tensor([row["input_ids"]])).logits[0, :-1].float()  # (T-1, V)
            targets = torch.tensor(row["labels"][1:])
            total += float(F.cross_entropy(logits, targets, ignore_index=IGNORE_INDEX, reduction="sum"))
            count += int((targets != IGNORE_INDEX).sum())
    return total / count, sum(p.numel() for p in model.parameters())


# ---------------------------------------------------------------------------- parent: report


def derive(result: dict[str, Any], mean_supervised: float, tokens_per_example: float, n_params: int,
           flops: float) -> dict[str, Any]:
    """samples/s, supervised tokens/s, processed tokens/s and MFU from a contender's raw numbers."""
    samples_per_s = result["examples"] / result["train_runtime_s"]
    tokens_per_s = samples_per_s * tokens_per_example
    return {
        "samples_per_second": round(samples_per_s, 3),
        "supervised_tokens_per_second": round(samples_per_s * mean_supervised, 1),
        "tokens_processed_per_example": round(tokens_per_example, 1),
        "tokens_processed_per_second": round(tokens_per_s, 1),
        "mfu": round(6 * n_params * tokens_per_s / flops, 4),
        "peak_memory_mib": round(result["peak_memory_bytes"] / 2**20),
    }


def verdict(results: dict[str, dict[str, Any]]) -> dict[str, Any] | None:
    ours, recipe = results.get("gemmaforge", {}), results.get("recipe", {})
    if "samples_per_second" not in ours or "samples_per_second" not in recipe:
        return None
    speedup = ours["samples_per_second"] / recipe["samples_per_second"]
    memory = ours["peak_memory_bytes"] / recipe["peak_memory_bytes"]
    no_worse = ours["eval_loss"] <= recipe["eval_loss"]
    return {
        "samples_per_second_ratio": round(speedup, 2),
        "peak_memory_ratio": round(memory, 3),
        "eval_loss_no_worse": no_worse,
        "target": f">= {TARGET_SPEEDUP:g}x samples/s at <= {TARGET_MEMORY:g}x peak memory, eval loss no worse",
        "target_met": speedup >= TARGET_SPEEDUP and memory <= TARGET_MEMORY and no_worse,
    }


def markdown(results: dict[str, dict[str, Any]], base_loss: float) -> str:
    header = ("| contender | steps | examples | loop s | samples/s | supervised tok/s | processed tok/s | MFU "
              "| peak RSS MiB | eval loss | precision |")
    lines = [header, "|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, r in results.items():
        if "samples_per_second" not in r:
            lines.append(f"| {name} | {r.get('skipped') or r.get('error')} |" + " |" * 9)
            continue
        lines.append(
            f"| {name} | {r['steps']} | {r['examples']:g} | {r['train_runtime_s']:.1f} | {r['samples_per_second']:.3f} "
            f"| {r['supervised_tokens_per_second']:.1f} | {r['tokens_processed_per_second']:.0f} | {r['mfu']:.2%} "
            f"| {r['peak_memory_mib']} | {r['eval_loss']:.4f} | {r['precision']} |"
        )
    lines.append(f"| base model (no training) | | | | | | | | | {base_loss:.4f} | fp32 |")
    return "\n".join(lines)


def print_report(summary: dict[str, Any]) -> None:
    print(json.dumps(summary, indent=2))
    print()
    print(markdown(summary["contenders"], summary["base_eval_loss"]))
    v = summary["gemmaforge_vs_recipe"]
    if v:
        print(f"\ngemmaforge / recipe: {v['samples_per_second_ratio']}x samples/s, {v['peak_memory_ratio']}x peak "
              f"memory, eval loss no worse: {v['eval_loss_no_worse']}; target ({v['target']}) met: {v['target_met']}")


# ---------------------------------------------------------------------------- main


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=5, help="optimizer steps for every contender (default: 5)")
    parser.add_argument("--contenders", default=",".join(CONTENDERS), help="comma-separated subset of %(default)s")
    parser.add_argument("--work", type=Path, default=ROOT / "runs" / "bench-train-throughput",
                        help="folder for the split, adapters and logs (default: %(default)s)")
    parser.add_argument("--data", type=Path, default=DEFAULT_DATA, help="alpaca dataset (default: coffee_qa.json)")
    parser.add_argument("--ours-override", action="append", default=[], metavar="KEY=VALUE",
                        help="extra gemmaforge config override, e.g. train.packing=false (repeatable)")
    parser.add_argument("--batch-size", type=int, default=4, help="per-device batch (default 4; smaller: smoke test)")
    parser.add_argument("--grad-accum", type=int, default=4, help="gradient accumulation (default 4)")
    parser.add_argument("--library-precision", choices=["bf16", "fp32"], default="bf16",
                        help="recipe and TRL: bf16 autocast as the issue specifies (default; emulated and very slow on "
                        "CPUs without AVX512-BF16/AMX) or fp32, what gemmaforge picks on such a CPU")
    parser.add_argument("--reuse", action="store_true",
                        help="keep a contender's finished result found in WORK (same settings!) instead of training "
                        "again")
    parser.add_argument("--contender", choices=["recipe", "trl"], help=argparse.SUPPRESS)  # child process mode
    args = parser.parse_args()
    args.names = [n.strip() for n in args.contenders.split(",") if n.strip()]
    unknown = sorted(set(args.names) - set(CONTENDERS))
    if unknown or not args.names:
        parser.error(f"--contenders: unknown {unknown}; choose from {','.join(CONTENDERS)}")
    return args


def run_benchmark(args: argparse.Namespace, setup: Setup) -> dict[str, Any]:
    from gemmaforge.models import load_tokenizer

    work = args.work.resolve()
    data = args.data.resolve()
    log(f"preparing the split ({data.name}, {VAL_SIZE} for validation, seed {SEED}) in {work / 'data'}")
    split = prepare_split(work, data)
    base = base_model()
    tokenizer = load_tokenizer(base.path)
    train_rows = encode_split(read_split(work, "train"), tokenizer, base)
    val_rows = encode_split(read_split(work, "val"), tokenizer, base)
    mean_supervised = statistics.mean(supervised_count(r) for r in train_rows)
    flops = {name: matmul_flops(name) for name in ("fp32", "bf16")}
    log(f"matmul rate: fp32 {flops['fp32'] / 1e9:.1f} GFLOP/s, bf16 {flops['bf16'] / 1e9:.1f} GFLOP/s; "
        f"{len(train_rows)} train / {len(val_rows)} val examples")

    raw: dict[str, dict[str, Any]] = {}
    for name in args.names:
        log(f"training {name} ({setup.steps} steps of {setup.batch_size} x {setup.grad_accum}) ...")
        if name == "gemmaforge":
            raw[name] = run_gemmaforge(work, data, setup, args.ours_override, split, args.reuse)
        else:
            raw[name] = run_library_contender(name, work, setup, args.reuse)

    log("evaluating the base model and every adapter on the val split ...")
    base_loss, base_params = eval_loss(base, val_rows, None)
    results = {}
    for name, result in raw.items():
        if "adapter" not in result:
            results[name] = result
            continue
        loss, n_params = eval_loss(base, val_rows, Path(result["adapter"]))
        if name == "gemmaforge":
            per_example = gemmaforge_tokens_per_example(train_rows, result["packing"], setup.batch_size)
        else:
            per_example = result["tokens_processed"] / result["examples"]
        rate = flops["bf16" if result["precision"].startswith("bf16") else "fp32"]  # MFU against its own arithmetic
        results[name] = {**result, **derive(result, mean_supervised, per_example, n_params, rate),
                         "eval_loss": round(loss, 4), "parameters": n_params}
    return {
        "machine": {"platform": platform.platform(), "processor": platform.processor(),
                    **{f"{name}_matmul_gflops": round(rate / 1e9, 1) for name, rate in flops.items()}},
        "setup": {**asdict(setup), "model": MODEL, "data": str(data), "lora": {**LORA, "target_modules": TARGETS},
                  "examples_per_step": setup.batch_size * setup.grad_accum},
        "data": {"train": len(train_rows), "val": len(val_rows), "mean_supervised_tokens": round(mean_supervised, 1),
                 "mean_tokens": round(statistics.mean(len(r["input_ids"]) for r in train_rows), 1),
                 "train_sha256": split["train_sha256"], "val_sha256": split["val_sha256"]},
        "base_eval_loss": round(base_loss, 4),
        "base_parameters": base_params,
        "contenders": results,
        "gemmaforge_vs_recipe": verdict(results),
    }


def main() -> None:
    args = parse_args()
    setup = Setup(steps=args.steps, batch_size=args.batch_size, grad_accum=args.grad_accum,
                  library_precision=args.library_precision)
    if args.contender:
        run_child(args.contender, args.work.resolve(), setup)
        return
    print_report(run_benchmark(args, setup))


if __name__ == "__main__":
    main()
