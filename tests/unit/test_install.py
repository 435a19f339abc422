"""The Quickstart's install line says what CI installs: the Python floor, the pinned CPU torch, the open torch
requirement that lets ROCm and CUDA users keep their own build."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).parents[2]


def test_the_quickstart_pins_the_torch_that_ci_installs_and_the_package_leaves_torch_open() -> None:
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    quickstart = readme.split("## Quickstart")[1].split("\n## ")[0]
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    pinned = re.search(r"pip install torch==([\d.]+) -e \.", quickstart).group(1)
    assert f"pip install -q --no-compile torch=={pinned}\n" in ci
    assert f"pinned torch {pinned}" in quickstart

    project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    (torch,) = [r for r in project["dependencies"] if re.match(r"torch\b", r)]
    assert torch == "torch>=2.4" and "torch ≥ 2.4" in quickstart  # no upper bound, no exact pin
    assert project["requires-python"] == ">=3.11" and "Python 3.11 or later" in quickstart
