"""ruff, with the project's settings (pyproject.toml [tool.ruff]), finds nothing in the package, tests or benchmarks."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).parents[2]


def test_ruff_finds_nothing() -> None:
    found = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", "gemmaforge", "tests", "benchmarks"],
                           cwd=ROOT, capture_output=True, text=True)
    assert found.returncode == 0, found.stdout + found.stderr
