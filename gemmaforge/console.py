"""The one console all stages print progress to (stderr, so stdout stays clean for data)."""

from rich.console import Console

# soft_wrap: messages name file paths; hard wrapping at the terminal width would split them.
console = Console(stderr=True, soft_wrap=True, highlight=False)
