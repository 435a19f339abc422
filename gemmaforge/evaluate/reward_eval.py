"""The eval stage of a reward model (train.method: rm). It writes no answers, so there is no suite and no probe:
on the held-out pairs, how often the tuned model scores the chosen answer above the rejected one, their mean margin,
and the pairwise loss training minimised. The model before training has no score head, so the base side is empty."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from gemmaforge.config import RunConfig
from gemmaforge.console import console
from gemmaforge.data.prepare import read_prepared_pairs
from gemmaforge.errors import UserError
from gemmaforge.models import ResolvedModel, load_causal_lm, load_tokenizer
from gemmaforge.recipe.dpo import PairCollator, encode_pairs
from gemmaforge.runs import RunDir
from gemmaforge.train.reward_head import attach_reward_head

REWARD_ROWS = ("eval_loss", "reward_accuracy", "reward_margin")


def load_reward_model(base: ResolvedModel, adapter: Path) -> Any:
    """The base in fp32 with its score head and the run's adapter (LoRA and the trained head), for inference."""
    import torch
    from peft import PeftModel

    model = load_causal_lm(base.path, base.spec, torch.float32)
    attach_reward_head(model)
    return PeftModel.from_pretrained(model, adapter).eval()


def pair_rewards(model: Any, pairs: list[dict[str, list[int]]], pad_token_id: int,
                 batch_size: int) -> tuple[list[float], list[float]]:
    """The score of each pair's chosen and of its rejected answer (recipe/dpo.py's encoding)."""
    import torch

    from gemmaforge.train.loss import sequence_rewards

    collate = PairCollator(pad_token_id)
    chosen: list[float] = []
    rejected: list[float] = []
    with torch.no_grad():
        for start in range(0, len(pairs), batch_size):
            first, second = sequence_rewards(model, collate(pairs[start:start + batch_size])).chunk(2)
            chosen += first.tolist()
            rejected += second.tolist()
    return chosen, rejected


def reward_summary(chosen: list[float], rejected: list[float]) -> dict[str, float | None]:
    """Accuracy (the chosen answer scored higher), mean margin and mean pairwise loss of scored pairs."""
    margins = [c - r for c, r in zip(chosen, rejected)]
    if not margins:
        return dict.fromkeys(REWARD_ROWS)
    loss = sum(math.log1p(math.exp(-m)) if m > -30 else -m for m in margins) / len(margins)  # -log sigmoid(m)
    return {"eval_loss": round(loss, 4), "reward_accuracy": round(sum(m > 0 for m in margins) / len(margins), 4),
            "reward_margin": round(sum(margins) / len(margins), 4)}


def evaluate_reward_model(run: RunDir, config: RunConfig, base: ResolvedModel) -> dict[str, Any]:
    """What results.json holds for a reward model, in the shape every report has (report.py)."""
    adapter = run.require(run.adapter_dir / "adapter_config.json", "train").parent
    tokenizer = load_tokenizer(adapter)
    pairs, _ = encode_pairs(read_prepared_pairs(run.require(run.data_dir / "val.jsonl", "data")), tokenizer,
                            base.family, config.train.cutoff_len)
    if not pairs:
        raise UserError(f"{run.data_dir / 'val.jsonl'} holds no pair within train.cutoff_len="
                        f"{config.train.cutoff_len}: a reward model is evaluated on held-out pairs (data.val_size)")
    console.print(f"[bold]eval[/]: scoring {len(pairs)} held-out preference pairs with the reward model ...")
    model = load_reward_model(base, adapter)
    tuned = reward_summary(*pair_rewards(model, pairs, tokenizer.pad_token_id, config.eval.batch_size))
    empty: dict[str, Any] = {"suite_pass_rate": None, "check_pass_rates": {}, "bleu": None, "rouge_l": None,
                             "retention_accuracy": None, "perplexity": None}
    return {
        "engine": "transformers",
        "suite": {"source": "none (a reward model scores answers; it writes none)", "cases": 0, "with_checks": 0,
                  "with_reference": 0, "pairs": len(pairs)},
        "sampling": {"do_sample": False, "max_new_tokens": 0},
        "base": {**empty, **dict.fromkeys(REWARD_ROWS)},
        "tuned": {**empty, **tuned},
        "regressions": [],
        "agreement": None,
        "cases": [],
        "retention": [],
    }
