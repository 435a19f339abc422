"""Merging an adapter into a copy of the base checkpoint's own files, one adapted module at a time.

The base is never loaded whole: its safetensors files are copied as they are (the kernel copies them, no
tensor passes through memory), and only the bytes of the weights the adapter changes are rewritten in place.
A merged tensor keeps its stored dtype and shape, so every file keeps its header, its key names (the Hub's
layout, whatever names transformers gives the modules on load) and its index. Peak memory is the adapter plus
the largest group of weights one adapted module touches (the embedding for trained chat-marker rows), each
summed in fp32 and rounded once: the bytes `merge_and_unload` gives on a whole model in fp32.

The adapter is attached to the model built on the meta device, so PEFT itself decides what each adapted
module does to its base weights (LoRA on linear layers and on expert tensors, DoRA, trained token rows,
modules trained in full); this module only fetches those weights from the files and writes back the result."""

from __future__ import annotations

import json
import shutil
import struct
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

from gemmaforge.errors import UserError
from gemmaforge.export.gguf import weight_files
from gemmaforge.system.memory import return_freed_memory

INDEX = "model.safetensors.index.json"


@dataclass
class _Group:
    """Adapted modules that share base weights (a tied embedding's two wrappers), merged together."""

    tuners: list[Any] = field(default_factory=list)
    params: dict[int, Any] = field(default_factory=dict)  # id -> the meta parameter standing for a base weight


def merge_into_copy(base_dir: Path, adapter_dir: Path, model_class: Any, dtype: Any, target: Path,
                    num_labels: int | None = None) -> dict[str, int]:
    """Copy `base_dir`'s safetensors files (and index) into `target` with `adapter_dir` merged into them;
    `model_class` and `dtype` as the base is loaded for training (a sequence classifier: with `num_labels`). A module
    trained whole that the base does not store (a reward model's score head) is written to a file of its own, which
    the index names. Returns the model's parameter count and the number of stored tensors rewritten or added."""
    import torch

    stored = weight_files(base_dir)
    files = sorted(set(stored.values()))
    model, names = _adapted_meta_model(base_dir, adapter_dir, model_class, dtype, num_labels)
    groups = _groups(model, names)
    located, new = _locate(stored, model, groups, names)
    for path in files:
        shutil.copyfile(path, target / path.name)
    if (base_dir / INDEX).is_file():
        shutil.copyfile(base_dir / INDEX, target / INDEX)
    written = 0
    for group in (g for g in groups if not g.params.keys() & new):
        keys = {pid: located[pid] for pid in group.params}
        owners = _owners(model, group.params)
        stored_dtypes = {}
        for pid, (path, key) in keys.items():
            tensor = _read(path, key)
            stored_dtypes[pid] = tensor.dtype
            _bind(owners[pid], tensor)
        _merge_group(group.tuners)
        for pid, (path, key) in keys.items():
            merged = _value(owners[pid], group.tuners).to(stored_dtypes[pid])
            _write_in_place(target / path.name, key, merged)
            written += 1
        for pid in keys:  # back to meta: the group's memory goes before the next one is read
            _bind(owners[pid], torch.empty_like(group.params[pid], device="meta"))
        return_freed_memory()
    if new:
        added = {names[pid][0]: _value(_owners(model, {pid: None})[pid], group.tuners).to(dtype).contiguous()
                 for group in groups for pid in group.params if pid in new}
        _add_tensors(target, added, stored)
        written += len(added)
    return {"parameters": sum(p.numel() for p in model.get_base_model().parameters()), "tensors_merged": written}


def _adapted_meta_model(base_dir: Path, adapter_dir: Path, model_class: Any, dtype: Any,
                        num_labels: int | None = None) -> tuple[Any, dict]:
    """The base built on the meta device with the adapter attached and its weights loaded for real, and the
    module-space names of every base parameter (tied ones have several)."""
    import torch
    from peft import PeftConfig, PeftModel
    from peft.utils import load_peft_weights, set_peft_model_state_dict
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(base_dir)
    if num_labels is not None:
        config.num_labels = num_labels
    with torch.device("meta"):
        base = model_class._from_config(config, dtype=dtype)
    names: dict[int, list[str]] = {}
    for name, param in base.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(name)
    adapter_config = PeftConfig.from_pretrained(str(adapter_dir))
    if num_labels is not None:  # a causal LM's adapter on a sequence classifier: no generation to wrap
        adapter_config.task_type = None
    model = PeftModel.from_pretrained(base, adapter_dir, config=adapter_config, low_cpu_mem_usage=True)
    # PEFT leaves the adapter on its base layers' device (meta here): give it real storage, then its values.
    for module in model.modules():
        for attr, param in list(module._parameters.items()):
            if param is not None and param.is_meta and id(param) not in names:
                module._parameters[attr] = torch.nn.Parameter(torch.empty_like(param, device="cpu"),
                                                              requires_grad=False)
    # torch's _IncompatibleKeys (PEFT annotates a bare namedtuple)
    result: Any = set_peft_model_state_dict(model, load_peft_weights(str(adapter_dir), device="cpu"))
    if result.unexpected_keys:
        raise UserError(f"{adapter_dir}: adapter weights that match no module of the base "
                        f"({', '.join(result.unexpected_keys[:3])}): it was trained on another model")
    return model, names


def _tuners(model: Any) -> Iterator[tuple[str, Any]]:
    """The outermost adapted modules: LoRA layers (nested ones for several expert tensors sit inside one),
    trained token rows, modules trained in full."""
    from peft.tuners.tuners_utils import BaseTunerLayer
    from peft.utils.other import AuxiliaryTrainingWrapper

    outer: list[str] = []
    for name, module in model.named_modules():
        if isinstance(module, BaseTunerLayer | AuxiliaryTrainingWrapper) and \
                not any(name.startswith(prefix + ".") for prefix in outer):
            outer.append(name)
            yield name, module


def _groups(model: Any, names: dict[int, list[str]]) -> list[_Group]:
    """The adapted modules, joined where they share a base weight."""
    groups: list[_Group] = []
    for _, tuner in _tuners(model):
        params = {id(p): p for p in tuner.parameters() if id(p) in names}
        joined = [g for g in groups if g.params.keys() & params.keys()]
        group = _Group([tuner], params)
        for other in joined:
            groups.remove(other)
            group.tuners += other.tuners
            group.params |= other.params
        groups.append(group)
    return groups


def _locate(files: dict[str, Path], model: Any, groups: list[_Group],
            names: dict[int, list[str]]) -> tuple[dict[int, tuple[Path, str]], set[int]]:
    """Where each adapted base weight is stored: (file, key), from the checkpoint's key -> file map; and the weights
    of modules trained whole that the checkpoint does not store (new ones: a reward model's head). Checkpoint keys
    are mapped to module names by transformers' own load-time renamings (the Hub's `language_model.model.*` is
    `model.language_model.*`)."""
    from peft.utils.other import ModulesToSaveWrapper
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightConverter, WeightRenaming, rename_source_key

    base = model.get_base_model()
    transforms = get_model_conversion_mapping(base)
    renamings = cast(list[WeightRenaming], [t for t in transforms if not isinstance(t, WeightConverter)])
    converters = [t for t in transforms if isinstance(t, WeightConverter)]
    meta_state = base.state_dict()
    stored: dict[str, tuple[Path, str]] = {}
    for key, path in files.items():
        module_key, converted = rename_source_key(key, renamings, converters, base.base_model_prefix, meta_state)
        stored[module_key] = (path, key) if converted is None else (path, "")
    located: dict[int, tuple[Path, str]] = {}
    new: set[int] = set()
    for group in groups:
        for pid in group.params:
            found = [stored[name] for name in names[pid] if name in stored]
            if not found and all(isinstance(tuner, ModulesToSaveWrapper) for tuner in group.tuners):
                new.add(pid)
                continue
            if not found or not found[0][1]:
                raise UserError(f"the adapter changes {names[pid][0]}, which the checkpoint does not store "
                                "as one tensor: this checkpoint cannot be merged in place")
            located[pid] = found[0]
    return located, new


def _add_tensors(target: Path, tensors: dict[str, Any], stored: dict[str, Path]) -> None:
    """`tensors` in a file of their own in `target`, named by the index (transformers reads a lone
    model.safetensors before any index: a base stored whole becomes the first of two shards)."""
    from safetensors.torch import save_file

    index_path = target / INDEX
    if index_path.is_file():
        index, added = json.loads(index_path.read_text(encoding="utf-8")), "model-trained-modules.safetensors"
    else:
        first, added = "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"
        (target / "model.safetensors").rename(target / first)
        index = {"metadata": {}, "weight_map": dict.fromkeys(stored, first)}
    save_file(tensors, target / added, metadata={"format": "pt"})
    index["weight_map"].update(dict.fromkeys(tensors, added))
    index_path.write_text(json.dumps(index, indent=2) + "\n", encoding="utf-8")


def _owners(model: Any, params: dict[int, Any]) -> dict[int, list[tuple[Any, str]]]:
    """Every (module, attribute) slot holding each parameter: a tied weight sits in two modules."""
    owners: dict[int, list[tuple[Any, str]]] = {pid: [] for pid in params}
    for module in model.modules():
        for attr, param in module._parameters.items():
            if param is not None and id(param) in owners:
                owners[id(param)].append((module, attr))
    return owners


def _bind(slots: list[tuple[Any, str]], tensor: Any) -> None:
    """Put `tensor` in every slot of one parameter (a tied weight stays one object in all of them)."""
    import torch

    param = torch.nn.Parameter(tensor, requires_grad=False)
    for module, name in slots:
        module._parameters[name] = param


def _merge_group(tuners: list[Any]) -> None:
    """Each LoRA layer's weight summed in fp32 and rounded once to its dtype; token rows copied in."""
    import torch
    from peft.tuners.lora import LoraLayer
    from peft.tuners.tuners_utils import BaseTunerLayer

    for tuner in tuners:
        for module in tuner.modules():
            if isinstance(module, LoraLayer):
                weight = getattr(module.get_base_layer(), getattr(module, "parameter_name", "weight"))
                dtype = weight.dtype
                weight.data = weight.data.to(torch.float32)
                module.merge()
                weight.data = weight.data.to(dtype)
            elif isinstance(module, BaseTunerLayer) and not _tied_to_merged_weight(module):
                module.merge()


def _tied_to_merged_weight(module: Any) -> bool:
    """A tied output layer's token rows: its adapter's rows go into the very weight it shares, merged already
    (merging again would only copy the embedding once more)."""
    tied = getattr(module, "tied_adapter", None)
    return tied is not None and tied.get_base_layer().weight is module.get_base_layer().weight


def _value(slots: list[tuple[Any, str]], tuners: list[Any]) -> Any:
    """The merged value of one base parameter: the trained copy where a module was trained in full."""
    from peft.utils.other import ModulesToSaveWrapper

    module, attr = slots[0]
    param = module._parameters[attr]
    for tuner in tuners:
        if isinstance(tuner, ModulesToSaveWrapper):
            for name, original in tuner.original_module.named_parameters():
                if original is param:
                    return tuner.modules_to_save[tuner.active_adapters[0]].get_parameter(name).detach()
    return param.detach()


def _read(path: Path, key: str) -> Any:
    from safetensors import safe_open

    with safe_open(path, framework="pt") as f:
        return f.get_tensor(key)


def _write_in_place(path: Path, key: str, tensor: Any) -> None:
    """Overwrite `key`'s bytes in a safetensors file with `tensor` (same dtype and shape)."""
    import torch

    with path.open("r+b") as f:
        (header_size,) = struct.unpack("<Q", f.read(8))
        entry = json.loads(f.read(header_size))[key]
        start, end = entry["data_offsets"]
        data = tensor.contiguous().reshape(-1).view(torch.uint8).numpy()
        if data.nbytes != end - start:
            raise ValueError(f"{path.name}: {key} merged into {data.nbytes} bytes, stored in {end - start}")
        f.seek(8 + header_size + start)
        f.write(data)  # the array's own buffer: no copy of a large embedding
