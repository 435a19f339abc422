"""PEFT LoRA adapter -> a GGUF LoRA adapter that llama.cpp (and Ollama's ADAPTER) applies to the base GGUF.

Written as llama.cpp's `convert_lora_to_gguf.py` writes it: general.type "adapter", adapter.type "lora",
adapter.lora.alpha, and for each adapted weight `<gguf name>.lora_a` (r x in) and `.lora_b` (out x r) in
f16. llama.cpp scales by alpha / r; an rsLoRA adapter (alpha / sqrt(r)) is written with alpha * sqrt(r),
which gives the same scale. DoRA, fully trained modules and trained token rows have no GGUF adapter form:
those runs are merged instead.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import gguf
import numpy as np
from safetensors import safe_open

from gemmaforge.errors import UserError
from gemmaforge.export.adapter_limits import require_plain_lora
from gemmaforge.export.gguf_shards import gguf_file
from gemmaforge.model_spec import ModelSpec, text_weight_name

_PREFIX = "base_model.model."


def write_adapter_gguf(adapter_dir: Path, out_path: Path, spec: ModelSpec) -> Path:
    """The adapter of a model of `spec`; on a multimodal checkpoint it adapts the text model llama.cpp loads."""
    config = json.loads((adapter_dir / "adapter_config.json").read_text(encoding="utf-8"))
    _check_supported(config, adapter_dir)
    family = spec.family
    arch = next(a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == family.gguf_arch)
    name_map = gguf.get_tensor_name_map(arch, spec.text["num_hidden_layers"])
    pairs: dict[str, dict[str, np.ndarray]] = {}
    with safe_open(adapter_dir / "adapter_model.safetensors", framework="pt") as f:
        for key in f.keys():  # noqa: SIM118 (safe_open handles are not iterable)
            for part, suffix in (("lora_a", ".lora_A.weight"), ("lora_b", ".lora_B.weight")):
                if key.endswith(suffix):
                    hf_name = key.removeprefix(_PREFIX).removesuffix(suffix) + ".weight"
                    pairs.setdefault(text_weight_name(spec, hf_name) or hf_name, {})[part] = \
                        f.get_tensor(key).float().numpy()
    if not pairs:
        raise UserError(f"{adapter_dir}: no LoRA weights (lora_A / lora_B) in adapter_model.safetensors")
    r = config["r"]
    alpha = config["lora_alpha"] * (math.sqrt(r) if config.get("use_rslora") else 1.0)

    out_path.parent.mkdir(parents=True, exist_ok=True)
    with gguf_file(out_path, family.gguf_arch) as writer:
        writer.add_type(gguf.GGUFType.ADAPTER)
        writer.add_string(gguf.Keys.Adapter.TYPE, "lora")
        writer.add_float32(gguf.Keys.Adapter.LORA_ALPHA, float(alpha))
        writer.add_quantization_version(gguf.GGML_QUANT_VERSION)  # as convert_lora_to_gguf.py writes it
        for base, parts in sorted(pairs.items()):
            gguf_name = name_map.get_name(base, try_suffixes=(".weight",))
            if gguf_name is None:
                raise UserError(f"{adapter_dir}: adapted weight {base} has no GGUF name for {family.gguf_arch}")
            for part in ("lora_a", "lora_b"):
                writer.add_tensor(f"{gguf_name}.{part}", parts[part].astype(np.float16))
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
    return out_path


def _check_supported(config: dict, adapter_dir: Path) -> None:
    require_plain_lora(
        config, adapter_dir, dora=", which llama.cpp cannot apply as an adapter",
        other=", which a GGUF adapter cannot carry",
        instead=f"export the merged model instead (`gemmaforge merge {adapter_dir.parent}`, then `export gguf`)",
    )
