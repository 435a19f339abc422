"""Preference tuning (`train.method: dpo`, with `train.pref_loss` sigmoid, hinge, ipo, orpo or simpo): pairs of a
chosen and a rejected answer to one prompt, each side rendered in the family's chat format exactly as SFT renders a
conversation, the loss on the last answer only (the prompt is never supervised). A batch holds the chosen sides of
its pairs, then their rejected sides, padded to one width."""

from __future__ import annotations

import dataclasses
from typing import Any

from gemmaforge.chat.conversation import IGNORE_INDEX
from gemmaforge.config import RunConfig
from gemmaforge.console import console
from gemmaforge.data.prepare import read_prepared_pairs
from gemmaforge.errors import UserError
from gemmaforge.families import Family
from gemmaforge.models import ResolvedModel
from gemmaforge.recipe.method import Datasets, Method
from gemmaforge.runs import RunDir
from gemmaforge.senses import Senses
from gemmaforge.train.collate import RightPadCollator
from gemmaforge.train.memory_plan import NO_MEDIA
from gemmaforge.train.preference import PreferenceSettings, PreferenceTrainer


def encode_pairs(pairs: list[tuple[list[Any], Any, Any]], tokenizer: Any, family: Family,
                 cutoff_len: int) -> tuple[list[dict[str, list[int]]], int]:
    """Each pair as {chosen_input_ids, chosen_labels, rejected_input_ids, rejected_labels}, labels on the last answer
    only; and how many pairs were dropped because a side left no supervised token within cutoff_len."""
    encoded, dropped = [], 0
    for prompt, chosen, rejected in pairs:
        sides = [family.chat.encode([*prompt, answer], tokenizer, cutoff_len, mask_history=True)
                 for answer in (chosen, rejected)]
        if any(all(label == IGNORE_INDEX for label in labels) for _, labels in sides):
            dropped += 1
            continue
        (chosen_ids, chosen_labels), (rejected_ids, rejected_labels) = sides
        encoded.append({"chosen_input_ids": chosen_ids, "chosen_labels": chosen_labels,
                        "rejected_input_ids": rejected_ids, "rejected_labels": rejected_labels})
    return encoded, dropped


class PairCollator:
    """The chosen sides of the batch's pairs, then their rejected sides, right-padded together (RightPadCollator),
    so row i and row B + i are one pair."""

    def __init__(self, pad_token_id: int):
        self.pad = RightPadCollator(pad_token_id)

    def __call__(self, batch: list[dict[str, list[int]]]) -> dict[str, Any]:
        rows = [{"input_ids": pair[f"{side}_input_ids"], "labels": pair[f"{side}_labels"]}
                for side in ("chosen", "rejected") for pair in batch]
        out: dict[str, Any] = self.pad(rows)
        out["counts"] = dataclasses.replace(out["counts"], examples=len(batch))  # pairs
        return out


def dpo_datasets(run: RunDir, config: RunConfig, tokenizer: Any, base: ResolvedModel,
                 senses: Senses) -> Datasets:
    def encoded(name: str) -> tuple[list[dict[str, list[int]]], int]:
        pairs = read_prepared_pairs(run.require(run.data_dir / f"{name}.jsonl", "data"))
        return encode_pairs(pairs, tokenizer, base.family, config.train.cutoff_len)

    (train, dropped), (val, _) = encoded("train"), encoded("val")
    t = config.train
    return preference_datasets(config, train, val, dropped, PairCollator(tokenizer.pad_token_id),
                               f"{len(train)} preference pairs, loss {t.pref_loss}")


def preference_datasets(config: RunConfig, train: list[Any], val: list[Any], dropped: int, collator: Any,
                        what: str) -> Datasets:
    """What dpo, kto and rm hand the skeleton: their encoded splits, batched by `collator` (`what`: the training
    examples, as the console names them), with the settings of train.pref_* and train.kto_*."""
    t = config.train
    if not train:
        raise UserError(f"no training example keeps a supervised answer token within train.cutoff_len={t.cutoff_len}")
    if dropped:
        console.print(f"[yellow]gemmaforge[/]: {dropped} training examples dropped: a prompt alone exceeds "
                      f"cutoff_len={t.cutoff_len}")
    if t.packing:  # the rows of a batch are compared with one another: padded batches
        config = config.model_copy(deep=True)
        config.train.packing = False
    console.print(f"[bold]train[/]: {what}" + ("" if t.method == "rm" else f" (beta {t.pref_beta}"
                  + (f", simpo_gamma {t.simpo_gamma}" if t.method == "dpo" and t.pref_loss == "simpo" else "")
                  + (f", pref_ftx {t.pref_ftx}" if t.pref_ftx else "") + ")"))
    settings = PreferenceSettings(t.pref_loss, t.pref_beta, t.pref_ftx, t.simpo_gamma, t.kto_chosen_weight,
                                  t.kto_rejected_weight)
    return Datasets(train, val, collator, examples=len(train), dropped=dropped, media=NO_MEDIA, config=config,
                    trainer_options={"settings": settings}, unpackable=f"train.method {t.method} compares rows")


DPO = Method("dpo", dpo_datasets, PreferenceTrainer)
