"""One table per Gemma generation: every fact a stage needs about a family lives here.

Stages never test `model_type` strings themselves; they look the family up once
(`family_for_model_type`) and read its fields.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from gemmaforge.chat.format import ChatFormat
from gemmaforge.chat.gemma import GEMMA_TURNS
from gemmaforge.chat.gemma4 import GEMMA4_FORMAT
from gemmaforge.errors import UserError


@dataclass(frozen=True)
class Family:
    name: str  # our template family id, recorded in manifest.json
    hf_model_types: tuple[str, ...]  # config.model_type values of this family
    gguf_arch: str  # general.architecture in GGUF
    gguf_norm_shift: bool  # GGUF stores RMSNorm weights as w + 1
    chat: ChatFormat  # renders and reads its conversations (gemmaforge/chat/)
    stop: tuple[str, ...]  # stop strings for runtimes (Ollama PARAMETER stop)
    default_lora_targets: tuple[str, ...]
    attn_implementation: str  # what training should ask transformers for
    fp16_safe: bool  # fp16 activations overflow for Gemma 3/4 (NaN loss, empty output)

    def stop_ids(self, eos_id: int, token_id: Callable[[str], int]) -> set[int]:
        """The token ids that end an answer: the tokenizer's end of sequence and the family's stop tokens, each
        looked up with the caller's tokenizer (transformers' for generation_config.json and the transformers
        engine, llama.cpp's for a GGUF)."""
        return {eos_id, *(token_id(stop) for stop in self.stop)}


FAMILIES: dict[str, Family] = {
    f.name: f
    for f in (
        Family(
            name="gemma",
            hf_model_types=("gemma",),
            gguf_arch="gemma",
            gguf_norm_shift=True,
            chat=GEMMA_TURNS,
            stop=("<end_of_turn>", "<start_of_turn>"),
            default_lora_targets=("q_proj", "k_proj", "v_proj", "o_proj"),
            attn_implementation="sdpa",
            fp16_safe=True,
        ),
        Family(
            name="gemma2",
            hf_model_types=("gemma2",),
            gguf_arch="gemma2",
            gguf_norm_shift=True,
            chat=GEMMA_TURNS,
            stop=("<end_of_turn>", "<start_of_turn>"),
            default_lora_targets=("q_proj", "k_proj", "v_proj", "o_proj"),
            attn_implementation="eager",  # SDPA ignores Gemma 2's attention logit soft-capping
            fp16_safe=True,
        ),
        Family(
            name="gemma3",
            hf_model_types=("gemma3_text", "gemma3"),
            gguf_arch="gemma3",
            gguf_norm_shift=True,
            chat=GEMMA_TURNS,
            stop=("<end_of_turn>",),
            default_lora_targets=("q_proj", "k_proj", "v_proj", "o_proj"),
            attn_implementation="sdpa",
            fp16_safe=False,
        ),
        Family(
            name="gemma4",
            # gemma4_unified_text: the text model of Gemma 4 12B Unified, Gemma 4's decoder (llama.cpp converts it as
            # arch "gemma4"; same tokenizer and chat template)
            hf_model_types=("gemma4_text", "gemma4", "gemma4_unified_text", "gemma4_unified"),
            gguf_arch="gemma4",
            gguf_norm_shift=False,
            chat=GEMMA4_FORMAT,
            stop=("<turn|>", "<|tool_response>"),  # a tool call ends with <|tool_response>: the tool answers next
            default_lora_targets=("q_proj", "k_proj", "v_proj", "o_proj"),
            attn_implementation="sdpa",
            fp16_safe=False,
        ),
    )
}


def family_for_model_type(model_type: str) -> Family:
    for family in FAMILIES.values():
        if model_type in family.hf_model_types:
            return family
    known = ", ".join(t for f in FAMILIES.values() for t in f.hf_model_types)
    raise UserError(f"model_type '{model_type}' is not a Gemma text model; expected one of: {known}")
