"""Tiny random Gemma models with the real tokenizer: the builders the fixtures (tests/conftest.py) and the
checkpoint-kind modules share."""

from __future__ import annotations

import shutil
from pathlib import Path

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model")


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
