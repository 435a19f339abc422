"""Shared fixtures: the real Gemma 3 tokenizer and tiny random Gemma 3 models built from it."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from gemmaforge.models import EMBEDDED_NAME, ResolvedModel, default_home, resolve_model
from tests.tiny_models import build_tiny_gemma3

# Several test workers share the machine's cores: one compute thread each (and in the processes they start), or
# their thread pools oversubscribe the cores and spin against each other (measured on 2 cores, 2 workers: 17%
# less wall time for the training tests).
if os.environ.get("PYTEST_XDIST_WORKER") and int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")) > 1:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch

    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))

# glibc hands large freed blocks straight back to the kernel (mmap above 128 KiB-32 MiB, heap trimming above
# 128 KiB), so every training step of every test faults its tensors' pages in afresh, zeroed by the kernel. Keeping
# freed memory in the heap of the processes the suite starts (workers, the CLI and servers they run; glibc reads
# these at process start) measured 10.3 s -> 2.3 s kernel time and 31 s -> 26 s wall for two training-step tests, and
# 205 s -> 170 s for test_memory_plan.py with test_loss_families.py (2 cores, one process).
os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", str(4 * 2**30))
os.environ.setdefault("MALLOC_TRIM_THRESHOLD_", str(64 * 2**30))

# Set by .ci/run: there a skipped test is a failure (a missing install step or reference would otherwise pass
# silently), unless the test is marked never_in_ci with the reason it can never run on CI's machine.
STRICT = "GEMMAFORGE_REQUIRE_REFERENCES"


def _skip_is_failure(report: pytest.TestReport | pytest.CollectReport, item: pytest.Item | None) -> bool:
    if not (os.environ.get(STRICT) and report.skipped) or hasattr(report, "wasxfail"):
        return False
    return item is None or item.get_closest_marker("never_in_ci") is None


def _as_failure(report: pytest.TestReport | pytest.CollectReport) -> None:
    reason = report.longrepr[-1] if isinstance(report.longrepr, tuple) else report.longrepr
    report.outcome = "failed"
    report.longrepr = (f"skipped in CI: {reason}\nCI runs every test ({STRICT} is set); a test that can never run "
                       "there says why with @pytest.mark.never_in_ci(reason)")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    outcome = yield
    report = outcome.get_result()
    if _skip_is_failure(report, item):
        _as_failure(report)
    elif too_slow := _too_slow_for_the_fast_tier(item, call, report):
        report.outcome = "failed"
        report.longrepr = too_slow


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector: pytest.Collector):
    outcome = yield
    report = outcome.get_result()
    if _skip_is_failure(report, None):  # a module-level importorskip
        _as_failure(report)


# The fast tier (`-m "not slow"`) must stay a few minutes on 2 cores. A test is in the slow tier when it is marked
# `slow` or when it uses a real component end to end (marker `integration`, or a file under tests/integration). In CI
# a test outside it fails when its call and function fixtures take longer than `fast_test_limit` seconds, or when a
# module or class fixture it uses took longer than twice that to set up (paid once for its tests, by whichever runs
# first: a fast test would pay it in the fast tier), so a slow test cannot land unmarked. Session fixtures (the tiny
# checkpoints, the fetched references) are paid once per worker: not counted.
MARKERS = ("integration: uses a real component (llama.cpp) or the embedded model end to end (slow too)",
           'slow: left out of the fast tier, `python -m pytest -m "not slow"`',
           "never_in_ci(reason): cannot run on CI's machine (a GPU, an ollama binary): the only skip CI accepts")


def pytest_configure(config: pytest.Config) -> None:
    for marker in MARKERS:
        config.addinivalue_line("markers", marker)


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addini("fast_test_limit", "seconds a test outside the slow tier may take in CI (tests/conftest.py)",
                  default="15")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if item.get_closest_marker("integration") or item.path.parent.name == "integration":
            item.add_marker(pytest.mark.slow)
    # Files with slow tests first, in their order, then the rest: the workers (a file each) then end on files of
    # short tests, which fill the gaps, instead of one worker running a long file alone at the end.
    slow_files = {item.path for item in items if item.get_closest_marker("slow")}
    items.sort(key=lambda item: item.path not in slow_files)


_fixture_seconds: dict[object, float] = {}


@pytest.hookimpl(hookwrapper=True)
def pytest_fixture_setup(fixturedef: pytest.FixtureDef, request: pytest.FixtureRequest):
    start = time.perf_counter()
    yield
    if fixturedef.scope != "session":  # a fixture's dependencies are set up before this hook: its own time only
        _fixture_seconds[fixturedef] = max(_fixture_seconds.get(fixturedef, 0.0), time.perf_counter() - start)


def _too_slow_for_the_fast_tier(item: pytest.Item, call: pytest.CallInfo, report: pytest.TestReport) -> str | None:
    if not (os.environ.get(STRICT) and call.when == "call" and report.passed) or item.get_closest_marker("slow"):
        return None
    limit = float(item.config.getini("fast_test_limit"))
    used = [defs[-1] for defs in item._fixtureinfo.name2fixturedefs.values() if defs]  # type: ignore[attr-defined]
    own = call.duration + sum(_fixture_seconds.get(d, 0.0) for d in used if d.scope == "function")
    shared = {d.argname: _fixture_seconds.get(d, 0.0) for d in used if d.scope in ("module", "class", "package")}
    slowest = max(shared, key=shared.__getitem__, default=None)
    if own > limit:
        why = f"its call and function fixtures took {own:.1f} s, over fast_test_limit ({limit:g} s)"
    elif slowest and shared[slowest] > 2 * limit:
        why = f"its {slowest} fixture took {shared[slowest]:.1f} s to set up, over twice fast_test_limit ({limit:g} s)"
    else:
        return None
    return f"{item.nodeid}: {why}; mark it @pytest.mark.slow so `python -m pytest -m \"not slow\"` stays fast"


@pytest.fixture(scope="session")
def llamafactory_data() -> Path:
    """LLaMA-Factory's own demo data folder (data/ with dataset_info.json), from its sdist on PyPI (fetched once and
    cached, tests/llamafactory_reference.py); its examples/ and src/llamafactory/hparams/ lie beside it."""
    from tests.llamafactory_reference import fetch_llamafactory

    return fetch_llamafactory() / "data"


@pytest.fixture(scope="session")
def embedded_model() -> ResolvedModel:
    """The real embedded Gemma 3 270M (converted once into the gemmaforge cache)."""
    return resolve_model(EMBEDDED_NAME, default_home())


@pytest.fixture(scope="session")
def gemma3_tokenizer(embedded_model: ResolvedModel):
    from gemmaforge.models import load_tokenizer

    return load_tokenizer(embedded_model.path)


@pytest.fixture(scope="session")
def gemma4_tokenizer(tmp_path_factory: pytest.TempPathFactory, embedded_model: ResolvedModel):
    """Gemma 4's tokenizer: Gemma 3's vocabulary with Gemma 4's special tokens in place (tests/checkpoint_kinds.py)."""
    from gemmaforge.models import load_tokenizer
    from tests.checkpoint_kinds import write_gemma4_tokenizer

    return load_tokenizer(write_gemma4_tokenizer(tmp_path_factory.mktemp("gemma4-tokenizer"), embedded_model.path))


@pytest.fixture(scope="session")
def tiny_gemma3_dir(tmp_path_factory: pytest.TempPathFactory, embedded_model: ResolvedModel) -> Path:
    return build_tiny_gemma3(tmp_path_factory.mktemp("tiny-gemma3"), embedded_model.path)


@pytest.fixture(scope="session")
def text_checkpoint_of(tmp_path_factory: pytest.TempPathFactory, embedded_model: ResolvedModel, tiny_gemma3_dir: Path):
    """family ("gemma", "gemma2", "gemma3", "gemma4") -> a tiny text-only checkpoint of it, built once a session."""
    from tests.text_families import build_tiny_text

    built: dict[str, Path] = {"gemma3": tiny_gemma3_dir}

    def build(family: str) -> Path:
        if family not in built:
            built[family] = build_tiny_text(family, tmp_path_factory.mktemp(f"tiny-{family}"), embedded_model.path)
        return built[family]

    return build


@pytest.fixture(scope="session")
def checkpoint_of(tmp_path_factory: pytest.TempPathFactory, embedded_model: ResolvedModel):
    """kind -> the tiny checkpoint of that real checkpoint kind (tests/checkpoint_kinds.py), built once a session."""
    from tests.checkpoint_kinds import build_checkpoint

    built: dict[str, Path] = {}

    def build(kind: str) -> Path:
        if kind not in built:
            built[kind] = build_checkpoint(kind, tmp_path_factory.mktemp(kind), embedded_model.path)
        return built[kind]

    return build


@pytest.fixture(scope="session")
def text_gguf_of(checkpoint_of, tmp_path_factory: pytest.TempPathFactory):
    """kind -> our f16 text GGUF of that kind's tiny checkpoint, written once a session (a Gemma 4 one takes
    seconds: its 262k-token vocabulary with merges)."""
    from gemmaforge.export.gguf import write_gguf

    written: dict[str, Path] = {}

    def write(kind: str) -> Path:
        if kind not in written:
            folder = tmp_path_factory.mktemp(f"{kind}-gguf")
            written[kind] = write_gguf(checkpoint_of(kind), folder / f"{checkpoint_of(kind).name}-f16.gguf", "f16")
        return written[kind]

    return write


@pytest.fixture(scope="session")
def mmproj_of(checkpoint_of, tmp_path_factory: pytest.TempPathFactory):
    """kind -> our mmproj-f16.gguf of that kind's tiny checkpoint, written once a session."""
    from gemmaforge.export.gguf_mmproj import write_mmproj

    out = tmp_path_factory.mktemp("mmproj")
    written: dict[str, Path] = {}

    def write(kind: str) -> Path:
        if kind not in written:
            written[kind] = write_mmproj(checkpoint_of(kind), out / f"{kind}-mmproj-f16.gguf")
        return written[kind]

    return write
