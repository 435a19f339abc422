"""Shared fixtures: the real Gemma 3 tokenizer and tiny random Gemma 3 models built from it."""

from __future__ import annotations

from pathlib import Path

import pytest

from gemmaforge.models import EMBEDDED_NAME, ResolvedModel, default_home, resolve_model
from tests.tiny_models import build_tiny_gemma3


@pytest.fixture(scope="session")
def llamafactory_data() -> Path:
    """LLaMA-Factory's own demo data folder (data/ with dataset_info.json), read where the project keeps it beside
    this repository (../shared/llamafactory) or at $GEMMAFORGE_LLAMAFACTORY; never copied into the project."""
    import os

    for root in (os.environ.get("GEMMAFORGE_LLAMAFACTORY"), Path(__file__).parents[2] / "shared" / "llamafactory"):
        if root and (Path(root) / "data" / "dataset_info.json").is_file():
            return Path(root) / "data"
    pytest.skip("LLaMA-Factory's demo data is not beside this checkout (set GEMMAFORGE_LLAMAFACTORY)")


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
