"""Structured output on the transformers engine: llguidance holds each answer to Params.grammar ("json", any
JSON object; or a JSON schema) by masking, before each token is chosen, every token that would break it.

llguidance was chosen by benchmarks/structured_output_overhead.py (Gemma's 262,144-token vocabulary, 2 CPU
cores): 0.21 ms a token as applied here (its mask, unpacked onto the logits), 0.46 ms at worst; xgrammar
0.04-0.05 ms (1 ms at worst); outlines-core about 4 ms and 1-24 s to compile a schema. A decoding step of the
270M model takes 60-90 ms there, so either of the first two costs under 0.4%. llguidance has no
dependencies, where xgrammar requires torch, transformers and triton of its own choosing (a user's ROCm or
CUDA torch must stay theirs). Its one cost is its tokenizer tables, made once per engine on the first
structured request (about 4-5 s for Gemma's vocabulary).
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from typing import Any

import torch

# Between JSON tokens, what llama.cpp's JSON grammar allows (its `ws` rule): one space, or a newline and an
# indent of at most 20. Bounded, so that a model can never pad an answer with whitespace until its limit.
WHITESPACE = r"(?:[ ]|\n[ \t]{0,20})?"
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SUBSCHEMAS = ("items", "prefixItems", "additionalItems", "contains", "additionalProperties", "propertyNames",
               "unevaluatedProperties", "anyOf", "oneOf", "allOf", "not", "if", "then", "else")
_KEPT = 64  # compiled grammars kept per engine (requests usually repeat a handful of schemas)
_BITS = 1 << torch.arange(32, dtype=torch.int64)


def closed(schema: Any) -> Any:
    """`schema` as llama.cpp's converter reads it, and so Ollama: an object schema that lists its properties
    takes no others unless `additionalProperties` says so (a pydantic model's schema does not say)."""
    if isinstance(schema, list):
        return [closed(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {key: ({name: closed(s) for name, s in value.items()} if key in _SCHEMA_MAPS and isinstance(value, dict)
                 else closed(value) if key in _SUBSCHEMAS else value)
           for key, value in schema.items()}
    if isinstance(out.get("properties"), dict) and "additionalProperties" not in out:
        out["additionalProperties"] = False
    return out


class Matcher:
    """One answer's place in its grammar."""

    def __init__(self, matcher: Any, vocab: int):
        self._matcher = matcher
        self._bitmask = torch.zeros((vocab + 31) // 32, dtype=torch.int32)

    def mask(self, logits: torch.Tensor) -> None:
        """Set the logits (one row, float) of every token the grammar does not allow next to -inf."""
        self._matcher.unsafe_compute_mask_ptr(self._bitmask.data_ptr(), self._bitmask.numel() * 4)
        if self._matcher.is_error():
            raise RuntimeError(f"structured output: {self._matcher.get_error()}")
        allowed = (self._bitmask.to(torch.int64).unsqueeze(1) & _BITS).ne(0).flatten()
        n = min(logits.shape[-1], allowed.numel())
        logits[:n].masked_fill_(~allowed[:n], float("-inf"))
        logits[n:] = float("-inf")  # rows past the tokenizer's vocabulary (padding of the embedding matrix)

    def advance(self, token: int) -> None:
        if not self._matcher.consume_token(token):
            raise RuntimeError(f"structured output: {self._matcher.get_error()}")


class Grammars:
    """Grammars compiled for one tokenizer; `stop_ids` end an answer once its value is complete."""

    def __init__(self, tokenizer: Any, stop_ids: list[int]):
        self._tokenizer, self._stop_ids = tokenizer, stop_ids
        self._lltokenizer: Any = None
        self._compiled: OrderedDict[str, str] = OrderedDict()
        self._lock = threading.Lock()

    def compile(self, spec: str) -> str:
        """llguidance's grammar for `spec`, cached; ValueError with the reason when it cannot be compiled.
        Blocking (the first call makes the tokenizer tables): call it off the event loop."""
        import llguidance
        import llguidance.hf

        with self._lock:
            if spec in self._compiled:
                self._compiled.move_to_end(spec)
                return self._compiled[spec]
            if self._lltokenizer is None:
                self._lltokenizer = llguidance.hf.from_tokenizer(self._tokenizer, eos_token=self._stop_ids)
        schema = {"type": "object"} if spec == "json" else closed(json.loads(spec))
        try:
            grammar = llguidance.LLMatcher.grammar_from_json_schema(schema, defaults={"whitespace_pattern": WHITESPACE})
        except (ValueError, TypeError) as e:
            raise ValueError(str(e)) from None
        error = llguidance.LLMatcher.validate_grammar(grammar, self._lltokenizer)
        if error:
            raise ValueError(error)
        with self._lock:
            self._compiled[spec] = grammar
            if len(self._compiled) > _KEPT:
                self._compiled.popitem(last=False)
        return grammar

    def matcher(self, spec: str) -> Matcher:
        import llguidance

        grammar = self.compile(spec)  # first: it makes the tokenizer tables
        matcher = llguidance.LLMatcher(self._lltokenizer, grammar)
        return Matcher(matcher, self._lltokenizer.vocab_size)
