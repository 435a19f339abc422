"""A reward model's score head (train.method: rm): one linear layer from the decoder's last hidden state at an
answer's last token to a number. It is named and placed as transformers' sequence classifiers place theirs (`score`,
beside the decoder `model`), so the merged checkpoint loads as one (Gemma3TextForSequenceClassification and its
siblings, model_spec.Architecture.sequence_classifier) and scores exactly what training scored."""

from __future__ import annotations

from typing import Any

import torch

REWARD_HEAD = "score"  # transformers' GenericForSequenceClassification names its head so


def attach_reward_head(model: Any) -> None:
    """A `score` head (hidden size -> 1, no bias, as transformers' sequence classifiers have it) on `model`, drawn as
    transformers initialises linear layers (normal, std initializer_range). Kept in fp32: one small layer, trained."""
    text = model.config.get_text_config()
    device = model.get_input_embeddings().weight.device
    head = torch.nn.Linear(text.hidden_size, 1, bias=False, device=device, dtype=torch.float32)
    torch.nn.init.normal_(head.weight, std=getattr(text, "initializer_range", 0.02))
    setattr(model, REWARD_HEAD, head)


def pooled_rewards(head: Any, last_hidden: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """(B,) fp32: the head applied to each row's last attended position. transformers' sequence classifiers take the
    rightmost token that is not padding, the same position in right-padded rows (and in an unpadded one, the last)."""
    positions = torch.arange(attention_mask.shape[1], device=attention_mask.device)
    last = (attention_mask.to(positions.dtype) * positions).argmax(dim=-1)
    rows = torch.arange(last_hidden.shape[0], device=last_hidden.device)
    return head(last_hidden[rows, last.to(last_hidden.device)].float()).squeeze(-1).float()
