"""`gemmaforge run` (the whole pipeline), `train` (data and training) and `plan` (the memory the training takes)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from gemmaforge import pipeline
from gemmaforge.cli.common import Verbs
from gemmaforge.config import RunConfig, load_config
from gemmaforge.console import console
from gemmaforge.distributed import init_if_launched
from gemmaforge.runs import RunDir
from gemmaforge.train.memory_plan import NO_MEDIA, MediaLoad
from gemmaforge.train.sharding import STRATEGIES, check_strategy, planned_as

PLAN_EPILOG = """The plan counts weights, trainable parameters with AdamW's state, the activations autograd keeps
(traced on a probe with two layers of each kind at the real width), the backward pass, the loss's logits and the
runtime, for full rows of cutoff_len tokens; `gemmaforge train` makes the same plan first and refuses a
config that cannot fit (train.check_memory=false trains anyway).

examples:
  gemmaforge plan examples/quickstart.yaml
  gemmaforge plan my.yaml --gpu-memory 24GiB                # for an RX 7900 XTX, from any machine
  gemmaforge plan my.yaml train.per_device_train_batch_size=16 train.gradient_checkpointing=true --json
  gemmaforge plan gemma3-27b.yaml --gpu-memory 24GiB --nproc 4 --strategy fsdp2   # one of 4 x RX 7900 XTX

With --nproc N each rank's peak is planned (its own batch of per_device_train_batch_size rows; weights and
trainable state as the strategy shares them), and the last line names, for each strategy, the fewest ranks
of this device (1, 2, 4 or 8) that fit.
"""


def add(verbs: Verbs) -> None:
    for name, help_text, handler in (
        ("run", "Run the whole pipeline: data, train, eval, merge, export gguf, export ollama.", run_pipeline),
        ("train", "Prepare the data and train the LoRA adapter (resumes from the run's last checkpoint).", train),
    ):
        p = verbs.add_parser(name, help=help_text, description=help_text)
        p.add_argument("config", type=Path,
                       help="YAML config (sections: output_dir, model, data, lora, train, eval, export)")
        p.add_argument("overrides", nargs="*", metavar="key.sub=value",
                       help="override config keys, e.g. train.max_steps=10")
        p.set_defaults(handler=handler)

    p = verbs.add_parser(
        "plan", help="Predict a config's peak training memory, the largest batch and cutoff that fit, and fixes.",
        description="Predict the peak memory of training CONFIG on this device (or on a GPU of --gpu-memory), "
        "part by part, with the largest batch and cutoff_len that fit and what to change when it does not fit.",
        epilog=PLAN_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("config", type=Path)
    p.add_argument("overrides", nargs="*", metavar="key.sub=value")
    p.add_argument("--gpu-memory", metavar="SIZE", help="plan for a GPU with this much memory (24GiB, 16G, 80GB)")
    p.add_argument("--nproc", type=int, default=1, metavar="N",
                   help="plan one rank of N processes (GPUs) training together (default 1)")
    p.add_argument("--strategy", choices=STRATEGIES, default=None,
                   help="how the N ranks share the model: ddp (replicated), zero2 (gradients and AdamW states "
                   "sharded), fsdp2 or zero3 (weights too); default: the launcher's when launched, else ddp")
    p.add_argument("--json", action="store_true", help="the plan as JSON")
    p.set_defaults(handler=plan)


def run_pipeline(args: argparse.Namespace, home: Path) -> int:
    run = pipeline.run_all(load_config(args.config, args.overrides), home)
    console.print(f"[green]done[/]: {run.root}")
    return 0


def train(args: argparse.Namespace, home: Path) -> int:
    init_if_launched()
    config = load_config(args.config, args.overrides)
    run = RunDir.create(config)
    base = pipeline.base_model(run, config, home)
    pipeline.stage_data(run, config, base)
    pipeline.stage_train(run, config, base)
    return 0


def media_per_example(config: RunConfig) -> MediaLoad:
    """The most pictures, and the most audio tokens, one conversation of the run's prepared data holds (none before
    the data stage ran)."""
    stats = Path(config.output_dir) / "data" / "stats.json"
    if not stats.is_file():
        return NO_MEDIA
    found = json.loads(stats.read_text(encoding="utf-8"))
    return MediaLoad(int(found.get("images", {}).get("most_in_one", 0)),
                     int(found.get("audios", {}).get("most_tokens_in_one", 0)))


def plan(args: argparse.Namespace, home: Path) -> int:
    """Print the plan; exit 1 when it does not fit."""
    from gemmaforge.models import resolve_model
    from gemmaforge.train.memory_plan import plan_config, plan_json, plan_summary
    from gemmaforge.units import parse_binary_size

    config = load_config(args.config, args.overrides)
    gpu_memory = parse_binary_size(args.gpu_memory) if args.gpu_memory is not None else None
    strategy = args.strategy or planned_as(check_strategy())
    planned = plan_config(config, resolve_model(config.model.name_or_path, home, config.model.revision), gpu_memory,
                          args.nproc, strategy, media_per_example(config))
    print(plan_json(planned) if args.json else plan_summary(planned))
    return 0 if planned.fits else 1
