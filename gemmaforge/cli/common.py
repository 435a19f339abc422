"""What every verb module shares: the parser that turns argparse errors into exit 2, argument types, and the
handler signature each verb registers with `set_defaults(handler=...)`."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path
from typing import NoReturn

from gemmaforge.errors import UserError

# (parsed arguments, gemmaforge home) -> exit code
Handler = Callable[[argparse.Namespace, Path], int]
Verbs = argparse._SubParsersAction


class Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:  # argparse's own exit code is 2 as well; keep its usage line
        self.print_usage(sys.stderr)
        raise UserError(f"{self.prog}: {message}")


def positive_int(text: str) -> int:
    if not text.isdigit() or int(text) == 0:
        raise argparse.ArgumentTypeError(f"expected a positive whole number, got {text!r}")
    return int(text)


def refuse_unless(applies: bool, flags: dict[str, object], why: str) -> None:
    """Exit 2 when flags were given (neither None nor False) that do not apply in this combination, instead of
    ignoring them; `why` names them where it says {flags}."""
    given = [flag for flag, value in flags.items() if value is not None and value is not False]
    if given and not applies:
        raise UserError(why.format(flags=", ".join(given)))
