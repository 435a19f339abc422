"""Loss over supervised positions only.

Gemma 3's output layer has 262,144 rows: computed for every position it is most of a small
model's FLOPs and activation memory. Prompt and padding positions carry no loss, so the
output layer runs only on the hidden states whose next token is supervised.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from transformers import Trainer

from gemmaforge.templates import IGNORE_INDEX


def supervised_loss(model: Any, inputs: dict[str, torch.Tensor], num_items: int | torch.Tensor | None) -> torch.Tensor:
    """Mean next-token cross-entropy over supervised positions (sum / num_items when the trainer
    counts items across gradient accumulation, exactly like transformers' own causal-LM loss)."""
    causal_lm = model.get_base_model() if hasattr(model, "get_base_model") else model
    hidden = causal_lm.model(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"]).last_hidden_state
    targets = inputs["labels"][:, 1:]  # (B, T-1): position t predicts token t+1
    keep = targets != IGNORE_INDEX
    logits = causal_lm.get_output_embeddings()(hidden[:, :-1][keep])  # (N, V), N supervised positions
    softcap = getattr(causal_lm.config, "final_logit_softcapping", None)
    if softcap:
        logits = torch.tanh(logits / softcap) * softcap
    loss = F.cross_entropy(logits.float(), targets[keep], reduction="sum")
    denominator = num_items if num_items is not None else keep.sum()
    if isinstance(denominator, torch.Tensor):
        denominator = denominator.to(loss.device)
    return loss / denominator


class SupervisedLossTrainer(Trainer):
    """A Trainer whose loss is `supervised_loss`, already normalised by the item count of the whole
    accumulated batch (so the Trainer must not divide it by the accumulation steps again)."""

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.model_accepts_loss_kwargs = True  # makes the Trainer count num_items_in_batch
        self.loss_is_scaled_for_ga = True

    def compute_loss(self, model: Any, inputs: dict[str, torch.Tensor], return_outputs: bool = False,
                     num_items_in_batch: Any = None) -> Any:
        loss = supervised_loss(model, inputs, num_items_in_batch)
        return (loss, None) if return_outputs else loss

    def prediction_step(self, model: Any, inputs: dict[str, torch.Tensor], prediction_loss_only: bool,
                        ignore_keys: Any = None) -> tuple[torch.Tensor, None, None]:
        """Evaluation needs the loss only; never build full-vocabulary logits for it."""
        inputs = self._prepare_inputs(inputs)
        with torch.no_grad():
            loss = supervised_loss(model, inputs, None)
        return loss.detach(), None, None
