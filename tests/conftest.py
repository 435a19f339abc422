"""Shared fixtures: the real Gemma 3 tokenizer and tiny random Gemma 3 models built from it."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from gemmaforge.models import EMBEDDED_NAME, ResolvedModel, default_home, resolve_model

FIXTURES = Path(__file__).parent / "fixtures"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model")


@pytest.fixture(scope="session")
def embedded_model() -> ResolvedModel:
    """The real embedded Gemma 3 270M (converted once into the gemmaforge cache)."""
    return resolve_model(EMBEDDED_NAME, default_home())


@pytest.fixture(scope="session")
def gemma3_tokenizer(embedded_model: ResolvedModel):
    from gemmaforge.models import load_tokenizer

    return load_tokenizer(embedded_model.path)


def build_tiny_gemma3(target: Path, tokenizer_dir: Path, seed: int = 0) -> Path:
    """A 2-layer random Gemma3ForCausalLM with the real 262k tokenizer. query_pre_attn_scalar equals
    head_dim, as in real checkpoints, so llama.cpp (which ignores it) computes the same attention."""
    import torch
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    torch.manual_seed(seed)
    config = Gemma3TextConfig(
        vocab_size=262144,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=16,
        query_pre_attn_scalar=16,
        sliding_window=64,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        pad_token_id=0,
        bos_token_id=2,
        eos_token_id=1,
    )
    return save_tiny(Gemma3ForCausalLM(config), target, tokenizer_dir)


def save_tiny(model, target: Path, tokenizer_dir: Path) -> Path:
    """Save a tiny random model with random norm weights (so a missing or wrong +1 shift in GGUF cannot go
    unnoticed) and the real tokenizer beside it."""
    import torch

    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.uniform_(-0.5, 0.5)
    model.save_pretrained(target)
    for name in TOKENIZER_FILES:
        if (tokenizer_dir / name).is_file():
            shutil.copy(tokenizer_dir / name, target / name)
    return target


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
