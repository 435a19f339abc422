"""KTO (`train.method: kto`): answers labelled desirable or undesirable (LLaMA-Factory's kto_tag, TRL's unpaired
prompt/completion/label), or preference pairs taken as one desirable and one undesirable answer, as TRL's
KTOTrainer unpairs them. Each answer is rendered in the family's chat format exactly as SFT renders a conversation,
the loss on the answer only.

The KL baseline is estimated on mismatched answers: each prompt with the answer of the example half the dataset
away, fixed when the data is encoded (LLaMA-Factory fixes it at preprocessing too). TRL instead rotates the answers
within each batch, which needs two examples per device batch and an unshuffled order; a fixed partner works at any
batch size. Half the dataset away rather than the next example: the two sides of a pair are neighbours and share
their prompt. A batch holds the answers' rows, then their mismatched rows, padded to one width.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from gemmaforge.chat.conversation import IGNORE_INDEX, Message
from gemmaforge.config import RunConfig
from gemmaforge.data.prepare import read_prepared_feedback
from gemmaforge.families import Family
from gemmaforge.models import ResolvedModel
from gemmaforge.recipe.dpo import preference_datasets
from gemmaforge.recipe.method import Datasets, Method
from gemmaforge.runs import RunDir
from gemmaforge.senses import Senses
from gemmaforge.train.collate import RightPadCollator
from gemmaforge.train.preference import FeedbackTrainer


def encode_feedback(examples: list[tuple[list[Message], Message, bool]], tokenizer: Any, family: Family,
                    cutoff_len: int) -> tuple[list[dict[str, Any]], int]:
    """Each answer as {input_ids, labels, kl_input_ids, kl_labels, desirable}, labels on the answer only (kl_: the
    prompt with the mismatched answer); and how many were dropped because no answer token fit within cutoff_len."""
    encoded, dropped = [], 0
    half = len(examples) // 2
    for i, (prompt, answer, desirable) in enumerate(examples):
        mismatched = examples[(i + half) % len(examples)][1]
        (ids, labels), (kl_ids, kl_labels) = (family.chat.encode([*prompt, reply], tokenizer, cutoff_len,
                                                                 mask_history=True) for reply in (answer, mismatched))
        if all(label == IGNORE_INDEX for label in labels) or all(label == IGNORE_INDEX for label in kl_labels):
            dropped += 1
            continue
        encoded.append({"input_ids": ids, "labels": labels, "kl_input_ids": kl_ids, "kl_labels": kl_labels,
                        "desirable": desirable})
    return encoded, dropped


class FeedbackCollator:
    """The batch's answers, then their mismatched answers, right-padded together (RightPadCollator), and each
    answer's label (`desirable`). Counted as the answers alone: the mismatched rows are scored, not trained."""

    def __init__(self, pad_token_id: int):
        self.pad = RightPadCollator(pad_token_id)

    def __call__(self, batch: list[dict[str, Any]]) -> dict[str, Any]:
        rows = [{"input_ids": ex[f"{prefix}input_ids"], "labels": ex[f"{prefix}labels"]}
                for prefix in ("", "kl_") for ex in batch]
        out: dict[str, Any] = self.pad(rows)
        supervised = sum(label != IGNORE_INDEX for ex in batch for label in ex["labels"][1:])
        out["counts"] = dataclasses.replace(out["counts"], examples=len(batch), supervised=supervised)
        out["desirable"] = torch.tensor([ex["desirable"] for ex in batch])
        return out


def kto_datasets(run: RunDir, config: RunConfig, tokenizer: Any, base: ResolvedModel,
                 senses: Senses) -> Datasets:
    def encoded(name: str) -> tuple[list[dict[str, Any]], int]:
        examples = read_prepared_feedback(run.require(run.data_dir / f"{name}.jsonl", "data"))
        return encode_feedback(examples, tokenizer, base.family, config.train.cutoff_len)

    (train, dropped), (val, _) = encoded("train"), encoded("val")
    desirable = sum(ex["desirable"] for ex in train)
    return preference_datasets(config, train, val, dropped, FeedbackCollator(tokenizer.pad_token_id),
                               f"{desirable} desirable and {len(train) - desirable} undesirable answers, KTO")


KTO = Method("kto", kto_datasets, FeedbackTrainer)
