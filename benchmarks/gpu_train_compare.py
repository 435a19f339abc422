"""gemmaforge train against the walkthrough's recipe, TRL and Unsloth on one GPU, in one command.

    python benchmarks/gpu_train_compare.py --out DIR [--models gemma3-1b,gemma3-4b,gemma4-e2b] [--budget-s 470]
    python benchmarks/gpu_train_compare.py --out DIR --dry-run     # data, checkpoints' configs, plan; no training

Every trainer trains the same LoRA (r 8, alpha 32, dropout 0.1 on q/k/v/o), batch 4 x gradient accumulation 4,
cutoff 512, 2 epochs, on the same long-tailed alpaca records written here (median ~490 characters, longest ~3,100),
on random weights of the real architectures (Gemma 3 1B and 4B text, Gemma 4 E2B text; configs below, from the
models' config.json on the Hub), with the real Gemma 3 tokenizer (the embedded model's):

- recipe: the walkthrough's PEFT script as written: fp16 weights, `fp16=True`, every row padded to 512;
- trl: TRL's SFTTrainer with `packing=True` and bf16 weights, its defaults otherwise;
- unsloth: Unsloth's FastLanguageModel with packing, where it installs (skipped with the reason otherwise);
- gemmaforge: `gemmaforge train` with its defaults (packing, bf16, train.attention auto).

Each trainer runs in its own process under its own time limit (a failure or time-out is a finding, the next still
runs). Measured over each training loop alone (model loading excluded): examples/s, tokens/s (the examples' own
tokens, up to the cutoff), MFU (model FLOP/s of LoRA training, benchmarks/gpu_check.py's formula, over the bf16
matrix-product rate measured here), torch's peak allocated memory and the GPU's mean utilisation (nvidia-smi or
amd-smi every 0.5 s during the loop). Results: DIR/compare.json, DIR/summary.md (the table), DIR/log.txt.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]

TRAINERS = ("recipe", "trl", "unsloth", "gemmaforge")
LIMIT_S = 150  # per trainer and model
RECORDS, EPOCHS, CUTOFF, BATCH, ACCUMULATION = 256, 2, 512, 4, 4
LORA = {"r": 8, "lora_alpha": 32, "lora_dropout": 0.1, "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"]}

# Text configs of the real checkpoints (config.json of google/gemma-3-1b-it, google/gemma-3-4b-it's text_config,
# google/gemma-4-E2B-it's text_config); the weights are random.
GEMMA3_COMMON = {"model_type": "gemma3_text", "vocab_size": 262144, "head_dim": 256, "query_pre_attn_scalar": 256,
                 "rope_theta": 1_000_000.0, "max_position_embeddings": 32768, "final_logit_softcapping": None,
                 "attn_logit_softcapping": None, "pad_token_id": 0, "bos_token_id": 2, "eos_token_id": 1}
MODELS: dict[str, dict[str, Any]] = {
    "gemma3-1b": {**GEMMA3_COMMON, "hidden_size": 1152, "intermediate_size": 6912, "num_hidden_layers": 26,
                  "num_attention_heads": 4, "num_key_value_heads": 1, "sliding_window": 512},
    "gemma3-4b": {**GEMMA3_COMMON, "hidden_size": 2560, "intermediate_size": 10240, "num_hidden_layers": 34,
                  "num_attention_heads": 8, "num_key_value_heads": 4, "sliding_window": 1024},
    "gemma4-e2b": {"model_type": "gemma4_text", "vocab_size": 262144, "vocab_size_per_layer_input": 262144,
                   "hidden_size": 1536, "hidden_size_per_layer_input": 256, "intermediate_size": 6144,
                   "num_hidden_layers": 35,
                   "layer_types": (["sliding_attention"] * 4 + ["full_attention"]) * 7,
                   "num_attention_heads": 8, "num_key_value_heads": 1, "head_dim": 256, "global_head_dim": 512,
                   "num_kv_shared_layers": 20, "use_double_wide_mlp": True, "attention_k_eq_v": False,
                   "sliding_window": 512, "final_logit_softcapping": 30.0, "max_position_embeddings": 131072,
                   "rope_parameters": {"full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                                                          "rope_theta": 1_000_000.0},
                                       "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0}},
                   "pad_token_id": 0, "bos_token_id": 2, "eos_token_id": 1, "tie_word_embeddings": True},
}


def long_tailed_records(n: int, seed: int = 0) -> list[dict[str, str]]:
    """Alpaca records whose answer lengths follow a log-normal (median ~490 characters, capped near 3,100)."""
    # the lengths from their own generator: the same lengths whatever words the README holds today
    sizes, rng = random.Random(seed), random.Random(seed + 1)
    words = [w.strip(".,?!\"'()") for w in (ROOT / "README.md").read_text(encoding="utf-8").split()
             if w.isascii() and w.strip(".,?!\"'()").isalpha()]

    def text(chars: int) -> str:
        out: list[str] = []
        while sum(len(w) + 1 for w in out) < chars:
            out.append(rng.choice(words))
        return " ".join(out)

    records = []
    for _ in range(n):
        question, answer = sizes.randint(30, 160), min(3100, int(sizes.lognormvariate(6.0, 0.7)))  # e^6 = 403
        records.append({"instruction": text(question) + "?", "input": "", "output": text(answer)})
    return records


def build(args: argparse.Namespace) -> dict[str, Any]:
    """Data, tokenizer and each model's random checkpoint (config + tokenizer; weights drawn in the trainer)."""
    from transformers import AutoTokenizer

    from gemmaforge.families import FAMILIES
    from gemmaforge.models import default_home, resolve_model

    args.work.mkdir(parents=True, exist_ok=True)
    records = long_tailed_records(RECORDS)
    (args.work / "data.json").write_text(json.dumps(records, ensure_ascii=False))
    lengths = sorted(len(r["instruction"]) + len(r["output"]) for r in records)
    embedded = resolve_model("gemma3-270m", default_home())
    for name in args.models:
        folder = args.work / name
        folder.mkdir(exist_ok=True)
        (folder / "config.json").write_text(json.dumps({**MODELS[name], "architectures": None}, indent=1))
        if name.startswith("gemma4"):
            from tests.checkpoint_kinds import write_gemma4_tokenizer

            write_gemma4_tokenizer(folder, embedded.path)
        else:
            for file in ("tokenizer.json", "tokenizer_config.json"):
                (folder / file).write_bytes((embedded.path / file).read_bytes())
        tokenizer = AutoTokenizer.from_pretrained(folder)  # every trainer renders the family's own chat format
        tokenizer.chat_template = FAMILIES[name.split("-")[0]].chat.jinja()
        tokenizer.save_pretrained(folder)
    return {"records": len(records), "median_chars": lengths[len(lengths) // 2], "longest_chars": lengths[-1],
            "models": args.models, "trainers": args.trainers}


# ------------------------------------------------------------------------------- inside a trainer's process


class Utilisation:
    """The GPU's utilisation read from its tool every 0.5 s between start() and stop()."""

    def __init__(self) -> None:
        from gemmaforge.system.gpu_tools import query_gpus
        from gemmaforge.system.monitor import tools_for_this_torch

        self.query = lambda: query_gpus(tools_for_this_torch())
        self.samples: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(0.5):
            gpus = self.query().gpus
            if gpus and gpus[0].utilization_pct is not None:
                self.samples.append(gpus[0].utilization_pct)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> float | None:
        self._stop.set()
        self._thread.join(timeout=5)
        return round(sum(self.samples) / len(self.samples), 1) if self.samples else None


def random_checkpoint(folder: Path) -> Path:
    """The architecture's random weights, saved once beside its config (shared by every trainer)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    weights = folder / "weights"
    if not (weights / "config.json").is_file():
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder), dtype=torch.bfloat16)
        model.save_pretrained(weights)
        for file in folder.glob("tokenizer*"):
            (weights / file.name).write_bytes(file.read_bytes())
    return weights


def timed_loop(loop: Any) -> tuple[float, Any]:
    """Seconds of `loop()` (a trainer's train(): the model is loaded already), the GPU drained at both ends."""
    import torch

    torch.cuda.synchronize()
    begin = time.perf_counter()
    result = loop()
    torch.cuda.synchronize()
    return time.perf_counter() - begin, result


def hf_arguments(out: Path, **precision: bool) -> Any:
    from transformers import TrainingArguments

    return TrainingArguments(output_dir=str(out), num_train_epochs=EPOCHS, per_device_train_batch_size=BATCH,
                             gradient_accumulation_steps=ACCUMULATION, learning_rate=2e-4, logging_steps=10,
                             save_strategy="no", report_to=[], **precision)


def chat_texts(tokenizer: Any, records: list[dict[str, str]]) -> list[str]:
    return [tokenizer.apply_chat_template([{"role": "user", "content": r["instruction"]},
                                           {"role": "assistant", "content": r["output"]}], tokenize=False)
            for r in records]


def train_recipe(folder: Path, records: list[dict[str, str]], out: Path) -> tuple[float, int]:
    """The walkthrough's PEFT recipe as written: fp16 weights and fp16=True, rows padded to the cutoff."""
    import torch
    from datasets import Dataset
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer, DataCollatorForLanguageModeling, Trainer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(random_checkpoint(folder), dtype=torch.float16).cuda()
    model = get_peft_model(model, LoraConfig(task_type="CAUSAL_LM", **LORA))
    data = Dataset.from_dict({"text": chat_texts(tokenizer, records)}).map(
        lambda row: tokenizer(row["text"], truncation=True, max_length=CUTOFF, padding="max_length"),
        remove_columns=["text"])
    trainer = Trainer(model=model, args=hf_arguments(out, fp16=True), train_dataset=data,
                      data_collator=DataCollatorForLanguageModeling(tokenizer, mlm=False))
    seconds, _ = timed_loop(trainer.train)
    return seconds, len(data) * EPOCHS


def train_trl(folder: Path, records: list[dict[str, str]], out: Path) -> tuple[float, int]:
    import torch
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM
    from trl import SFTConfig, SFTTrainer

    model = AutoModelForCausalLM.from_pretrained(random_checkpoint(folder), dtype=torch.bfloat16)
    data = Dataset.from_list([{"messages": [{"role": "user", "content": r["instruction"]},
                                            {"role": "assistant", "content": r["output"]}]} for r in records])
    args = SFTConfig(output_dir=str(out), num_train_epochs=EPOCHS, per_device_train_batch_size=BATCH,
                     gradient_accumulation_steps=ACCUMULATION, learning_rate=2e-4, logging_steps=10,
                     save_strategy="no", report_to=[], bf16=True, packing=True, max_length=CUTOFF)
    trainer = SFTTrainer(model=model, args=args, train_dataset=data, processing_class=str(folder),
                         peft_config=LoraConfig(task_type="CAUSAL_LM", **LORA))
    seconds, _ = timed_loop(trainer.train)
    return seconds, len(records) * EPOCHS


def train_unsloth(folder: Path, records: list[dict[str, str]], out: Path) -> tuple[float, int]:
    try:
        import unsloth  # noqa: F401 - it patches transformers when imported first
    except Exception as exc:  # noqa: BLE001 - not installed, or no build for this GPU
        raise Skipped(f"unsloth does not import here: {type(exc).__name__}: {exc}"[:300]) from None
    from unsloth import FastLanguageModel

    model, tokenizer = FastLanguageModel.from_pretrained(str(random_checkpoint(folder)), max_seq_length=CUTOFF,
                                                         dtype=None, load_in_4bit=False)
    model = FastLanguageModel.get_peft_model(model, r=LORA["r"], lora_alpha=LORA["lora_alpha"],
                                             lora_dropout=LORA["lora_dropout"], target_modules=LORA["target_modules"])
    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer

    data = Dataset.from_dict({"text": chat_texts(tokenizer, records)})
    args = SFTConfig(output_dir=str(out), num_train_epochs=EPOCHS, per_device_train_batch_size=BATCH,
                     gradient_accumulation_steps=ACCUMULATION, learning_rate=2e-4, logging_steps=10,
                     save_strategy="no", report_to=[], bf16=True, packing=True, max_length=CUTOFF)
    seconds, _ = timed_loop(SFTTrainer(model=model, args=args, train_dataset=data, processing_class=tokenizer).train)
    return seconds, len(records) * EPOCHS


def train_gemmaforge(folder: Path, records: list[dict[str, str]], out: Path) -> tuple[float, int]:
    """`gemmaforge train` through its CLI; the loop timed around its Trainer.train, as for the others."""
    from gemmaforge.cli import main
    from gemmaforge.train import loss

    loops: list[float] = []
    train = loss.SupervisedLossTrainer.train

    def timed(self: Any, *a: Any, **k: Any) -> Any:
        seconds, result = timed_loop(lambda: train(self, *a, **k))
        loops.append(seconds)
        return result

    loss.SupervisedLossTrainer.train = timed
    config = out / "config.yaml"
    out.mkdir(parents=True, exist_ok=True)
    config.write_text(json.dumps({
        "output_dir": str(out / "run"), "model": {"name_or_path": str(random_checkpoint(folder))},
        "data": {"path": str(folder.parent / "data.json"), "val_size": 0},
        "lora": LORA, "train": {"num_train_epochs": EPOCHS, "per_device_train_batch_size": BATCH,
                                "gradient_accumulation_steps": ACCUMULATION, "cutoff_len": CUTOFF,
                                "logging_steps": 10, "save_strategy": "no", "eval_strategy": "no"}}))
    if main(["train", str(config)]) != 0:
        raise RuntimeError("gemmaforge train failed (see log.txt)")
    manifest = json.loads((out / "run" / "manifest.json").read_text())["stages"]["train"]
    return loops[0], round(manifest["samples_per_second"] * manifest["train_runtime_s"])


class Skipped(Exception):
    """The trainer cannot run here; the message says why."""


def one_run(args: argparse.Namespace) -> None:
    """Inside a trainer's process: its figures, or why not, as JSON."""
    model, trainer = args.run.split(":")
    folder = args.work / model
    result: dict[str, Any]
    try:
        import torch

        if not torch.cuda.is_available():
            raise Skipped("no GPU: torch.cuda.is_available() is false")
        records = json.loads((args.work / "data.json").read_text())
        torch.cuda.reset_peak_memory_stats()
        utilisation = Utilisation()
        utilisation.start()
        seconds, examples = globals()[f"train_{trainer}"](folder, records, args.work / "runs" / f"{model}-{trainer}")
        result = {"status": "ok", "seconds": round(seconds, 2), "examples": examples,
                  "examples_per_second": round(examples / seconds, 2),
                  "peak_allocated_bytes": torch.cuda.max_memory_allocated(), "gpu_utilisation_pct": utilisation.stop()}
    except Skipped as exc:
        result = {"status": "skipped", "reason": str(exc)}
    except Exception as exc:  # noqa: BLE001 - a trainer's failure is a finding; the next one still runs
        result = {"status": "failed", "reason": f"{type(exc).__name__}: {exc}"[-1500:]}
    (args.work / "results").mkdir(exist_ok=True)
    (args.work / "results" / f"{model}-{trainer}.json").write_text(json.dumps(result, indent=2))


def matmul_tflops() -> float | None:
    import torch
    from gpu_check import bf16_matmul_tflops

    return bf16_matmul_tflops() if torch.cuda.is_available() else None


def derived(result: dict[str, Any], folder: Path, tokens: float, supervised: float, tflops: float | None) -> None:
    """tokens/s and MFU from examples/s (the same per-example counts for every trainer)."""
    from gpu_check import training_flops  # the one FLOP formula of the GPU benchmarks

    rate = result["examples_per_second"]
    result["tokens_per_second"] = round(rate * tokens)
    parameters = _parameters(folder)
    flops = training_flops({"model": str(folder), "parameters": parameters}, tokens, rate, rate * supervised)
    result["mfu"] = round(flops / (tflops * 1e12), 3) if tflops else None


def _parameters(folder: Path) -> int:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        return sum(p.numel() for p in AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder)).parameters())


def example_tokens(folder: Path, records: list[dict[str, str]]) -> tuple[float, float]:
    """Mean tokens per example up to the cutoff, and mean answer (supervised) tokens."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    texts = chat_texts(tokenizer, records)
    total = [min(CUTOFF, len(tokenizer(t)["input_ids"])) for t in texts]
    answers = [len(tokenizer(r["output"])["input_ids"]) for r in records]
    return sum(total) / len(total), sum(min(a, t) for a, t in zip(answers, total)) / len(total)


def summary(results: dict[str, Any]) -> str:
    lines = ["# gemmaforge train against its peers on one GPU", "",
             f"{results['started']}; {results['gpu']}; bf16 matmul {results['bf16_tflops']} TFLOP/s; "
             f"{results['seconds']} s in all", "",
             "| model | trainer | examples/s | tokens/s | MFU | peak GiB | GPU util % | status |",
             "|---|---|---|---|---|---|---|---|"]
    for key, r in results["runs"].items():
        model, trainer = key.split(":")
        peak = r.get("peak_allocated_bytes")
        lines.append(f"| {model} | {trainer} | {r.get('examples_per_second', '')} | {r.get('tokens_per_second', '')} "
                     f"| {r.get('mfu', '')} | {round(peak / 2**30, 1) if peak else ''} | "
                     f"{r.get('gpu_utilisation_pct', '')} | {r['status']} {r.get('reason', '')[:120]} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True, help="where compare.json, summary.md and log.txt go")
    parser.add_argument("--work", type=Path, help="data, checkpoints and runs (default: a folder beside --out)")
    parser.add_argument("--models", type=lambda s: s.split(","), default=list(MODELS),
                        help=f"comma-separated, of {', '.join(MODELS)}")
    parser.add_argument("--trainers", type=lambda s: s.split(","), default=list(TRAINERS),
                        help=f"comma-separated, of {', '.join(TRAINERS)}")
    parser.add_argument("--budget-s", type=float, default=470, help="the whole comparison's time limit (s)")
    parser.add_argument("--dry-run", action="store_true", help="data and checkpoints' configs only; no training")
    parser.add_argument("--run", help=argparse.SUPPRESS)  # MODEL:TRAINER, inside its own process
    args = parser.parse_args()
    args.work = args.work or args.out.parent / f"{args.out.name}-work"
    if args.run:
        one_run(args)
        return
    unknown = sorted(set(args.models) - set(MODELS)) + sorted(set(args.trainers) - set(TRAINERS))
    if unknown:
        parser.error(f"unknown model or trainer: {', '.join(unknown)}")
    args.out.mkdir(parents=True, exist_ok=True)
    begin, deadline = time.perf_counter(), time.monotonic() + args.budget_s
    import torch

    results: dict[str, Any] = {"started": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "dry_run": args.dry_run,
                               "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
                               "setup": build(args), "bf16_tflops": None if args.dry_run else matmul_tflops(),
                               "runs": {}}
    records = json.loads((args.work / "data.json").read_text())
    with (args.out / "log.txt").open("a") as log:
        for model in args.models:
            tokens, supervised = example_tokens(args.work / model, records)
            for trainer in args.trainers:
                key = f"{model}:{trainer}"
                limit = min(LIMIT_S, deadline - time.monotonic())
                if args.dry_run or limit < 10:
                    why = "--dry-run" if args.dry_run else f"no time left in the {args.budget_s:.0f} s budget"
                    results["runs"][key] = {"status": "skipped", "reason": why}
                    continue
                log.write(f"\n===== {key} (limit {limit:.0f} s)\n")
                log.flush()
                command = [sys.executable, __file__, "--out", str(args.out), "--work", str(args.work), "--run", key]
                try:
                    subprocess.run(command, stdout=log, stderr=subprocess.STDOUT, timeout=limit, cwd=ROOT,
                                   env={**os.environ, "PYTHONUNBUFFERED": "1"})
                    path = args.work / "results" / f"{model}-{trainer}.json"
                    result = json.loads(path.read_text()) if path.is_file() else {
                        "status": "failed", "reason": "no result (see log.txt)"}
                except subprocess.TimeoutExpired:
                    result = {"status": "failed", "reason": f"ran past its {limit:.0f} s limit"}
                if result["status"] == "ok":
                    derived(result, args.work / model, tokens, supervised, results["bf16_tflops"])
                results["runs"][key] = result
                print(f"{key}: {result['status']}", flush=True)
    results["seconds"] = round(time.perf_counter() - begin, 1)
    (args.out / "compare.json").write_text(json.dumps(results, indent=2) + "\n")
    (args.out / "summary.md").write_text(summary(results))
    print(summary(results))


if __name__ == "__main__":
    main()
