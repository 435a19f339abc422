"""Command line: one module per stage (data, train, evaluate, export, serve, doctor), each adding its verbs'
parsers and naming each verb's handler (`set_defaults(handler=...)`). Handlers turn arguments into stage calls
and refuse flag combinations that would not apply; the work itself is in the stages.

Exit codes: 0 success, 1 failure inside a stage, 2 bad input (config, data, arguments).
"""

from __future__ import annotations

import argparse
import sys
import warnings

from gemmaforge import __version__
from gemmaforge.cli import configs, data, doctor, evaluate, export, serve, train, ui
from gemmaforge.cli.common import Parser
from gemmaforge.console import console, escape
from gemmaforge.errors import StageError, UserError
from gemmaforge.models import default_home

EPILOG = """examples:
  gemmaforge run examples/quickstart.yaml                  # data -> train -> eval -> merge -> GGUF -> Modelfile
  gemmaforge run my.yaml train.learning_rate=1e-4          # any config key can be overridden
  gemmaforge eval runs/quickstart --suite suite.yaml        # base vs tuned: checks, BLEU/ROUGE-L, retention
  gemmaforge merge runs/quickstart                         # a stage alone, on an existing run dir
  gemmaforge export gguf runs/quickstart --quant f16 --quant q4_k_m
  gemmaforge export verify runs/quickstart                 # every GGUF against the merged model
  gemmaforge export ollama runs/quickstart --create
  gemmaforge serve runs/quickstart                         # Ollama + OpenAI APIs on 127.0.0.1:11434
  gemmaforge chat runs/quickstart                          # talk to it in the terminal
  gemmaforge ui                                            # web dashboard over runs/ (pip install 'gemmaforge[ui]')
  gemmaforge doctor                                        # can this machine train? (ROCm, CUDA, CPU)
  gemmaforge plan examples/quickstart.yaml --gpu-memory 24GiB   # will it fit?
  gemmaforge run llamafactory_lora_sft.yaml                # an LLaMA-Factory SFT config, translated
  gemmaforge config convert llamafactory_lora_sft.yaml     # ... shown in gemmaforge's terms
"""
# in the order `gemmaforge --help` lists their verbs
VERB_MODULES = (train, data, evaluate, serve, ui, doctor, export, configs)


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(
        prog="gemmaforge",
        description="From an instruction dataset to a LoRA-tuned Gemma answering in Ollama.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"gemmaforge {__version__}")
    verbs = parser.add_subparsers(dest="verb", required=True, metavar="VERB", parser_class=Parser)
    for module in VERB_MODULES:
        module.add(verbs)
    return parser


def main(argv: list[str] | None = None) -> int:
    # transformers warns about its own deprecated API whenever PEFT wraps a model: noise to users.
    warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
    try:
        args = parse_args(build_parser(), argv)
        return args.handler(args, default_home())
    except UserError as exc:
        console.print(f"[red]gemmaforge: error:[/] {escape(str(exc))}")
        return 2
    except StageError as exc:
        console.print(f"[red]gemmaforge: failed:[/] {escape(str(exc))}")
        return 1
    except KeyboardInterrupt:
        console.print("gemmaforge: interrupted")
        return 130


def parse_args(parser: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    """argparse stops filling a `key=value ...` positional at the first option; collect overrides that
    come after options too, so `data prepare IN -o OUT clean.dedup=near` works as written."""
    args, extras = parser.parse_known_args(argv)
    if extras and hasattr(args, "overrides") and all("=" in x and not x.startswith("-") for x in extras):
        args.overrides = [*args.overrides, *extras]
    elif extras:
        parser.error(f"unrecognized arguments: {' '.join(extras)}")
    return args


if __name__ == "__main__":
    sys.exit(main())
