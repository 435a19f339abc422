"""What training keeps for backward on the image and sound paths, per picture and per audio token, counted from
autograd itself.

A frozen tower and projector (the default) keep nothing: no parameter of theirs takes a gradient and the pixels or
audio features need none, so their forward records no graph; a picture's or a clip's soft tokens are positions of the
text row, counted with the text. When training adapts them (lora.freeze_vision_tower / freeze_multi_modal_projector,
lora.freeze_audio_tower / freeze_audio_projector: false), a probe of the checkpoint's own class, with a one-layer
text model and the tower at its real width, wrapped as training wraps it, encodes one picture of the largest size the
image processor makes (one clip of the longest length the feature extractor takes), once with one tower layer and
once with two, while `saved_tensors_hooks` records what autograd keeps: the difference is what each tower layer
keeps, the rest what the embeddings and projector keep.
"""

from __future__ import annotations

import gc
from pathlib import Path
from typing import Any

from gemmaforge.config import RunConfig
from gemmaforge.families import Family
from gemmaforge.system.memory import return_freed_memory
from gemmaforge.train.activations import PROBE_VOCAB, uninitialised_weights

LARGEST_PICTURE = (4096, 4096)  # resized by every Gemma image processor to its largest patch grid


def image_path_trains(config: RunConfig) -> bool:
    return not (config.lora.freeze_vision_tower and config.lora.freeze_multi_modal_projector)


def audio_path_trains(config: RunConfig) -> bool:
    return not (config.lora.freeze_audio_tower and config.lora.freeze_audio_projector)


def bytes_per_picture(model_config: Any, base_dir: Path, family: Family, config: RunConfig, dtype: Any) -> float:
    """Bytes autograd keeps for one picture of the largest size (0 when the image path is frozen)."""
    if not image_path_trains(config):
        return 0.0
    from PIL import Image
    from transformers import AutoImageProcessor

    inputs = dict(AutoImageProcessor.from_pretrained(base_dir)(images=[Image.new("RGB", LARGEST_PICTURE)],
                                                                 return_tensors="pt"))
    for key in ("num_soft_tokens_per_image", "num_crops"):
        inputs.pop(key, None)
    return _per_tower(model_config, "vision_config", family, config, dtype, inputs, "get_image_features")


def bytes_per_audio_token(model_config: Any, base_dir: Path, family: Family, config: RunConfig, dtype: Any,
                          seconds: float = 30.0) -> float:
    """Bytes autograd keeps per audio token, from one clip of `seconds` (the longest the feature extractor takes: the
    Conformer's attention is local, so what it keeps grows with the clip's length); 0 when the sound path is
    frozen."""
    if not audio_path_trains(config):
        return 0.0
    import numpy as np
    from transformers import AutoFeatureExtractor

    extractor = AutoFeatureExtractor.from_pretrained(base_dir)
    clip = np.zeros(int(seconds * extractor.sampling_rate), dtype=np.float32)
    features = extractor([clip], return_tensors="pt")
    inputs = {"input_features": features["input_features"], "input_features_mask": features["input_features_mask"]}
    kept = _per_tower(model_config, "audio_config", family, config, dtype, inputs, "get_audio_features")
    mask = features["input_features_mask"][0]
    return kept / int(mask[::2][::2].sum())  # its tokens: the mask through the tower's two stride-2 convolutions


def _per_tower(model_config: Any, tower: str, family: Family, config: RunConfig, dtype: Any,
               inputs: dict[str, Any], encode: str) -> float:
    one, two = (_traced(model_config, tower, layers, family, config, dtype, inputs, encode) for layers in (1, 2))
    layers = getattr(model_config, tower).num_hidden_layers
    return one + (two - one) * (layers - 1)


def _traced(model_config: Any, tower: str, tower_layers: int, family: Family, config: RunConfig, dtype: Any,
            inputs: dict[str, Any], encode: str) -> float:
    import torch
    import transformers

    from gemmaforge.train.wrapping import wrap_for_training

    values = model_config.to_dict()
    values["text_config"].update(num_hidden_layers=1, vocab_size=PROBE_VOCAB, layer_types=None)
    for key, value in (("num_kv_shared_layers", 0), ("per_layer_config", None), ("vocab_size_per_layer_input",
                                                                                   PROBE_VOCAB)):
        if key in values["text_config"]:  # Gemma 4's: a one-layer text model shares no KV and has no overrides
            values["text_config"][key] = value
    values[tower]["num_hidden_layers"] = tower_layers
    for key in ("pad_token_id", "bos_token_id", "eos_token_id"):
        if isinstance(values["text_config"].get(key), int) and values["text_config"][key] >= PROBE_VOCAB:
            values["text_config"][key] = 0
    probe_config = type(model_config).from_dict(values)
    model_class = getattr(transformers, model_config.architectures[0])
    with uninitialised_weights():
        model = model_class._from_config(probe_config, dtype=dtype)
    for param in model.parameters():
        param.data.zero_()
    probe_run = config.model_copy(deep=True)
    probe_run.model.load_in_4bit = False
    model = wrap_for_training(model, probe_run, family, "all-linear", template_ids=None)
    body = model.get_base_model().model
    cast = {k: v.to(dtype) if v.is_floating_point() else v for k, v in inputs.items()}
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}
    held: list[Any] = []

    def keep(tensor: Any) -> int:  # as activations._saved_bytes: held to the end, counted once per storage
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in params:
            seen.setdefault(storage.data_ptr(), storage.nbytes())
        held.append(tensor)
        return len(held) - 1

    try:
        with torch.autograd.graph.saved_tensors_hooks(keep, held.__getitem__):
            getattr(body, encode)(**cast)
    finally:
        held.clear()
        del model, body
        gc.collect()
        return_freed_memory()
    return float(sum(seen.values()))
