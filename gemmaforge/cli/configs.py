"""`gemmaforge config convert`: an LLaMA-Factory training config in gemmaforge's terms, without running it."""

from __future__ import annotations

import argparse
from pathlib import Path

from gemmaforge.cli.common import Parser, Verbs
from gemmaforge.config import dump_config, read_config
from gemmaforge.console import console
from gemmaforge.runs import atomic_write_text

CONVERT_EPILOG = """LLaMA-Factory's own keys are translated as docs/llamafactory.md's table says:
`gemmaforge train|run LF.yaml` reads the same file the same way (and writes the result as RUN_DIR/run.yaml).
Keys that only tune LLaMA-Factory's machinery are listed as ignored, with the reason; keys that change what is
trained and have no equivalent exit 2.

examples:
  gemmaforge config convert lf_lora_sft.yaml
  gemmaforge config convert my_lf.yaml -o gemmaforge.yaml && gemmaforge run gemmaforge.yaml
"""


def add(verbs: Verbs) -> None:
    config = verbs.add_parser("config", help="Convert an LLaMA-Factory training config to a gemmaforge config.")
    actions = config.add_subparsers(dest="action", required=True, metavar="ACTION", parser_class=Parser)
    p = actions.add_parser(
        "convert", help="Print an LLaMA-Factory training YAML (flat or lora_config/training_args) as gemmaforge's.",
        description="Print an LLaMA-Factory SFT config (its flat keys, or the lora_config:/training_args: blocks) "
        "as a gemmaforge config: what each key became, what was ignored and why, then every section with its "
        "defaults written out. A gemmaforge config is printed the same way, its defaults filled in.",
        epilog=CONVERT_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("config", type=Path)
    p.add_argument("-o", "--output", type=Path, metavar="FILE", help="write it to FILE instead of printing it")
    p.set_defaults(handler=convert)


def convert(args: argparse.Namespace, home: Path) -> int:
    config, translation = read_config(args.config)
    text = (translation.report() if translation else "") + dump_config(config)
    if args.output is None:
        print(text, end="")
    else:
        atomic_write_text(args.output, text)
        console.print(f"[bold]config[/]: wrote {args.output}")
    return 0
