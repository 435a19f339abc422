"""`gemmaforge eval`: base vs tuned on the run's val loss, a generation suite and retention probes."""

from __future__ import annotations

import argparse
from pathlib import Path

from gemmaforge import pipeline
from gemmaforge.cli.common import Verbs
from gemmaforge.config import RunConfig, apply_override, validate_config
from gemmaforge.runs import RunDir

EVAL_EPILOG = """suite file (YAML, or JSONL with one case per line):
  cases:
    - prompt: "手冲咖啡的水温应该是多少？"
      system: "你是咖啡师。"            # optional (default: the system prompt the model is deployed with)
      reference: "90到96摄氏度。"        # optional: scored by BLEU and ROUGE-L
      checks: [{starts_with: "咖啡师小贴士"}, {contains: "摄氏度"}, {max_chars: 200}]
checks: starts_with, ends_with, contains, not_contains, regex, json_valid, max_chars, min_chars

writes RUN_DIR/eval/results.json, report.md and report.html (base vs tuned).

examples:
  gemmaforge eval runs/quickstart
  gemmaforge eval runs/quickstart --suite examples/suites/coffee.yaml --fail-under 0.8
  gemmaforge eval runs/quickstart --engine llamacpp max_new_tokens=64   # the exported GGUF itself
  gemmaforge eval runs/quickstart --engine llamacpp gguf=q8_0           # a GGUF other than the first exported
"""


def add(verbs: Verbs) -> None:
    p = verbs.add_parser(
        "eval", help="Evaluate base vs tuned: loss, a generation suite with checks, BLEU/ROUGE-L, retention.",
        description="Evaluate the run's base and tuned models on the same val loss, generation suite (checks, "
        "BLEU/ROUGE-L against references) and knowledge-retention probes.",
        epilog=EVAL_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("run_dir", type=Path)
    p.add_argument("--suite", help="YAML or JSONL suite (default: a sample of the run's val prompts)")
    p.add_argument("--engine", choices=["transformers", "llamacpp"],
                   help="llamacpp: the tuned answers come from the exported GGUF")
    p.add_argument("--fail-under", type=float, metavar="X",
                   help="exit 1 when the tuned suite pass rate is below X (0-1)")
    p.add_argument("overrides", nargs="*", metavar="key=value",
                   help="eval config keys, e.g. max_new_tokens=64 num_samples=32 do_sample=true retention=false")
    p.set_defaults(handler=evaluate)


def evaluate(args: argparse.Namespace, home: Path) -> int:
    run = RunDir.open(args.run_dir)
    config = eval_config_from(run.config(), args)  # refused before anything is loaded or written
    pipeline.stage_eval(run, config, pipeline.base_model(run, config, home))
    return 0


def eval_config_from(config: RunConfig, args: argparse.Namespace) -> RunConfig:
    """The run's config with the eval section changed by the command line (errors name the key)."""
    raw = config.model_dump(mode="json")
    for item in args.overrides:
        apply_override(raw, f"eval.{item}")
    for key in ("suite", "engine", "fail_under"):
        if getattr(args, key) is not None:
            raw["eval"][key] = getattr(args, key)
    return validate_config(raw, source="command line")
