"""Error types the CLI maps to exit codes: UserError -> 2 (bad input), StageError -> 1."""

from __future__ import annotations


class UserError(Exception):
    """Bad input from the user (config, data, arguments). The message names what and where."""


class StageError(Exception):
    """A stage failed for a reason that is not the user's input."""
