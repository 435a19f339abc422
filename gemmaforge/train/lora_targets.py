"""Which modules LoRA wraps: the language model's linear layers, never an audio tower or a MoE router, and the
vision tower and projector only when training is told to adapt them (`with_vision`).

PEFT matches plain names (`q_proj`) anywhere in the model, so on a multimodal checkpoint they also hit
the vision and audio towers (Gemma 4's towers use `Gemma4ClippableLinear`, which PEFT refuses with a
traceback), and `all-linear` takes every linear layer of every tower. The request is resolved here
against the real module tree and handed to PEFT in a form that matches the language model alone.
"""

from __future__ import annotations

import re
from typing import Any

from torch import nn

from gemmaforge.errors import UserError
from gemmaforge.model_spec import ARCHITECTURES

# A MoE layer's router decides which experts see a token; training it is not LoRA fine-tuning.
_NEVER = re.compile(r"(^|\.)router\.")


def language_linears(model: Any) -> tuple[str, dict[str, nn.Module]]:
    """(module path of the decoder, {path: module} of its LoRA-able linear layers)."""
    decoder = model.get_decoder()
    prefix = next(name for name, module in model.named_modules() if module is decoder)
    linears: dict[str, nn.Module] = {name: module for name, module in model.named_modules()
               if name.startswith(f"{prefix}.") and isinstance(module, nn.Linear) and not _NEVER.search(name)}
    return prefix, linears


def resolve_lora_targets(model: Any, requested: list[str] | str,
                         config_key: str = "lora.target_modules") -> list[str] | str:
    """PEFT's `target_modules` for `requested` (module names or 'all-linear') on `model`. A text-only model
    gets the names themselves (its decoder is all there is); a multimodal one a pattern anchored at its
    language model. Names that match no linear layer of the language model are a UserError listing the
    names that can be targeted."""
    prefix, linears = language_linears(model)
    targetable = sorted({name.rsplit(".", 1)[-1] for name in linears})
    if requested == "all-linear":
        names = targetable
    else:
        names = list(requested)
        unmatched = [n for n in names if not any(path == n or path.endswith(f".{n}") for path in linears)]
        if unmatched:
            elsewhere = [n for n in unmatched if any(path.endswith(f".{n}") for path, _ in model.named_modules())]
            where = (f" ({', '.join(elsewhere)} only outside the language model's linear layers: a tower, projector "
                     "or router, which stay frozen)") if elsewhere else ""
            raise UserError(f"{config_key}: {', '.join(unmatched)} matches no linear layer of the language "
                            f"model{where}; targetable: {', '.join(targetable)} or 'all-linear'")
    reaches_outside = any(
        not (path.startswith(f"{prefix}.") and path in linears)
        for path, module in model.named_modules()
        if any(path == n or path.endswith(f".{n}") for n in names)
    )
    if not reaches_outside:
        return names
    alternatives = "|".join(re.escape(n) for n in names)
    return rf"{re.escape(prefix)}\.(?:.*\.)?(?:{alternatives})"


def with_vision(model: Any, targets: list[str] | str, *, tower: bool, projector: bool) -> tuple[list[str] | str,
                                                                                          list[str]]:
    """The LoRA targets widened to the vision tower's linear layers when `tower` (its frozen default lifted), and the
    projector's module path when `projector`, to be trained in full (PEFT's modules_to_save). A checkpoint without
    that part is a UserError naming the config key."""
    if not (tower or projector):
        return targets, []
    name = type(model).__name__
    architecture = ARCHITECTURES.get(name)
    for wanted, key, part in ((tower, "freeze_vision_tower", "vision_tower"),
                              (projector, "freeze_multi_modal_projector", "vision_projector")):
        if wanted and (architecture is None or getattr(architecture, part) is None):
            raise UserError(f"lora.{key}: false, but {name} has no {part.replace('_', ' ')}")
    assert architecture is not None
    saved = [architecture.vision_projector] if projector and architecture.vision_projector else []  # checked above
    if not tower:
        return targets, saved
    prefix, _ = language_linears(model)
    language = targets if isinstance(targets, str) else \
        rf"{re.escape(prefix)}\.(?:.*\.)?(?:{'|'.join(re.escape(n) for n in targets)})"
    tower_linears = [name for name, module in model.named_modules()
                     if name.startswith(f"{architecture.vision_tower}.") and isinstance(module, nn.Linear)]
    pattern = f"(?:{language})|(?:{'|'.join(re.escape(name) for name in tower_linears)})"
    return pattern, saved


def resolve_lora_parameters(model: Any, requested: list[str], config_key: str = "lora.target_parameters") -> list[str]:
    """PEFT's `target_parameters` for `requested` (parameter names such as `experts.gate_up_proj`): each must name
    expert weights of the language model. A router's weights are refused (never trained), and so is a name that
    matches nothing, with the parameters that can be targeted."""
    prefix, _ = language_linears(model)
    experts = sorted({_short(name) for name, p in model.named_parameters()
                      if name.startswith(f"{prefix}.") and p.dim() == 3 and not _NEVER.search(name)})
    for name in requested:
        if _NEVER.search(f".{name}"):
            raise UserError(f"{config_key}: {name} is a MoE router's weight; the router is never trained")
        if name not in experts and not any(e.endswith(f".{name}") for e in experts):
            targetable = ", ".join(experts) if experts else "none: this checkpoint has no experts (no MoE block)"
            raise UserError(f"{config_key}: {name} matches no expert weight of the language model; "
                            f"targetable: {targetable}")
    return list(requested)


def _short(parameter: str) -> str:
    """`model.language_model.layers.3.experts.down_proj` -> `experts.down_proj`: the name without its layer."""
    return parameter.rsplit(".", 2)[-2] + "." + parameter.rsplit(".", 1)[-1]
