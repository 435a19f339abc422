"""Rows on different LoRA adapters decoded in one forward.

A LoRA fleet's requests would otherwise take turns, one forward per adapter at each step. Here every plain LoRA
adapter (linear layers, with or without trained token rows) is stacked per layer: slot 0 holds zeros (the base
model), slot i adapter i's A and B, B already scaled, ranks padded with zeros. A forward over mixed rows gathers each
row's A and B by its slot, a tensor that stays on the device, and adds x A^T B^T per row with two batched products:
no host round trip, no per-adapter sub-batches, the same cost for one adapter or many.

PEFT's own mixed batches (`adapter_names=`) index sub-batches with Python lists in every layer, a copy from pageable
memory that waits for the GPU each time, and pass whole-module adapters through for all rows; an adapter that is not
plain LoRA (DoRA, LoRA on parameters or embeddings, a LoRA bias, whole modules saved) keeps batches of its own.
"""

from __future__ import annotations

import types
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from peft.tuners.lora.layer import Linear as LoraLinear
from peft.tuners.trainable_tokens.layer import TrainableTokensLayer
from peft.tuners.tuners_utils import BaseTunerLayer
from peft.utils.other import ModulesToSaveWrapper

from gemmaforge.train.template_tokens import trained_tokens


@dataclass(frozen=True)
class MixedRows:
    """The rows of one forward: each row's slot (B,) on the device, and for each adapter among them its row mask."""

    slots: torch.Tensor
    masks: dict[str, torch.Tensor]  # adapter -> (B, 1, 1) bool


class AdapterMix:
    """The plain LoRA adapters of `peft` (a PeftModel) stacked per layer; refresh() after every load or unload."""

    def __init__(self, peft: Any):
        self.peft = peft
        self.slots: dict[str, int] = {}  # adapter -> its slot, kept while it is loaded (running rows hold it)
        self.active: MixedRows | None = None  # set by rows() for one forward

    def unmixable(self, adapter: str) -> str | None:
        """Why `adapter` cannot share a forward with other adapters, or None."""
        for module in self.peft.modules():
            if isinstance(module, TrainableTokensLayer):
                continue  # trained token rows: applied per row (trained_tokens)
            if isinstance(module, ModulesToSaveWrapper) and adapter in module.modules_to_save:
                return "a whole module trained with it (modules_to_save)"
            if not isinstance(module, BaseTunerLayer) or not any(
                    adapter in getattr(module, held, {}) for held in module.adapter_layer_names):
                continue
            if type(module) is not LoraLinear:
                return f"its {type(module).__name__} layers"
            if adapter in module.lora_variant:
                return f"a LoRA variant ({type(module.lora_variant[adapter]).__name__})"
            if module.lora_bias.get(adapter):
                return "a LoRA bias"
        return None

    def refresh(self, adapters: list[str]) -> None:
        """Slots for the mixable ones among `adapters` (the loaded ones), every LoRA layer's stack rebuilt."""
        mixable = [name for name in adapters if self.unmixable(name) is None]
        self.slots = {name: slot for name, slot in self.slots.items() if name in mixable}
        for name in mixable:
            if name not in self.slots:
                self.slots[name] = min(set(range(1, len(mixable) + 1)) - set(self.slots.values()))
        width = max(self.slots.values(), default=0) + 1
        for module in self.peft.modules():
            if isinstance(module, LoraLinear):
                vars(module)["_gemmaforge_stack"] = self._stack(module, width)  # derived: a plain attribute
                _patch(module, _mixed_lora_forward, self)
            elif isinstance(module, TrainableTokensLayer):
                _patch(module, _mixed_tokens_forward, self, attribute="forward_adapters")

    def _stack(self, layer: Any, width: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        names = [name for name in self.slots if name in layer.lora_A]
        if not names:
            return None
        rank = max(layer.r[name] for name in names)
        weight = layer.lora_A[names[0]].weight
        a = weight.new_zeros((width, rank, layer.in_features))
        b = weight.new_zeros((width, layer.out_features, rank))
        for name in names:
            r, slot = layer.r[name], self.slots[name]
            a[slot, :r] = layer.lora_A[name].weight.detach()
            b[slot, :, :r] = layer.lora_B[name].weight.detach() * layer.scaling[name]
        return a, b

    @contextmanager
    def rows(self, slots: torch.Tensor, adapters: set[str]) -> Iterator[None]:
        """Within: forwards compute row i with the adapter in slots[i] (0: the base model)."""
        masks = {name: (slots == self.slots[name])[:, None, None] for name in adapters}
        self.active = MixedRows(slots, masks)
        try:
            yield
        finally:
            self.active = None


def _patch(module: Any, forward: Any, mix: AdapterMix, attribute: str = "forward") -> None:
    """module.<attribute> = forward, which calls the one it replaces outside rows(); again after PEFT or
    use_sparse_template_tokens set their own (each adapter load does)."""
    module._gemmaforge_mix = mix
    current = getattr(module, attribute)
    if getattr(current, "__func__", None) is not forward:
        module._gemmaforge_plain = current  # PEFT's own, or the sparse token forward
        setattr(module, attribute, types.MethodType(forward, module))


def _mixed_lora_forward(self: Any, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    rows = self._gemmaforge_mix.active
    if rows is None:
        return self._gemmaforge_plain(x, *args, **kwargs)
    result = self.base_layer(x, *args, **kwargs)
    if self._gemmaforge_stack is None:  # no mixable adapter adapts this layer
        return result
    a, b = (stacked[rows.slots] for stacked in self._gemmaforge_stack)  # (B, r, in), (B, out, r)
    low = torch.bmm(x.to(a.dtype), a.transpose(1, 2))  # (B, T, r)
    return result + torch.bmm(low, b.transpose(1, 2)).to(result.dtype)


def _mixed_tokens_forward(self: Any, x: torch.Tensor, active_adapters: Any, *args: Any, **kwargs: Any
                          ) -> torch.Tensor:
    rows = self._gemmaforge_mix.active
    if rows is None:
        return self._gemmaforge_plain(x, active_adapters, *args, **kwargs)
    result = self.base_layer(x, *args, **kwargs)
    for name, mask in rows.masks.items():
        if name in self.trainable_tokens_delta:
            result = trained_tokens(self, x, result, name, mask)
    return result
