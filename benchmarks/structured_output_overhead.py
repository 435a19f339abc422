"""What constrained decoding costs per generated token with Gemma's tokenizer, for the three maintained libraries
the transformers engine could use: llguidance (as the engine applies it, gemmaforge/inference/constrained.py),
xgrammar and outlines-core.

    python benchmarks/structured_output_overhead.py [--model gemma3-270m] [--repeats 5]

For each library and each grammar (any JSON object; a pydantic-style schema with an enum, a number and an
array), it measures the one-off costs (tokenizer tables, grammar compilation) and, replaying the tokens of a
valid answer, the per-token work a sampler adds: computing the allowed-token mask, applying it to a row of
fp32 logits the size of Gemma's vocabulary (262,144), and advancing the matcher by the chosen token. Each
answer token must be allowed by the mask, or the run stops: a mask that is fast but wrong does not count.
Reported: milliseconds, the median over the answer's tokens (and the slowest token), best of --repeats.

The libraries are not gemmaforge dependencies except the one it uses; install the others to compare:
`pip install outlines-core` and `pip install xgrammar --no-deps apache-tvm-ffi` (xgrammar's
declared triton dependency is only for its GPU kernels).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

SCHEMA = {
    "title": "Coffee",
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "roast": {"enum": ["light", "medium", "dark"]},
        "price": {"type": "number"},
        "notes": {"type": "array", "items": {"type": "string"}},
    },
    "required": ["name", "roast", "price", "notes"],
    "additionalProperties": False,
}
ANSWER = {"name": "Yirgacheffe 耶加雪菲", "roast": "light", "price": 68.5,
          "notes": ["jasmine", "bergamot", "lemon tea", "蜂蜜的甜感"]}

# A matcher for one answer: mask(logits) sets the disallowed tokens to -inf; advance(token) consumes one.
Matcher = tuple[Callable[[torch.Tensor], None], Callable[[int], None]]
# prepare(tokenizer) -> compile(schema or None for any JSON object) -> new() -> a fresh Matcher. prepare runs
# once per tokenizer (an engine keeps it); compile runs once per request's schema.
Compile = Callable[[dict | None], Callable[[], Matcher]]


def llguidance_prepare(tokenizer: Any) -> Compile:
    """As the transformers engine uses it (gemmaforge.inference.constrained)."""
    from gemmaforge.inference.constrained import Grammars

    grammars = Grammars(tokenizer, [tokenizer.convert_tokens_to_ids("<end_of_turn>"), tokenizer.eos_token_id])
    grammars.compile("json")  # the tokenizer tables, made on the first compile

    def compile_(schema: dict | None) -> Callable[[], Matcher]:
        spec = json.dumps(schema) if schema else "json"
        grammars.compile(spec)

        def new() -> Matcher:
            matcher = grammars.matcher(spec)
            return matcher.mask, matcher.advance
        return new
    return compile_


def xgrammar_prepare(tokenizer: Any) -> Compile:
    import xgrammar

    info = xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=len(tokenizer))
    compiler = xgrammar.GrammarCompiler(info)
    bitmask = xgrammar.allocate_token_bitmask(1, info.vocab_size)

    def compile_(schema: dict | None) -> Callable[[], Matcher]:
        compiled = compiler.compile_json_schema(json.dumps(schema), any_whitespace=False, separators=(",", ":")) \
            if schema else compiler.compile_builtin_json_grammar()

        def new() -> Matcher:
            matcher = xgrammar.GrammarMatcher(compiled)

            def mask(logits: torch.Tensor) -> None:
                matcher.fill_next_token_bitmask(bitmask)
                xgrammar.apply_token_bitmask_inplace(logits, bitmask)

            def advance(token: int) -> None:
                if not matcher.accept_token(token):
                    raise RuntimeError(f"xgrammar refused token {token}")
            return mask, advance
        return new
    return compile_


def outlines_core_prepare(tokenizer: Any) -> Compile:
    from outlines_core import Guide, Index, Vocabulary
    from outlines_core.json_schema import build_regex_from_schema

    # outlines-core takes the vocabulary as token bytes -> ids: SentencePiece's "▁" is a space and <0xNN>
    # byte tokens are that byte (the mapping its `outlines` front end applies); the end token goes apart
    eos = tokenizer.convert_tokens_to_ids("<end_of_turn>")
    special = set(tokenizer.all_special_ids) | {eos}
    tokens: dict[bytes, list[int]] = {}
    for token_id, piece in enumerate(tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))):
        if token_id in special or piece is None:
            continue
        if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
            data = bytes([int(piece[3:5], 16)])
        else:
            data = piece.replace("▁", " ").encode("utf-8")
        tokens.setdefault(data, []).append(token_id)
    vocabulary = Vocabulary(eos, tokens)
    words = (len(tokenizer) + 31) // 32
    bitmask = torch.zeros(words, dtype=torch.int32)
    bits = 1 << torch.arange(32, dtype=torch.int64)

    def compile_(schema: dict | None) -> Callable[[], Matcher]:
        index = Index(build_regex_from_schema(json.dumps(schema or {"type": "object"})), vocabulary)

        def new() -> Matcher:
            guide = Guide(index)

            def mask(logits: torch.Tensor) -> None:
                guide.write_mask_into(bitmask.data_ptr(), bitmask.numel(), bitmask.element_size())
                allowed = (bitmask.to(torch.int64).unsqueeze(1) & bits).ne(0).flatten()[:logits.shape[-1]]
                logits.masked_fill_(~allowed, float("-inf"))

            def advance(token: int) -> None:
                guide.advance(token)
            return mask, advance
        return new
    return compile_


LIBRARIES = {"llguidance": llguidance_prepare, "xgrammar": xgrammar_prepare, "outlines-core": outlines_core_prepare}


def replay(new: Callable[[], Matcher], answer_ids: list[int], vocab: int) -> list[float]:
    """Per-token seconds of mask + apply + advance over the answer's tokens; each must be allowed."""
    mask, advance = new()
    logits = torch.zeros(1, vocab)
    times = []
    for token in answer_ids:
        logits.zero_()
        begin = time.perf_counter()
        mask(logits)
        allowed = bool(torch.isfinite(logits[0, token]))
        advance(token)
        times.append(time.perf_counter() - begin)
        if not allowed:
            raise RuntimeError(f"token {token} of a valid answer was masked out")
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="gemma3-270m", help="a model whose tokenizer to use")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()

    from gemmaforge.models import default_home, load_tokenizer, resolve_model

    tokenizer = load_tokenizer(resolve_model(args.model, default_home()).path)
    vocab = len(tokenizer)
    print(f"tokenizer: {args.model}, {vocab} tokens; torch threads {torch.get_num_threads()}; "
          f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores")
    print("| library | grammar | tokenizer tables (s, once) | compile (s, per schema) | per token, median (ms) "
          "| slowest token (ms) |")
    print("| --- | --- | ---: | ---: | ---: | ---: |")
    for name, prepare in LIBRARIES.items():
        try:
            begin = time.perf_counter()
            compile_ = prepare(tokenizer)
            prepare_s = time.perf_counter() - begin
        except ImportError as error:
            print(f"| {name} | - | {error} | | | |")
            continue
        for label, schema, answer in (("any JSON object", None, {"answer": ANSWER}),
                                      ("schema (enum, number, array)", SCHEMA, ANSWER)):
            answer_ids = tokenizer.encode(json.dumps(answer, ensure_ascii=False, separators=(",", ":")),
                                          add_special_tokens=False)
            begin = time.perf_counter()
            new = compile_(schema)
            compile_s = time.perf_counter() - begin
            best = min((replay(new, answer_ids, vocab) for _ in range(args.repeats)), key=statistics.median)
            print(f"| {name} | {label} | {prepare_s:.2f} | {compile_s:.3f} | {statistics.median(best) * 1e3:.3f} "
                  f"| {max(best) * 1e3:.2f} |")

if __name__ == "__main__":
    main()
