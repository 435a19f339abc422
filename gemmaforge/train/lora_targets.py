"""Which modules LoRA wraps: the language model's linear layers, never a MoE router, and a vision or audio tower and
its projector only when training is told to adapt them (`with_towers`).

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


# (config key, Architecture attribute, what it is): the tower and projector parts training may adapt
_TOWERS = (("freeze_vision_tower", "vision_tower", "vision tower"),
           ("freeze_audio_tower", "audio_tower", "audio tower"))
_PROJECTORS = (("freeze_multi_modal_projector", "vision_projector", "vision projector"),
               ("freeze_audio_projector", "audio_projector", "audio projector"))


def adapted_parts(lora: Any) -> set[str]:
    """The `lora.freeze_*` keys of the tower and projector parts a run adapts (set to false)."""
    return {key for key, _, _ in (*_TOWERS, *_PROJECTORS) if not getattr(lora, key)}


def with_towers(model: Any, targets: list[str] | str, adapted: set[str]) -> tuple[list[str] | str, list[str]]:
    """The LoRA targets widened to the linear layers of each tower whose `lora.freeze_*` key is in `adapted` (its
    frozen default lifted), and the module paths of the projectors so named, to be trained in full (PEFT's
    modules_to_save). A checkpoint without that part is a UserError naming the config key."""
    if not adapted:
        return targets, []
    name = type(model).__name__
    architecture = ARCHITECTURES.get(name)
    modules = dict(model.named_modules())
    paths: dict[str, str] = {}
    for key, part, what in (*_TOWERS, *_PROJECTORS):
        if key in adapted:
            path = getattr(architecture, part) if architecture else None
            if path is None or path not in modules:
                raise UserError(f"lora.{key}: false, but {name} has no {what}")
            paths[key] = path
    saved = [paths[key] for key, _, _ in _PROJECTORS if key in paths]
    towers = [paths[key] for key, _, _ in _TOWERS if key in paths]
    if not towers:
        return targets, saved
    prefix, _ = language_linears(model)
    language = targets if isinstance(targets, str) else \
        rf"{re.escape(prefix)}\.(?:.*\.)?(?:{'|'.join(re.escape(n) for n in targets)})"
    tower_linears = [name for name, module in modules.items()
                     if any(name.startswith(f"{tower}.") for tower in towers) and isinstance(module, nn.Linear)]
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
