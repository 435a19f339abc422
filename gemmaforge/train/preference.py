"""Preference losses over pairs of answers, and the Trainer that computes them.

The losses are those of LLaMA-Factory's `pref_loss` (its DPO trainer on TRL's definitions): sigmoid (DPO), hinge and
ipo compare the tuned model's log-ratio of the chosen over the rejected answer with the reference model's; orpo and
simpo need no reference. ipo, orpo and simpo read the mean log-probability per answer token, the others the sum.
tests/unit/test_preference.py checks each against TRL's own DPOTrainer on the same tokens.

KTO (train.method: kto) scores answers one at a time, each labelled desirable or undesirable, against a baseline:
the KL divergence of the tuned model from the reference, estimated on mismatched answers (each prompt with another
example's answer) as TRL's KTOTrainer estimates it; tests/unit/test_preference.py checks it against TRL's KTOTrainer.

A reward model (train.method: rm) scores each answer with a head on its last token and learns to rank the chosen
answer of a pair above the rejected one (TRL's RewardTrainer loss); tests/unit/test_preference.py checks it against
TRL's RewardTrainer.

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
# logged at every training log and evaluation (eval_ prefixed), as TRL and LLaMA-Factory name them: accuracies of
# pairs (dpo), kl of labelled answers (kto)
PREFERENCE_METRICS = ("rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies", "kl")
PER_TOKEN = ("ipo", "orpo", "simpo")  # losses on the mean log-probability per answer token


@dataclass(frozen=True)
class PreferenceSettings:
    loss: str  # train.pref_loss
    beta: float  # train.pref_beta
    ftx: float = 0.0  # train.pref_ftx: weight of the supervised loss on the chosen answers
    simpo_gamma: float = 0.5  # train.simpo_gamma
    chosen_weight: float = 1.0  # kto: train.kto_chosen_weight
    rejected_weight: float = 1.0  # kto: train.kto_rejected_weight


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


def kto_losses(settings: PreferenceSettings, logps: torch.Tensor, ref_logps: torch.Tensor, counts: torch.Tensor,
               desirable: torch.Tensor, kl: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(B,) the KTO loss of each answer and (B,) its implicit reward, from its summed log-probability under the tuned
    model and the reference, its token count, its label and the batch's KL estimate (clamped at 0, no gradient)."""
    beta = settings.beta
    ratios = logps - ref_logps
    losses = torch.where(desirable, settings.chosen_weight * (1 - torch.sigmoid(beta * (ratios - kl))),
                         settings.rejected_weight * (1 - torch.sigmoid(beta * (kl - ratios))))
    if settings.ftx > 0:  # the desirable answers' supervised loss per token
        losses = losses - settings.ftx * torch.where(desirable, logps / counts, torch.zeros_like(logps))
    return losses, beta * ratios.detach()


def pair_logps(model: Any, batch: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(chosen, rejected) summed log-probabilities and (chosen, rejected) token counts of a pair batch (the chosen
    answers' rows first, then the rejected ones', as PairCollator stacks them)."""
    logps, counts = _logps(model, batch)
    chosen, rejected = logps.chunk(2)
    chosen_counts, rejected_counts = counts.chunk(2)
    return chosen, rejected, chosen_counts, rejected_counts


def _logps(model: Any, batch: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
    """(B,) each row's summed log-probability of its supervised tokens, and (B,) their count."""
    out = model(**batch, sequence_logps=True)
    return out.logps, out.counts.to(out.logps.device)


def _halves(batch: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """A batch's first and second half of rows; other keys stay behind (supervised_positions index the whole)."""
    half = batch["input_ids"].shape[0] // 2
    keys = ("input_ids", "labels", "attention_mask")
    return {key: batch[key][:half] for key in keys}, {key: batch[key][half:] for key in keys}


class PreferenceTrainer(SupervisedLossTrainer):
    """A Trainer for pairs: the loss of train.pref_loss, averaged over the pairs of each step; the reference pass
    with the adapter disabled and no gradient. Logs rewards/chosen, rewards/rejected, rewards/margins and
    rewards/accuracies (train and eval), as TRL and LLaMA-Factory name them."""

    def __init__(self, *args: Any, settings: PreferenceSettings, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.settings = settings
        self.model_accepts_loss_kwargs = False  # a mean over pairs: the Trainer divides by the accumulation steps
        self.loss_is_scaled_for_ga = False
        # per split and metric: (sum, count) of each batch, kept on the device and read back at the log
        self.sums: dict[str, dict[str, list[tuple[torch.Tensor, torch.Tensor | int]]]] = {"train": {}, "eval": {}}

    def compute_loss(self, model: Any, inputs: dict[str, Any], return_outputs: bool = False,
                     num_items_in_batch: Any = None) -> Any:
        losses = self.losses(model, inputs, "train" if model.training else "eval")
        loss = losses.mean()
        return (loss, None) if return_outputs else loss

    def losses(self, model: Any, inputs: dict[str, Any], split: str) -> torch.Tensor:
        chosen, rejected, chosen_counts, rejected_counts = pair_logps(model, inputs)
        ref_chosen = ref_rejected = None
        if self.settings.loss not in REFERENCE_FREE:
            with torch.no_grad(), self.reference(model):
                ref_chosen, ref_rejected, _, _ = pair_logps(model, inputs)
        result = preference_losses(self.settings, chosen, rejected, ref_chosen, ref_rejected, chosen_counts,
                                   rejected_counts)
        accuracies = (result.chosen_rewards > result.rejected_rewards).float()
        for name, value in (("rewards/chosen", result.chosen_rewards), ("rewards/rejected", result.rejected_rewards),
                            ("rewards/accuracies", accuracies)):
            self.remember(split, name, value.sum(), len(value))
        return result.losses

    def reference(self, model: Any) -> Any:
        """The context in which `model` is the reference: its adapter disabled."""
        return self.accelerator.unwrap_model(model).disable_adapter()

    def remember(self, split: str, name: str, total: torch.Tensor, count: torch.Tensor | int) -> None:
        self.sums[split].setdefault(name, []).append((total.detach(), count))

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
        for name, parts in self.sums[split].items():
            count = float(sum(n for _, n in parts))
            if count:
                logs[prefix + name] = round(torch.stack([total for total, _ in parts]).sum().item() / count, 4)
        self.sums[split] = {}
        chosen, rejected = logs.get(f"{prefix}rewards/chosen"), logs.get(f"{prefix}rewards/rejected")
        if chosen is not None and rejected is not None:  # of pairs, the mean margin; of KTO's answers, as TRL's
            logs[f"{prefix}rewards/margins"] = round(chosen - rejected, 4)
        super().log(logs, start_time)


class FeedbackTrainer(PreferenceTrainer):
    """A Trainer for KTO: answers labelled desirable or undesirable (recipe/kto.py's batches: the answers' rows, then
    as many rows of mismatched answers for the KL estimate), the loss averaged over the answers of each step. Logs
    rewards/chosen and rewards/rejected (the mean implicit reward of the desirable and of the undesirable answers),
    rewards/margins (their difference) and kl, as TRL names them."""

    def losses(self, model: Any, inputs: dict[str, Any], split: str) -> torch.Tensor:
        desirable = inputs.pop("desirable")
        answers, mismatched = _halves(inputs)
        logps, counts = _logps(model, answers)
        with torch.no_grad():
            kl_logps, _ = _logps(model, mismatched)
            with self.reference(model):
                ref_logps, _ = _logps(model, answers)
                ref_kl_logps, _ = _logps(model, mismatched)
        kl = self.accelerator.gather((kl_logps - ref_kl_logps).mean().reshape(1)).mean().clamp(min=0)
        losses, rewards = kto_losses(self.settings, logps, ref_logps, counts, desirable, kl)
        zero = torch.zeros_like(rewards)  # sums under a mask: selecting the rows would make the host wait for them
        self.remember(split, "rewards/chosen", torch.where(desirable, rewards, zero).sum(), desirable.sum())
        self.remember(split, "rewards/rejected", torch.where(desirable, zero, rewards).sum(), (~desirable).sum())
        self.remember(split, "kl", kl, 1)
        return losses


def reward_losses(chosen: torch.Tensor, rejected: torch.Tensor) -> torch.Tensor:
    """(B,) the pairwise loss of a reward model (Bradley-Terry, as TRL's RewardTrainer): -log sigmoid(r_c - r_r)."""
    return -F.logsigmoid(chosen - rejected)


class RewardTrainer(PreferenceTrainer):
    """A Trainer for a reward model on pairs (recipe/dpo.py's batches: the chosen rows, then the rejected ones): the
    pairwise loss of their scores, averaged over the pairs of each step. Logs rewards/chosen and rewards/rejected
    (the mean scores), rewards/margins and rewards/accuracies (the chosen answer scored higher)."""

    def losses(self, model: Any, inputs: dict[str, Any], split: str) -> torch.Tensor:
        chosen, rejected = model(**inputs, rewards=True).rewards.chunk(2)
        accuracies = (chosen > rejected).float()
        for name, value in (("rewards/chosen", chosen), ("rewards/rejected", rejected),
                            ("rewards/accuracies", accuracies)):
            self.remember(split, name, value.detach().sum(), len(value))
        return reward_losses(chosen, rejected)
