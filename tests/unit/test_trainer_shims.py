"""The Trainer's private methods that train/trainer_shims.py overrides are still called where the override expects:
an upgrade of transformers that renames or stops calling one fails here, not silently in a training run."""

from __future__ import annotations

import inspect

import transformers
from transformers import Trainer

from gemmaforge.train.trainer_shims import CALLED_FROM, CHECKED_WITH, ShimmedTrainer


def test_every_overridden_private_method_is_still_called_by_the_trainer() -> None:
    overridden = {name for name in vars(ShimmedTrainer) if name.startswith("_") and not name.startswith("__")}
    assert overridden == set(CALLED_FROM)  # every shim is listed with its caller
    for name, caller in CALLED_FROM.items():
        assert callable(getattr(Trainer, name, None)), f"transformers {transformers.__version__}: no Trainer.{name}"
        source = inspect.getsource(getattr(Trainer, caller))
        assert f"self.{name}(" in source, f"transformers {transformers.__version__}: Trainer.{caller} no longer " \
            f"calls {name} (the shim was checked with {CHECKED_WITH})"

