"""Loss and perplexity, and the shipped knowledge-retention probes.

Loss is the training objective itself (`train/loss.py`: mean cross-entropy over supervised tokens), so
eval loss here equals the trainer's; perplexity is its exponential. The general-text sample is scored on
every token after <bos>.
"""

from __future__ import annotations

import functools
import json
import math
from dataclasses import dataclass
from importlib import resources
from typing import Any

from gemmaforge.chat.conversation import IGNORE_INDEX, Message

ASSETS = resources.files("gemmaforge.evaluate") / "assets"


def mean_loss(model: Any, examples: list[dict[str, Any]], pad_token_id: int, batch_size: int,
              senses: Any = None) -> float | None:
    """Mean next-token cross-entropy over the supervised tokens of all examples (None when there are none); examples
    with images or clips are scored with them (`senses`: the model's Senses)."""
    import torch

    from gemmaforge.train.collate import MediaBatches, RightPadCollator
    from gemmaforge.train.loss import supervised_loss

    collate: Any = RightPadCollator(pad_token_id)
    if senses is not None:
        collate = MediaBatches(collate, senses)
    total, count = 0.0, 0
    model.eval()
    with torch.no_grad():
        for start in range(0, len(examples), batch_size):
            batch = collate(examples[start:start + batch_size])
            total += float(supervised_loss(model, batch, num_items=1))  # num_items=1: the sum, not the mean
            count += int((batch["labels"][:, 1:] != IGNORE_INDEX).sum())
    return total / count if count else None


def pair_logps(model: Any, pairs: list[dict[str, list[int]]], pad_token_id: int,
               batch_size: int) -> tuple[list[float], list[float]]:
    """The summed log-probability of each pair's chosen and of its rejected answer (recipe/dpo.py's encoding)."""
    import torch

    from gemmaforge.recipe.dpo import PairCollator
    from gemmaforge.train.loss import sequence_logps

    collate = PairCollator(pad_token_id)
    chosen: list[float] = []
    rejected: list[float] = []
    model.eval()
    with torch.no_grad():
        for start in range(0, len(pairs), batch_size):
            logps, _ = sequence_logps(model, collate(pairs[start:start + batch_size]))
            first, second = logps.chunk(2)
            chosen += first.tolist()
            rejected += second.tolist()
    return chosen, rejected


def kl_from_reference(engine: Any, examples: list[dict[str, list[int]]], adapter: str,
                      pad_token_id: int) -> float | None:
    """The tuned model's KL divergence from the reference (the base: its adapter disabled) on its own answers, in
    nats per answer token: at each position of each example's supervised answer, the whole next-token distribution
    of the one against the other's (None without examples). One example at a time: two full-vocabulary rows per
    answer token are held."""
    from gemmaforge.train.collate import RightPadCollator
    from gemmaforge.train.loss import supervised_log_probs

    def divergence(model: Any, batch: dict[str, Any], tuned: Any) -> float:
        return float((tuned.exp() * (tuned - supervised_log_probs(model, batch))).sum())

    collate = RightPadCollator(pad_token_id)
    total, count = 0.0, 0
    for example in examples:
        batch = collate([example])
        tuned = engine.call(functools.partial(supervised_log_probs, inputs=batch), adapter)
        total += engine.call(functools.partial(divergence, batch=batch, tuned=tuned))
        count += tuned.shape[0]
    return round(total / count, 5) if count else None


def preference_summary(base: tuple[list[float], list[float]], tuned: tuple[list[float], list[float]],
                       beta: float) -> dict[str, dict[str, float | None]]:
    """Per side: how often the chosen answer is the likelier one (preference accuracy: log-probabilities summed
    over each answer, so a longer chosen answer starts behind); for the tuned model also its implicit rewards
    against the base, beta times the change of each answer's log-probability, as DPO defines them: how often the
    chosen one's is the higher (reward accuracy) and their mean margin."""
    def share(flags: list[bool]) -> float | None:
        return round(sum(flags) / len(flags), 4) if flags else None

    margins = [beta * ((tc - bc) - (tr - br)) for tc, tr, bc, br in zip(*tuned, *base)]
    return {"base": {"preference_accuracy": share([c > r for c, r in zip(*base)]), "reward_accuracy": None,
                     "reward_margin": None},
            "tuned": {"preference_accuracy": share([c > r for c, r in zip(*tuned)]),
                      "reward_accuracy": share([m > 0 for m in margins]),
                      "reward_margin": round(sum(margins) / len(margins), 4) if margins else None}}


def perplexity(loss: float | None) -> float | None:
    return round(math.exp(loss), 3) if loss is not None else None


def general_text_examples(tokenizer: Any, cutoff_len: int) -> list[dict[str, list[int]]]:
    """Each paragraph of the shipped general-text sample as one example, every token after <bos> scored."""
    text = (ASSETS / "general_text.txt").read_text(encoding="utf-8")
    examples = []
    for paragraph in filter(None, (p.strip() for p in text.split("\n\n"))):
        ids = [tokenizer.bos_token_id, *tokenizer(paragraph, add_special_tokens=False).input_ids][:cutoff_len]
        examples.append({"input_ids": ids, "labels": [IGNORE_INDEX, *ids[1:]]})
    return examples


@dataclass(frozen=True)
class Probe:
    id: str
    lang: str
    prompt: str
    answers: tuple[str, ...]  # a reply is correct when it contains any of them (case-insensitive)

    def correct(self, reply: str) -> bool:
        folded = reply.casefold()
        return any(answer.casefold() in folded for answer in self.answers)


def retention_probes() -> list[Probe]:
    lines = (ASSETS / "retention.jsonl").read_text(encoding="utf-8").splitlines()
    return [Probe(r["id"], r["lang"], r["prompt"], tuple(r["answers"])) for r in map(json.loads, filter(None, lines))]


def probe_conversation(probe: Probe, system: str | None) -> list[Message]:
    head = [{"role": "system", "content": system}] if system else []
    return [*head, {"role": "user", "content": probe.prompt}]
