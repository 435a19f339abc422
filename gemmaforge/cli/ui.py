"""`gemmaforge ui`: the web dashboard over a folder of runs (gemmaforge/ui/)."""

from __future__ import annotations

import argparse
from pathlib import Path

from gemmaforge.cli.common import Verbs
from gemmaforge.errors import UserError

UI_EPILOG = """The page lists every run under RUNS_DIR (live while they train, whoever started them), draws their
curves together, shows each run's stages, files, export verification and eval report, and starts, stops and
resumes runs, each in its own `gemmaforge run` process. Needs the ui extra: pip install 'gemmaforge[ui]'.

examples:
  gemmaforge ui                                  # runs/ on http://127.0.0.1:7860/
  gemmaforge ui ~/experiments --port 8080
  gemmaforge ui --host 0.0.0.0 --api-key "$KEY"  # the page asks for the key
"""


def add(verbs: Verbs) -> None:
    p = verbs.add_parser(
        "ui", help="Web dashboard: watch, compare, start and stop runs, read their reports.",
        description="Start the web dashboard on RUNS_DIR and print its address.",
        epilog=UI_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("runs_dir", nargs="?", type=Path, default=Path("runs"), metavar="RUNS_DIR",
                   help="a folder of run directories, or one run directory (default: runs)")
    p.add_argument("--host", default="127.0.0.1", help="default 127.0.0.1 (loopback); any other needs --api-key")
    p.add_argument("--port", type=int, default=7860, help="default 7860")
    p.add_argument("--api-key", help="the password the page asks for (default: $GEMMAFORGE_API_KEY)")
    p.add_argument("--config", default="examples/quickstart.yaml",
                   help="the config the Launch tab offers first (default: examples/quickstart.yaml)")
    p.set_defaults(handler=ui)


def ui(args: argparse.Namespace, home: Path) -> int:
    from gemmaforge.serve.server import api_key_from_env, is_loopback

    api_key = api_key_from_env(args.api_key)
    if not is_loopback(args.host) and not api_key:
        raise UserError(f"--host {args.host} exposes the dashboard, which starts and stops runs, beyond this "
                        "machine: give --api-key KEY (or GEMMAFORGE_API_KEY); the page then asks for it")
    if args.runs_dir.exists() and not args.runs_dir.is_dir():
        raise UserError(f"{args.runs_dir}: not a folder (RUNS_DIR is a folder of runs or one run directory)")
    try:
        from gemmaforge.ui.app import run_server
        from gemmaforge.ui.dashboard import Dashboard
    except ModuleNotFoundError as exc:
        raise UserError(f"gemmaforge ui needs {exc.name}: pip install 'gemmaforge[ui]'") from None
    args.runs_dir.mkdir(parents=True, exist_ok=True)
    run_server(Dashboard(args.runs_dir, home), args.host, args.port, api_key, args.config)
    return 0
