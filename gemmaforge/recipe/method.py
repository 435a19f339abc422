"""What a training method gives the method-neutral skeleton of recipe/trainer.py: its data, encoded and batched,
and its Trainer. The skeleton does the rest for every method (precision, sharding, the memory check, resume,
metrics, the non-finite and out-of-memory diagnoses, gathering and checking the adapter, saving, the report).

`train.method` picks one from recipe/trainer.METHODS; a new method (preference pairs, raw text) is a module like
sft.py plus a row there and its name in config.METHODS.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from gemmaforge.config import RunConfig
from gemmaforge.models import ResolvedModel
from gemmaforge.runs import RunDir
from gemmaforge.senses import Senses
from gemmaforge.train.memory_plan import MediaLoad


@dataclass(frozen=True)
class Datasets:
    train: Any  # what the Trainer iterates
    val: Any  # empty when the run has no validation split
    collator: Any  # rows -> a batch the method's Trainer takes
    examples: int  # training examples kept
    dropped: int  # training examples dropped (the method said why)
    media: MediaLoad  # the most pictures and audio tokens one training example holds (the memory plan prices them)
    config: RunConfig  # the configuration to train with (the method may turn off what its data cannot use)
    trainer_options: dict[str, Any] = field(default_factory=dict)  # keyword arguments of the method's Trainer
    unpackable: str = ""  # why these batches are padded whatever train.packing says ("": packing applies)


@dataclass(frozen=True)
class Method:
    name: str  # as `train.method` names it
    # (run, config, tokenizer, base, senses) -> the encoded splits; UserError when nothing can be trained
    datasets: Callable[[RunDir, RunConfig, Any, ResolvedModel, Senses], Datasets]
    trainer: type  # a Trainer subclass on train/trainer_shims.ShimmedTrainer
