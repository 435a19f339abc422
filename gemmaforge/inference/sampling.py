"""Next-token choice for one sequence, with Ollama's options and in llama.cpp's order: repeat penalty,
top-k, top-p, min-p, temperature; temperature 0 is greedy. And the log-probabilities a request may ask for,
computed alike for both engines."""

from __future__ import annotations

from collections.abc import Callable

import torch

from gemmaforge.inference.jobs import Candidate, Params, TokenLogprob


def new_generator(seed: int | None) -> torch.Generator:
    generator = torch.Generator()
    if seed is None or seed < 0:
        generator.seed()
    else:
        generator.manual_seed(seed)
    return generator


def choose_token(logits: torch.Tensor, params: Params, history: list[int], generator: torch.Generator) -> int:
    """`logits`: (vocab,) float32 for one sequence; `history`: its prompt and answer so far."""
    if params.repeat_penalty != 1.0 and params.repeat_last_n != 0 and history:
        recent = history if params.repeat_last_n < 0 else history[-params.repeat_last_n:]
        index = torch.tensor(sorted(set(recent)), dtype=torch.long)
        seen = logits[index]
        logits = logits.index_copy(0, index, torch.where(seen > 0, seen / params.repeat_penalty,
                                                         seen * params.repeat_penalty))
    if params.temperature <= 0:
        return int(torch.argmax(logits))
    if params.top_k > 0:
        values, index = torch.topk(logits, min(params.top_k, logits.numel()))
    else:
        values, index = torch.sort(logits, descending=True)
    probs = torch.softmax(values.float(), dim=-1)
    keep = torch.ones_like(probs, dtype=torch.bool)
    if params.top_p < 1.0:
        before = torch.cumsum(probs, dim=-1) - probs  # mass of the better tokens: keep while below top_p
        keep &= before < params.top_p
    if params.min_p > 0.0:
        keep &= probs >= params.min_p * probs[0]
    keep[0] = True  # the best token always survives
    values = values[keep]
    probs = torch.softmax(values.float() / params.temperature, dim=-1)
    return int(index[keep][torch.multinomial(probs, 1, generator=generator)])


def token_logprob(logits: torch.Tensor, token: int, top: int, piece: Callable[[int], bytes]) -> TokenLogprob:
    """`token`'s log-probability under `logits` (vocab,) and the `top` likeliest tokens': the model's own
    distribution (log-softmax in float32), before the sampling options and any grammar change it, which is what
    Ollama reports. `piece(id)` is a token's bytes as it is written into the answer."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)

    def candidate(index: int, value: float) -> Candidate:
        raw = piece(index)
        return Candidate(raw.decode("utf-8", errors="replace"), raw, value)

    alternatives: tuple[Candidate, ...] = ()
    if top > 0:
        values, indices = torch.topk(logprobs, min(top, logprobs.numel()))
        alternatives = tuple(candidate(i, v) for i, v in zip(indices.tolist(), values.tolist()))
    chosen = candidate(token, float(logprobs[token]))
    return TokenLogprob(chosen.token, chosen.raw, chosen.logprob, alternatives)
