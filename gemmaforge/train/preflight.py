"""Checks that refuse an impossible training setup before any model loads, with the reason and the fix."""

from __future__ import annotations

import importlib.util

from gemmaforge.config import RunConfig
from gemmaforge.errors import UserError
from gemmaforge.models import ResolvedModel
from gemmaforge.train.precision import resolve_precision


def preflight(config: RunConfig, base: ResolvedModel) -> str:
    """The precision to train in, after every check passed."""
    precision = resolve_precision(config.train.precision, base.family)
    _check_quantization(config)
    _check_context(config, base)
    if config.lora.bias == "all" and base.spec.multimodal:
        raise UserError(
            f"lora.bias=all would also train the {' and '.join(base.spec.towers)} towers' biases of this multimodal "
            "checkpoint, which training keeps frozen (Gemma's language model has no biases); set lora.bias: none"
        )
    if config.train.report_to == "tensorboard" and importlib.util.find_spec("tensorboard") is None:
        raise UserError("train.report_to=tensorboard needs the tensorboard package: pip install tensorboard")
    return precision


def _check_quantization(config: RunConfig) -> None:
    import torch

    if not config.model.load_in_4bit:
        return
    if not torch.cuda.is_available():
        raise UserError(
            "model.load_in_4bit (QLoRA) needs a CUDA or ROCm GPU and this machine has none; set "
            "model.load_in_4bit=false to train LoRA on the full-precision base"
        )
    if importlib.util.find_spec("bitsandbytes") is None:
        raise UserError(
            "model.load_in_4bit (QLoRA) needs bitsandbytes: pip install bitsandbytes (on ROCm, a ROCm build "
            "of bitsandbytes for your GPU's arch)"
        )


def _check_context(config: RunConfig, base: ResolvedModel) -> None:
    context = base.spec.context
    if config.train.cutoff_len > context:
        raise UserError(
            f"train.cutoff_len={config.train.cutoff_len} is longer than the model's context ({context} tokens); "
            f"set train.cutoff_len to at most {context}"
        )
