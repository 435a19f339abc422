"""The one console all stages print progress to (stderr, so stdout stays clean for data)."""

from rich.console import Console
from rich.markup import escape

__all__ = ["console", "escape"]

# soft_wrap: messages name file paths; hard wrapping at the terminal width would split them.
console = Console(stderr=True, soft_wrap=True, highlight=False)
# Text from outside (exceptions, tool output, user data) goes through escape(): rich reads '[enforce fail ...]' or
# 'x[server]' as markup and drops it.
