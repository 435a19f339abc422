"""Command line: verbs -> stage functions. Argument parsing and exit codes only, no logic.

Exit codes: 0 success, 1 failure inside a stage, 2 bad input (config, data, arguments).
"""

from __future__ import annotations

import argparse
import sys
import warnings
from pathlib import Path

from gemmaforge import __version__, pipeline
from gemmaforge.config import GGUF_QUANTS, RunConfig, load_config
from gemmaforge.console import console
from gemmaforge.errors import StageError, UserError
from gemmaforge.models import default_home
from gemmaforge.runs import RunDir

EPILOG = """examples:
  gemmaforge run examples/quickstart.yaml                  # data -> train -> merge -> GGUF -> Modelfile
  gemmaforge run my.yaml train.learning_rate=1e-4          # any config key can be overridden
  gemmaforge merge runs/quickstart                         # a stage alone, on an existing run dir
  gemmaforge export gguf runs/quickstart --quant f16
  gemmaforge export ollama runs/quickstart --create
"""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # argparse's own exit code is 2 as well; keep its usage line
        self.print_usage(sys.stderr)
        raise UserError(f"{self.prog}: {message}")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="gemmaforge",
        description="From an instruction dataset to a LoRA-tuned Gemma answering in Ollama.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"gemmaforge {__version__}")
    verbs = parser.add_subparsers(dest="verb", required=True, metavar="VERB", parser_class=_Parser)

    def config_verb(name: str, help_text: str) -> None:
        p = verbs.add_parser(name, help=help_text, description=help_text)
        p.add_argument("config", type=Path, help="YAML config (sections: output_dir, model, data, lora, train, export)")
        p.add_argument("overrides", nargs="*", metavar="key.sub=value", help="override config keys, e.g. train.max_steps=10")

    config_verb("run", "Run the whole pipeline: data, train, merge, export gguf, export ollama.")
    config_verb("train", "Prepare the data and train the LoRA adapter (resumes from the run's last checkpoint).")

    p = verbs.add_parser("merge", help="Merge the run's adapter into the base model (RUN_DIR/merged).")
    p.add_argument("run_dir", type=Path)

    export = verbs.add_parser("export", help="Export a merged run: GGUF files or an Ollama Modelfile.")
    targets = export.add_subparsers(dest="target", required=True, metavar="TARGET", parser_class=_Parser)
    p = targets.add_parser("gguf", help="Write RUN_DIR/gguf/model-<quant>.gguf from RUN_DIR/merged.")
    p.add_argument("run_dir", type=Path)
    p.add_argument("--quant", action="append", choices=GGUF_QUANTS, help="repeatable; default: the config's export.gguf")
    p = targets.add_parser("ollama", help="Write RUN_DIR/ollama/Modelfile pointing at the run's GGUF.")
    p.add_argument("run_dir", type=Path)
    p.add_argument("--create", action="store_true", help="also run `ollama create NAME -f Modelfile`")
    return parser


def main(argv: list[str] | None = None) -> int:
    # transformers warns about its own deprecated API whenever PEFT wraps a model: noise to users.
    warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
    try:
        dispatch(build_parser().parse_args(argv))
    except UserError as exc:
        console.print(f"[red]gemmaforge: error:[/] {exc}")
        return 2
    except StageError as exc:
        console.print(f"[red]gemmaforge: failed:[/] {exc}")
        return 1
    except KeyboardInterrupt:
        console.print("gemmaforge: interrupted")
        return 130
    return 0


def dispatch(args: argparse.Namespace) -> None:
    home = default_home()
    if args.verb == "run":
        run = pipeline.run_all(load_config(args.config, args.overrides), home)
        console.print(f"[green]done[/]: {run.root}")
    elif args.verb == "train":
        config = load_config(args.config, args.overrides)
        run = RunDir.create(config)
        pipeline.stage_data(run, config)
        pipeline.stage_train(run, config, pipeline.base_model(run, config, home))
    else:
        run = RunDir.open(args.run_dir)
        config: RunConfig = run.config()
        base = pipeline.base_model(run, config, home)
        if args.verb == "merge":
            pipeline.stage_merge(run, base)
        elif args.target == "gguf":
            pipeline.stage_export_gguf(run, config, base, args.quant or list(config.export.gguf))
        else:
            pipeline.stage_export_ollama(run, config, base, create=args.create)


if __name__ == "__main__":
    sys.exit(main())
