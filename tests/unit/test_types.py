"""mypy, with the project's settings (pyproject.toml [tool.mypy]: pydantic's plugin), finds nothing in the package,
and no module is left out of the check."""

from __future__ import annotations

import subprocess
import sys
import tomllib
import uuid
from pathlib import Path

import pytest

from tests.llamafactory_reference import cache_root

ROOT = Path(__file__).parents[2]


@pytest.mark.slow  # 35-50 s on 2 cores with a cold cache, as CI has it
def test_mypy_finds_nothing_in_the_package_and_the_error_it_is_shown(tmp_path: Path) -> None:
    """One run over the package and a probe with one wrong type: exactly the probe's error comes back, so the checker
    is alive and the package is clean."""
    probe = tmp_path / f"probe_{uuid.uuid4().hex}.py"  # a new module each run: mypy's cache maps a name to its path
    probe.write_text('count: int = "three"\n')
    found = subprocess.run([sys.executable, "-m", "mypy", "--cache-dir", str(cache_root() / "mypy"), "gemmaforge",
                            str(probe)], cwd=ROOT, capture_output=True, text=True)
    errors = [line for line in found.stdout.splitlines() if ": error:" in line]
    assert len(errors) == 1 and errors[0].startswith(str(probe)), found.stdout + found.stderr


def test_no_module_is_left_out_of_the_check() -> None:
    """Every module is checked: no override turns errors off or skips a module (the last ones left the list when
    their errors were fixed)."""
    mypy = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["mypy"]
    skipping = [o for o in mypy.get("overrides", []) if o.get("ignore_errors") or o.get("follow_imports") == "skip"]
    assert not skipping and not mypy.get("exclude"), skipping
