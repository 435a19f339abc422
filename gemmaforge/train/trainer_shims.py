"""Where our Trainer needs what transformers' public API does not offer, in one place.

Every other part of the training library uses the Trainer's public hooks (`training_step`, `log`,
`prediction_step`, callbacks). These three private methods have no public equivalent; each override is checked
against transformers 5.25.0, and tests/unit/test_trainer_shims.py fails when an upgrade stops calling one of them
where it is overridden here.
"""

from __future__ import annotations

from typing import Any

from transformers import Trainer

from gemmaforge.train.sharding import declare_fsdp_on_cpu

CHECKED_WITH = "5.25.0"
# private method -> the Trainer method whose source calls it (what the test reads)
CALLED_FROM = {
    "_build_accelerator_args": "create_accelerator_and_postprocess",
    "_run_epoch": "_inner_training_loop",
    "_save_checkpoint": "_maybe_log_save_evaluate",
}


class ShimmedTrainer(Trainer):
    """A Trainer with the three hooks below; subclasses define `before_checkpoint`."""

    def _build_accelerator_args(self, **kwargs: Any) -> dict[str, Any]:
        # FSDP on the CPU: the Accelerator built from these args must join the state declared here (no callback
        # runs before the Accelerator exists)
        args = super()._build_accelerator_args(**kwargs)
        declare_fsdp_on_cpu(args["mixed_precision"])
        return args

    def _run_epoch(self, *args: Any, **kwargs: Any) -> Any:
        # Resumed from the final checkpoint (the same command again after a later stage failed): the loop checks
        # max_steps only after a step (a callback's should_training_stop too), so it would train one step beyond
        if 0 < self.state.max_steps <= self.state.global_step:
            self.control.should_training_stop = True
            return None
        return super()._run_epoch(*args, **kwargs)

    def _save_checkpoint(self, *args: Any, **kwargs: Any) -> Any:
        # callbacks' on_save runs after the checkpoint is written: too late to refuse one
        self.before_checkpoint()
        return super()._save_checkpoint(*args, **kwargs)

    def before_checkpoint(self) -> None:
        """Runs before each checkpoint is written; raise to refuse it."""
