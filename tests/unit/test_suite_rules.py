"""The suite's own rules, run on a probe file through tests/conftest.py: in CI (GEMMAFORGE_REQUIRE_REFERENCES set) a
skip is a failure unless the test is marked never_in_ci with its reason; elsewhere a skip stays a skip."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).parents[2]
PROBE = '''
import pytest


def test_skipped():
    pytest.skip("a missing install step")


@pytest.mark.never_in_ci("needs a GPU")
def test_gpu_only():
    pytest.skip("no GPU here")


def test_runs():
    assert True
'''


MODULE_PROBE = 'import pytest\n\npytest.importorskip("a_module_that_is_not_installed")\n\n\ndef test_x():\n    pass\n'


def run_probe(tmp_path: Path, source: str, strict: bool, limit: float = 10) -> str:
    """pytest's closing line for a probe file run through tests/conftest.py."""
    folder = tmp_path / ("strict" if strict else "plain")
    folder.mkdir(exist_ok=True)
    (folder / "test_probe.py").write_text(source)
    env = {k: v for k, v in os.environ.items() if k != "GEMMAFORGE_REQUIRE_REFERENCES"}
    if strict:
        env["GEMMAFORGE_REQUIRE_REFERENCES"] = "1"
    options = ["-o", "addopts=--strict-markers", "-o", f"fast_test_limit={limit}", "--rootdir", str(folder)]
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "tests.conftest", "-p", "no:cacheprovider",
                           *options, str(folder)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    return proc.stdout.strip().splitlines()[-1]


def test_in_ci_a_skip_fails_unless_the_test_says_it_can_never_run_there(tmp_path: Path) -> None:
    assert run_probe(tmp_path, PROBE, strict=True).startswith("1 failed, 1 passed, 1 skipped")
    assert run_probe(tmp_path, PROBE, strict=False).startswith("1 passed, 2 skipped")


def test_in_ci_a_module_skipped_at_import_fails(tmp_path: Path) -> None:
    assert "1 error" in run_probe(tmp_path, MODULE_PROBE, strict=True)
    assert run_probe(tmp_path, MODULE_PROBE, strict=False).startswith("1 skipped")


TIMED_PROBE = '''
import time

import pytest


@pytest.fixture(scope="module")
def built():
    time.sleep(1.0)


@pytest.fixture
def made():
    time.sleep(0.3)


def test_quick(made):
    pass


def test_slow_call(made):
    time.sleep(0.3)


@pytest.mark.slow
def test_marked(built):
    pass


def test_slow_module_fixture(built):
    pass
'''


def test_in_ci_a_slow_test_outside_the_slow_tier_fails(tmp_path: Path) -> None:
    # With a 0.4 s limit: a call and function fixture over it, or a module fixture over twice it, fail a test not
    # marked slow (the module fixture counts even where a marked test set it up first, as the fast tier pays it).
    assert run_probe(tmp_path, TIMED_PROBE, strict=True, limit=0.4).startswith("2 failed, 2 passed")
    assert run_probe(tmp_path, TIMED_PROBE, strict=False, limit=0.4).startswith("4 passed")
