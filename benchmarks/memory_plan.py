"""The memory planner against measured peaks: `gemmaforge train` on several configs, planned vs measured.

    python benchmarks/memory_plan.py [--steps 6] [--work DIR] [--only NAME ...] [--kinds]

Each config LoRA-trains the embedded Gemma 3 270M for --steps optimizer steps through the real CLI, in its own
process. `train` plans its memory right before the model loads (the same plan `gemmaforge plan` prints) and
records it in the manifest beside the measured peak: on the CPU the process's peak resident memory up to the end of
the training loop (ru_maxrss, everything the process held, loading included), on a GPU torch's
max_memory_allocated. The table gives
both and the error (planned / measured - 1); the planner's target is within +-20% on every row.

Rows are full (the planner plans for full rows of cutoff_len tokens, the worst batch): packing fills rows from
the coffee Q&A set; the unpacked configs train on long synthetic conversations truncated to cutoff_len.
With --kinds the rows are the tiny checkpoints of the multimodal and MoE kinds instead (towers, experts).
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
COFFEE = ROOT / "examples" / "data" / "coffee_qa.json"

CONFIGS: dict[str, dict] = {
    "packed b4 x 512": {},
    "packed b2 x 512": {"train": {"per_device_train_batch_size": 2}},
    "packed b8 x 256": {"train": {"per_device_train_batch_size": 8, "cutoff_len": 256}},
    "packed b4 x 1024": {"train": {"cutoff_len": 1024}},
    "packed b8 x 512, checkpointing": {"train": {"per_device_train_batch_size": 8, "gradient_checkpointing": True}},
    "packed b4 x 512, r 64 all-linear": {"lora": {"r": 64, "lora_alpha": 64, "target_modules": "all-linear"}},
    "packed b4 x 256, fp32": {"train": {"cutoff_len": 256, "precision": "fp32"}},
    "unpacked b4 x 512, long data": {"long": True, "train": {"packing": False}},
    "unpacked b8 x 384, long data, checkpointing": {
        "long": True, "train": {"packing": False, "per_device_train_batch_size": 8, "cutoff_len": 384,
                                "gradient_checkpointing": True}},
}


# The tiny checkpoint of each multimodal kind (tests/checkpoint_kinds.py): towers and experts that the plan
# must count, at sizes where the runtime dominates (the planner's constant terms are what these rows test)
KINDS = ("gemma3-mm", "gemma4-e2b", "gemma4-moe", "gemma4-dense")


def kind_configs(work: Path) -> dict[str, dict]:
    sys.path.insert(0, str(ROOT))
    from gemmaforge.models import EMBEDDED_NAME, default_home, resolve_model
    from tests.checkpoint_kinds import build_checkpoint

    tokenizer = resolve_model(EMBEDDED_NAME, default_home()).path
    configs = {}
    for kind in KINDS:
        folder = work / f"checkpoint-{kind}"
        if not (folder / "config.json").is_file():
            build_checkpoint(kind, folder, tokenizer)
        configs[f"tiny {kind} b4 x 256"] = {"model": str(folder), "train": {"cutoff_len": 256}}
        if kind == "gemma4-moe":
            configs[f"tiny {kind} b4 x 256, expert LoRA"] = {
                "model": str(folder), "train": {"cutoff_len": 256},
                "lora": {"lora_dropout": 0.0, "target_parameters": ["experts.gate_up_proj", "experts.down_proj"]}}
    return configs


def long_conversations(path: Path, count: int = 120) -> Path:
    """Conversations longer than any cutoff here: each answer strings together many coffee answers."""
    records = json.loads(COFFEE.read_text(encoding="utf-8"))
    answers = [r["output"] for r in records]
    rows = [{"instruction": records[i % len(records)]["instruction"],
             "output": "".join(answers[(i + k) % len(answers)] for k in range(40))} for i in range(count)]
    path.write_text(json.dumps(rows, ensure_ascii=False), encoding="utf-8")
    return path


def run_config(name: str, spec: dict, work: Path, steps: int) -> dict:
    data = long_conversations(work / "long.json") if spec.get("long") else COFFEE
    config = {
        "output_dir": str(work / name.replace(" ", "_").replace(",", "")),
        "model": {"name_or_path": spec.get("model", "gemma3-270m")},
        "data": {"path": str(data), "val_size": 8, "clean": {"overlong": "truncate"}},
        "lora": spec.get("lora", {}),
        "train": {"max_steps": steps, "save_strategy": "no", "eval_strategy": "no", "logging_steps": 1,
                  **spec.get("train", {})},
        "eval": {"enabled": False},
    }
    path = work / f"{name.replace(' ', '_').replace(',', '')}.yaml"
    path.write_text(yaml.safe_dump(config), encoding="utf-8")
    subprocess.run([sys.executable, "-m", "gemmaforge", "train", str(path)], check=True, capture_output=True)
    record = json.loads((Path(config["output_dir"]) / "manifest.json").read_text())["stages"]["train"]
    return {"config": name, "measured": record["peak_memory_bytes"], "planned": record["planned_peak_bytes"],
            "device": record["device"], "precision": record["precision"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--work", type=Path)
    parser.add_argument("--only", nargs="*", help="config names (see CONFIGS, or the tiny kinds with --kinds)")
    parser.add_argument("--kinds", action="store_true", help="the tiny multimodal and MoE checkpoints instead")
    args = parser.parse_args()
    work = args.work or Path(tempfile.mkdtemp(prefix="gemmaforge-memory-plan-"))
    work.mkdir(parents=True, exist_ok=True)
    configs = kind_configs(work) if args.kinds else CONFIGS
    unknown = sorted(set(args.only or ()) - set(configs))
    if unknown:
        parser.error(f"unknown config(s) {unknown}; choose from {sorted(configs)}")
    print(f"machine: {platform.processor() or platform.machine()}, python {platform.python_version()}; work: {work}")
    print("| config | precision | planned MiB | measured MiB | error |\n|---|---|---|---|---|")
    worst = 0.0
    for name in args.only or configs:
        row = run_config(name, configs[name], work, args.steps)
        error = row["planned"] / row["measured"] - 1
        worst = max(worst, abs(error))
        print(f"| {name} | {row['precision']} | {row['planned'] / 2**20:,.0f} | {row['measured'] / 2**20:,.0f} | "
              f"{error:+.1%} |", flush=True)
    print(f"\nlargest error {worst:.1%} (target: within 20%)")


if __name__ == "__main__":
    main()
