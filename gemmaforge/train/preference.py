"""Preference losses over pairs of answers, and the Trainer that computes them.

The losses are those of LLaMA-Factory's `pref_loss` (its DPO trainer on TRL's definitions): sigmoid (DPO), hinge and
ipo compare the tuned model's log-ratio of the chosen over the rejected answer with the reference model's; orpo and
simpo need no reference. ipo, orpo and simpo read the mean log-probability per answer token, the others the sum.
tests/unit/test_preference.py checks each against TRL's own DPOTrainer on the same tokens.

With LoRA the reference is the model with its adapter disabled: the base (or, for a run that starts from an SFT
adapter merged into its base, that model), never a second copy in memory.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from gemmaforge.train.loss import SupervisedLossTrainer

REFERENCE_FREE = ("orpo", "simpo")
# logged at every training log and evaluation (eval_ prefixed), as TRL and LLaMA-Factory name them
PAIR_METRICS = ("rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies")
PER_TOKEN = ("ipo", "orpo", "simpo")  # losses on the mean log-probability per answer token


@dataclass(frozen=True)
class PreferenceSettings:
    loss: str  # train.pref_loss
    beta: float  # train.pref_beta
    ftx: float = 0.0  # train.pref_ftx: weight of the supervised loss on the chosen answers
    simpo_gamma: float = 0.5  # train.simpo_gamma


@dataclass(frozen=True)
class PairLosses:
    """Per pair: the loss, and the implicit rewards of each answer (what the metrics report)."""

    losses: torch.Tensor  # (B,)
    chosen_rewards: torch.Tensor  # (B,)
    rejected_rewards: torch.Tensor  # (B,)


def preference_losses(settings: PreferenceSettings, chosen_logps: torch.Tensor, rejected_logps: torch.Tensor,
                      ref_chosen_logps: torch.Tensor | None, ref_rejected_logps: torch.Tensor | None,
                      chosen_counts: torch.Tensor, rejected_counts: torch.Tensor) -> PairLosses:
    """The loss of each pair from the summed log-probabilities of its answers (policy, and reference unless the
    loss is reference-free) and their token counts."""
    beta = settings.beta
    if settings.loss in PER_TOKEN:
        chosen_logps, rejected_logps = chosen_logps / chosen_counts, rejected_logps / rejected_counts
    if settings.loss in REFERENCE_FREE:
        if settings.loss == "orpo":  # odds ratio: log(p/(1-p)) of the chosen over the rejected, plus its SFT loss
            log_odds = (chosen_logps - rejected_logps) - (torch.log1p(-torch.exp(chosen_logps))
                                                          - torch.log1p(-torch.exp(rejected_logps)))
            losses = -chosen_logps - beta * F.logsigmoid(log_odds)
        else:  # simpo: a margin of simpo_gamma on the length-normalised log-ratio
            losses = -F.logsigmoid(beta * (chosen_logps - rejected_logps) - settings.simpo_gamma)
        chosen_rewards, rejected_rewards = beta * chosen_logps.detach(), beta * rejected_logps.detach()
    else:
        assert ref_chosen_logps is not None and ref_rejected_logps is not None
        if settings.loss in PER_TOKEN:
            ref_chosen_logps = ref_chosen_logps / chosen_counts
            ref_rejected_logps = ref_rejected_logps / rejected_counts
        chosen_ratio, rejected_ratio = chosen_logps - ref_chosen_logps, rejected_logps - ref_rejected_logps
        delta = chosen_ratio - rejected_ratio
        if settings.loss == "sigmoid":
            losses = -F.logsigmoid(beta * delta)
        elif settings.loss == "hinge":
            losses = torch.relu(1 - beta * delta)
        elif settings.loss == "ipo":
            losses = (delta - 1 / (2 * beta)) ** 2
        else:
            raise ValueError(f"unknown preference loss {settings.loss!r}")
        chosen_rewards, rejected_rewards = beta * chosen_ratio.detach(), beta * rejected_ratio.detach()
    if settings.ftx > 0:  # as LLaMA-Factory adds it, to every loss
        mean_chosen = chosen_logps if settings.loss in PER_TOKEN else chosen_logps / chosen_counts
        losses = losses - settings.ftx * mean_chosen
    return PairLosses(losses, chosen_rewards, rejected_rewards)


def pair_logps(model: Any, batch: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(chosen, rejected) summed log-probabilities and (chosen, rejected) token counts of a pair batch (the chosen
    answers' rows first, then the rejected ones', as PairCollator stacks them)."""
    out = model(**batch, sequence_logps=True)
    chosen, rejected = out.logps.chunk(2)
    chosen_counts, rejected_counts = out.counts.to(out.logps.device).chunk(2)
    return chosen, rejected, chosen_counts, rejected_counts


class PreferenceTrainer(SupervisedLossTrainer):
    """A Trainer for pairs: the loss of train.pref_loss, averaged over the pairs of each step; the reference pass
    with the adapter disabled and no gradient. Logs rewards/chosen, rewards/rejected, rewards/margins and
    rewards/accuracies (train and eval), as TRL and LLaMA-Factory name them."""

    def __init__(self, *args: Any, settings: PreferenceSettings, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.settings = settings
        self.model_accepts_loss_kwargs = False  # a mean over pairs: the Trainer divides by the accumulation steps
        self.loss_is_scaled_for_ga = False
        self.pair_metrics: dict[str, dict[str, list[torch.Tensor]]] = {"train": {}, "eval": {}}

    def compute_loss(self, model: Any, inputs: dict[str, Any], return_outputs: bool = False,
                     num_items_in_batch: Any = None) -> Any:
        result = self.pair_losses(model, inputs)
        self._remember("train" if model.training else "eval", result)
        loss = result.losses.mean()
        return (loss, None) if return_outputs else loss

    def pair_losses(self, model: Any, inputs: dict[str, Any]) -> PairLosses:
        chosen, rejected, chosen_counts, rejected_counts = pair_logps(model, inputs)
        ref_chosen = ref_rejected = None
        if self.settings.loss not in REFERENCE_FREE:
            peft_model = self.accelerator.unwrap_model(model)
            with torch.no_grad(), peft_model.disable_adapter():
                ref_chosen, ref_rejected, _, _ = pair_logps(model, inputs)
        return preference_losses(self.settings, chosen, rejected, ref_chosen, ref_rejected, chosen_counts,
                                 rejected_counts)

    def _remember(self, split: str, result: PairLosses) -> None:
        values = (result.chosen_rewards, result.rejected_rewards, result.chosen_rewards - result.rejected_rewards,
                  (result.chosen_rewards > result.rejected_rewards).float())
        for name, value in zip(PAIR_METRICS, values, strict=True):  # kept on the device; read back at the log
            self.pair_metrics[split].setdefault(name, []).append(value.detach().mean())

    def prediction_step(self, model: Any, inputs: dict[str, Any], prediction_loss_only: bool,
                        ignore_keys: Any = None) -> tuple[torch.Tensor, None, None]:
        inputs = self._prepare_inputs(inputs)
        inputs.pop("counts", None)
        with torch.no_grad():
            loss = self.compute_loss(model, inputs)
        return loss.detach(), None, None

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        split = "eval" if any(key.startswith("eval_") for key in logs) else "train"
        prefix = "eval_" if split == "eval" else ""
        for name, values in self.pair_metrics[split].items():
            logs[prefix + name] = round(torch.stack(values).mean().item(), 4)
        self.pair_metrics[split] = {}
        super().log(logs, start_time)
