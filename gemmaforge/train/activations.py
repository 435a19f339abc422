"""What training keeps for backward, counted from autograd itself.

A probe with two decoder layers of each kind the model has (sliding and full attention), at the model's
real width and a small vocabulary, is wrapped exactly as training wraps a model (`wrap_for_training`) and
runs one training forward on a packed row while `saved_tensors_hooks` records every tensor autograd keeps.
The second layer of a kind gives what each layer adds; the first also holds what its kind shares (rotary
tables, a mask). Counting at two lengths gives bytes per token and per token squared (attention
probabilities of eager attention, banded masks of rows longer than the sliding window, probed with a
narrow window); forwards with gradient checkpointing and with one more layer per kind give what a
checkpointed layer keeps and what grows outside the layers with their number. The probe's weights are
allocated but never initialised, so even a 27B model costs a few seconds. No guessing of which tensors a
library version keeps.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from gemmaforge.chat.conversation import IGNORE_INDEX
from gemmaforge.config import RunConfig
from gemmaforge.families import Family
from gemmaforge.system.memory import return_freed_memory

PROBE_LENGTHS = (64, 128)
PROBE_VOCAB = 512
# a smaller probe model is left to the garbage collector: a full collection takes ~0.3 s in a process holding a
# training's objects (four probes a plan), for a few MB handed back
COLLECTED_PROBE_BYTES = 64 * 2**20


@dataclass(frozen=True)
class Cost:
    """Bytes autograd keeps for a row of T tokens: linear * T + square * T^2."""

    linear: float
    square: float

    def bytes(self, tokens: int, row: int) -> float:
        """For `tokens` tokens in rows of `row` tokens."""
        return tokens * (self.linear + self.square * row)


@dataclass(frozen=True)
class Regime:
    """What the layers keep while rows fit in the sliding window, or once they are longer than it (the attention
    then takes a banded row x row mask, which SDPA keeps for backward)."""

    layers: dict[str, Cost]  # each layer of a kind after the first of that kind
    # outside the layers, plus what the first layer of each kind keeps for all of them (rotary tables, a mask)
    shared: Cost

    def total(self, counts: dict[str, int], tokens: int, row: int) -> float:
        return self.shared.bytes(tokens, row) + sum(n * self.layers[kind].bytes(tokens, row)
                                                    for kind, n in counts.items())


@dataclass(frozen=True)
class ActivationProfile:
    counts: dict[str, int]  # layer kind -> how many layers of that kind
    within: Regime
    beyond: Regime | None  # None without sliding layers
    window: int | None
    checkpointed_per_layer: float  # per token, with gradient checkpointing: the layer's input
    outside_per_token: float  # embedding, final norm and the fused loss's gradient, kept with checkpointing too
    # outside the layers but one share per layer (Gemma 4's per-layer input embeddings), for each layer the
    # model has beyond the probe's
    outside_per_layer: float
    probe_layers: int

    def regime(self, row: int) -> Regime:
        return self.beyond if self.beyond and self.window and row > self.window else self.within

    def total(self, tokens: int, row: int, checkpointing: bool) -> float:
        layers = sum(self.counts.values())
        more = tokens * self.outside_per_layer * (layers - self.probe_layers)
        if checkpointing:
            return tokens * (self.checkpointed_per_layer * layers + self.outside_per_token) + more
        return self.regime(row).total(self.counts, tokens, row) + more

    def largest_layer(self, tokens: int, row: int) -> float:
        return max(cost.bytes(tokens, row) for cost in self.regime(row).layers.values())


def text_config(model_config: Any) -> Any:
    """The language model's config (a multimodal checkpoint's text_config), as transformers finds it."""
    return model_config.get_text_config()


def layer_kinds(model_config: Any) -> list[str]:
    """Each decoder layer's kind (sliding or full attention); one kind for families without layer_types."""
    cfg = text_config(model_config)
    return list(getattr(cfg, "layer_types", None) or ["decoder"] * cfg.num_hidden_layers)


def profile_activations(model_config: Any, family: Family, config: RunConfig, dtype: Any) -> ActivationProfile:
    kinds = layer_kinds(model_config)
    distinct = list(dict.fromkeys(kinds))
    window = getattr(text_config(model_config), "sliding_window", None)
    # each kind twice: the first layer of a kind keeps what its kind shares (and the first layer's input is the
    # embedding's output, kept outside it); the second gives what each further layer adds
    probe_kinds = [*distinct, *distinct]
    # within the window: every probe row fits in it (as rows up to the window do in the real model)
    within_config = _probe_config(model_config, probe_kinds, max(window or 0, PROBE_LENGTHS[-1]))
    short, long_ = _traced(within_config, family, config, dtype, False, PROBE_LENGTHS)
    within = _regime(short, long_, distinct)
    beyond = None
    if window and any("sliding" in kind for kind in distinct):  # every probe row longer than the window
        narrow = _probe_config(model_config, probe_kinds, PROBE_LENGTHS[0] // 2)
        narrow_short, narrow_long = _traced(narrow, family, config, dtype, False, PROBE_LENGTHS)
        beyond = _regime(narrow_short, narrow_long, distinct)
    t1 = PROBE_LENGTHS[0]
    # one more layer of each kind: what grows outside the layers with their number
    (third,) = _traced(_probe_config(model_config, [*probe_kinds, *distinct], max(window or 0, PROBE_LENGTHS[-1])),
                       family, config, dtype, False, PROBE_LENGTHS[:1])
    per_layer = max(0.0, (third[None] - short[None]) / len(distinct) / t1)
    # last: with gradient checkpointing some of the probe's memory outlives it (6 GB at Gemma 4 26B-A4B's width,
    # held by torch), so no larger probe comes after it
    (checkpointed,) = _traced(within_config, family, config, dtype, True, PROBE_LENGTHS[:1])
    # checkpointed layers keep their input, saved as they are entered (outside any layer's hooks); every
    # layer's input is the same hidden state, so each layer keeps an equal share
    kept = max(0.0, (sum(checkpointed.values()) - short[None]) / len(probe_kinds) / t1)
    return ActivationProfile({kind: kinds.count(kind) for kind in distinct}, within, beyond, window, kept,
                             short[None] / t1, per_layer, len(probe_kinds))


def _regime(short: dict[int | None, float], long_: dict[int | None, float], distinct: list[str]) -> Regime:
    n = len(distinct)

    def shared(traced: dict[int | None, float]) -> float:
        return traced[None] + sum(traced[i] - traced[n + i] for i in range(n))

    return Regime({kind: _fit(short[n + i], long_[n + i]) for i, kind in enumerate(distinct)},
                  _fit(shared(short), shared(long_)))


def _fit(short: float, long_: float) -> Cost:
    """linear * T + square * T^2 through the two probe lengths."""
    t1, t2 = PROBE_LENGTHS
    square = max(0.0, (long_ / t2 - short / t1) / (t2 - t1))
    return Cost(short / t1 - square * t1, square)


def _traced(probe_config: Any, family: Family, config: RunConfig, dtype: Any, checkpointing: bool,
            lengths: tuple[int, ...]) -> list[dict[int | None, float]]:
    """What one probe model keeps at each length."""
    model = _probe_model(probe_config, family, config, dtype, checkpointing)
    traced = [_saved_bytes(model, n) for n in lengths]
    held = sum(p.numel() * p.element_size() for p in model.parameters())
    del model  # one probe model at a time (4 GB at Gemma 4 31B's width): PEFT's wrappers hold reference
    if held >= COLLECTED_PROBE_BYTES:  # cycles, so the model goes with a collection, and its memory back to the
        gc.collect()  # system after it
        return_freed_memory()
    return traced


def _probe_config(model_config: Any, kinds: list[str], window: int) -> Any:
    """The model's config with these layers, this sliding window and a small vocabulary, built anew (configs
    such as Gemma 4's derive per-layer settings from layer_types when they are made)."""
    cfg = text_config(model_config)
    values = cfg.to_dict()
    values.update(num_hidden_layers=len(kinds), vocab_size=PROBE_VOCAB)
    if values.get("layer_types"):
        original = values["layer_types"]
        values["layer_types"] = kinds
        overrides = values.get("per_layer_config")  # Gemma 4: full-attention layers' head_dim, by layer index
        if overrides:
            firsts = [str(original.index(kind)) for kind in kinds]
            values["per_layer_config"] = {i: overrides[first] for i, first in enumerate(firsts) if first in overrides}
    if values.get("num_kv_shared_layers"):  # Gemma 4 layers reusing earlier layers' KV are counted as computing
        values["num_kv_shared_layers"] = 0  # their own: a slight overestimate
    if values.get("sliding_window"):
        values["sliding_window"] = window
    if "vocab_size_per_layer_input" in values:  # Gemma 3n/4's per-layer embeddings
        values["vocab_size_per_layer_input"] = PROBE_VOCAB
    for key in ("pad_token_id", "bos_token_id", "eos_token_id"):
        if isinstance(values.get(key), int) and values[key] >= PROBE_VOCAB:
            values[key] = 0
    # the text model alone: text batches never run a multimodal checkpoint's towers
    return type(cfg).from_dict(values)


@contextlib.contextmanager
def uninitialised_weights() -> Iterator[None]:
    """Skip weight initialisation: the probe's values never matter, only what autograd keeps."""
    try:
        from transformers.initialization import no_init_weights
    except ImportError:  # older transformers
        from transformers.modeling_utils import no_init_weights  # type: ignore[attr-defined,no-redef]
    with no_init_weights():
        yield


def _probe_model(probe_config: Any, family: Family, config: RunConfig, dtype: Any, checkpointing: bool) -> Any:
    from transformers import AutoModelForCausalLM

    from gemmaforge.train.wrapping import wrap_for_training

    probe_run = config.model_copy(deep=True)
    probe_run.model.load_in_4bit = False  # the probe runs on the CPU; NF4 weights keep the same activations
    probe_run.lora.modules_to_save = None  # full-vocabulary modules: counted with the weights, not here
    # the probe is the text model alone: an adapted tower or projector is not in it
    probe_run.lora.freeze_vision_tower = probe_run.lora.freeze_multi_modal_projector = True
    probe_run.lora.freeze_audio_tower = probe_run.lora.freeze_audio_projector = True
    with uninitialised_weights():
        model = AutoModelForCausalLM.from_config(probe_config, dtype=dtype,
                                                 attn_implementation=family.attn_implementation)
    for param in model.parameters():
        param.data.zero_()  # uninitialised memory may hold NaNs, whose arithmetic is slow on some CPUs
    targets = config.lora.target_modules or list(family.default_lora_targets)
    model = wrap_for_training(model, probe_run, family, targets, template_ids=None)
    if checkpointing:
        # transformers 5 renamed gradient_checkpointing_enable (the old name warns); call the name this one has
        if hasattr(model, "activation_checkpointing_enable"):
            model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.enable_input_require_grads()
    model.train()
    return model


def _saved_bytes(model: Any, tokens: int) -> dict[int | None, float]:
    """Bytes of the distinct storages autograd keeps during one training forward of a packed row of `tokens`
    (every position supervised), by decoder layer index (None: outside the layers). Parameters are not counted."""
    import torch

    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, tuple[int | None, int]] = {}
    current: list[int | None] = [None]
    # What autograd saves is held here until the forward is counted, and the graph holds only its index: a pack
    # hook that returns the tensor makes an op's saved output hold its own graph, a cycle through C++ that the
    # garbage collector cannot see, and every probe model stayed in memory (16 GB after four at 27B width).
    # Held to the end, no storage is freed and reused under an address counted already.
    held: list[Any] = []

    def keep(tensor: Any) -> int:
        if isinstance(tensor, torch.Tensor) and tensor.device.type != "meta":
            storage = tensor.untyped_storage()
            if storage.data_ptr() not in params and storage.data_ptr() not in seen:
                seen[storage.data_ptr()] = (current[0], storage.nbytes())
        held.append(tensor)
        return len(held) - 1

    layers = _decoder_layers(model)
    handles = []
    for i, layer in enumerate(layers):
        handles.append(layer.register_forward_pre_hook(lambda *_, i=i: current.__setitem__(0, i)))
        handles.append(layer.register_forward_hook(lambda *_: current.__setitem__(0, None)))
    ids = torch.randint(1, PROBE_VOCAB, (1, tokens))
    labels = ids.clone()
    labels[0, 0] = IGNORE_INDEX  # as a real row: the first token is never a target
    try:
        with torch.autograd.graph.saved_tensors_hooks(keep, held.__getitem__):
            model(input_ids=ids, labels=labels, position_ids=torch.arange(tokens)[None])
    finally:
        held.clear()
        for handle in handles:
            handle.remove()
    totals: dict[int | None, float] = {None: 0.0, **{i: 0.0 for i in range(len(layers))}}
    for layer, nbytes in seen.values():
        totals[layer] += nbytes
    return totals


def _decoder_layers(model: Any) -> Any:
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    body = base.model
    return getattr(body, "language_model", body).layers
