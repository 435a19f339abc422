"""Tiny random text-only Gemma 1, 2 and 4 checkpoints (Gemma 3's is tests/tiny_models.py's build_tiny_gemma3), with
the structure of their families: Gemma 2's attention and final soft-capping and alternating sliding window,
Gemma 4's per-layer inputs, KV shared by the last layers and wider heads in full-attention layers."""

from __future__ import annotations

from pathlib import Path

import torch

from tests.tiny_models import save_tiny


def build_tiny_text(family: str, target: Path, tokenizer_dir: Path) -> Path:
    """A small random Gemma 1, 2 or 4 with the real (Gemma 3) tokenizer and non-trivial norms (a missing or
    wrong +1 shift would show); Gemma 2's query_pre_attn_scalar equals head_dim, which is what llama.cpp
    assumes below 27B."""
    from transformers import (
        Gemma2Config,
        Gemma2ForCausalLM,
        Gemma4ForCausalLM,
        Gemma4TextConfig,
        GemmaConfig,
        GemmaForCausalLM,
    )

    torch.manual_seed(0)
    sizes = dict(vocab_size=262144, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=1, head_dim=16, max_position_embeddings=512,
                 pad_token_id=0, bos_token_id=2, eos_token_id=1)
    if family == "gemma4":  # per-layer inputs, KV shared by the last layers, wider heads in full layers
        model = Gemma4ForCausalLM(Gemma4TextConfig(
            **{**sizes, "num_hidden_layers": 4}, global_head_dim=32, sliding_window=32,
            vocab_size_per_layer_input=262144, hidden_size_per_layer_input=16, num_kv_shared_layers=2,
            layer_types=["sliding_attention", "full_attention"] * 2,
            final_logit_softcapping=30.0))  # every Gemma 4 config.json (tests/checkpoint_kinds.py); None by default
    elif family == "gemma2":
        config = Gemma2Config(**sizes, query_pre_attn_scalar=16, sliding_window=64, attn_logit_softcapping=50.0,
                              final_logit_softcapping=30.0)
        model = Gemma2ForCausalLM(config)
    else:
        model = GemmaForCausalLM(GemmaConfig(**sizes))
    return save_tiny(model, target, tokenizer_dir)
