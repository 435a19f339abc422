"""A reward model (`train.method: rm`): on the same pairs as dpo (recipe/dpo.py's encoding and batches), a score
head on each answer's last token learns to rank the chosen answer above the rejected one. The merge writes a
transformers sequence classifier (model_spec.Architecture.sequence_classifier), which scores a conversation with
AutoModelForSequenceClassification; it writes no text, so nothing is exported to GGUF or Ollama."""

from __future__ import annotations

from typing import Any

from gemmaforge.config import RunConfig
from gemmaforge.data.prepare import read_prepared_pairs
from gemmaforge.model_spec import reward_classifier
from gemmaforge.models import ResolvedModel
from gemmaforge.recipe.dpo import PairCollator, encode_pairs, preference_datasets
from gemmaforge.recipe.method import Datasets, Method
from gemmaforge.runs import RunDir
from gemmaforge.senses import Senses
from gemmaforge.train.preference import RewardTrainer


def rm_datasets(run: RunDir, config: RunConfig, tokenizer: Any, base: ResolvedModel,
                senses: Senses) -> Datasets:
    reward_classifier(base.spec)  # refused before training when the result could not be saved as a scorer

    def encoded(name: str) -> tuple[list[dict[str, list[int]]], int]:
        pairs = read_prepared_pairs(run.require(run.data_dir / f"{name}.jsonl", "data"))
        return encode_pairs(pairs, tokenizer, base.family, config.train.cutoff_len)

    (train, dropped), (val, _) = encoded("train"), encoded("val")
    return preference_datasets(config, train, val, dropped, PairCollator(tokenizer.pad_token_id),
                               f"{len(train)} preference pairs, a reward model")


RM = Method("rm", rm_datasets, RewardTrainer)
