"""Merged multimodal Gemma directory -> the projector GGUF (`mmproj-f16.gguf`) that llama.cpp's mtmd and
Ollama load beside the text GGUF.

Writes what llama.cpp's own converter writes with `convert_hf_to_gguf.py DIR --mmproj --outtype f16`
(`Gemma3VisionModel`, `Gemma4VisionAudioModel`, `Gemma4UnifiedVisionAudioModel` over `MmprojModel`), key for
key and tensor for tensor: architecture "clip", the towers' sizes, image normalization from the processor
files, and each tower tensor under its clip name, type and layout. One file holds every tower: the SigLIP
vision tower and its projector for Gemma 3; the vision tower and, for E2B/E4B, the audio tower with their
projectors for Gemma 4; the vision and audio input projections of Gemma 4 Unified (which has no towers).
Like the text writer (gguf.py) it streams: tensors are planned from the safetensors headers, then loaded,
converted and written one at a time, and the file appears at `out_path` only once complete.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch
from safetensors import safe_open

from gemmaforge.errors import UserError
from gemmaforge.export.gguf import check_room, weight_files
from gemmaforge.export.gguf_shards import gguf_file
from gemmaforge.model_spec import ModelSpec, read_spec

QType = gguf.GGMLQuantizationType
Transform = Callable[[torch.Tensor], torch.Tensor]

_CLIP = gguf.MODEL_ARCH_NAMES[gguf.MODEL_ARCH.MMPROJ]
# the converter's keys for a tower's layer count, in the order it tries them
_BLOCK_KEYS = ("n_layers", "num_hidden_layers", "n_layer", "num_layers", "depth", "layers", "encoder_layers",
               "vt_num_hidden_layers")
# suffixes under which the converter maps Gemma 4 tower tensors (ClippableLinear's clamp bounds included)
_GEMMA4_SUFFIXES = (".weight", ".bias", ".input_max", ".input_min", ".output_max", ".output_min")
_METADATA_ALLOWANCE = 2**20  # keys and tensor table: a few KiB


def _identity(data: torch.Tensor) -> torch.Tensor:
    return data


def _first(cfg: dict[str, Any], keys: tuple[str, ...], what: str) -> Any:
    """The value of the first of `keys` that `cfg` has, as the converter's find_vparam / find_aparam."""
    for key in keys:
        if key in cfg:
            return cfg[key]
    raise UserError(f"config.json: the {what} config has none of {', '.join(keys)}")


# ---------------------------------------------------------------------------- per generation


class _Gemma3:
    """llama.cpp's Gemma3VisionModel: SigLIP tower + Gemma 3's projector (avg-pool, soft-emb norm, matmul)."""

    suffixes = (".weight", ".bias")
    _PREFIXES = ("multi_modal_projector.", "vision_tower.", "multimodal_projector.", "vision_model.")

    def source_name(self, hf_name: str) -> str | None:
        """The name the converter's rules see (its filter_tensors), or None for a tensor it leaves out."""
        # transformers 5 saves a SigLIP tower it built itself (not loaded from the Hub layout) without the
        # `vision_model.` level: `vision_tower.encoder...`. The converter cannot map those names; they are
        # the same tensors as the Hub's `vision_tower.vision_model.encoder...`, so they are read as such.
        if hf_name.startswith("vision_tower.") and not hf_name.startswith("vision_tower.vision_model."):
            hf_name = "vision_tower.vision_model." + hf_name.removeprefix("vision_tower.")
        if "vision_model.head." in hf_name or not hf_name.startswith(self._PREFIXES):
            return None  # the SigLIP pooling head (unused by Gemma 3) and the language model
        return hf_name.replace("_weight", ".weight")  # mm_input_projection_weight, a bare parameter

    def prepare(self, name: str, spec: ModelSpec) -> tuple[str, Transform]:
        """(name to map, data transform): the converter's modify_tensors."""
        if "soft_emb_norm.weight" in name:  # Gemma3RMSNorm scales by (1 + w); the SigLIP LayerNorms by w
            return name, lambda data: data + 1
        return name, _identity

    def forced_type(self, name: str) -> QType | None:
        if "input_projection" in name:  # F16 whatever the file type (llama.cpp issue 13025)
            return QType.F16
        if ".embeddings." in name:  # patch and position embeddings
            return QType.F32
        return None

    def tower_hparams(self, spec: ModelSpec) -> tuple[dict[str, Any], dict[str, Any] | None]:
        """(vision, audio or None): the tower configs as the converter's class sees them."""
        return spec.tower_configs["vision"], None

    def tensor_name(self, name_map: gguf.TensorNameMap, name: str) -> str | None:
        return name_map.get_name(name, try_suffixes=self.suffixes)

    def name_blocks(self, spec: ModelSpec) -> int:
        """Block numbers the converter's tensor name map covers: the vision tower's layers."""
        return _first(spec.tower_configs["vision"], _BLOCK_KEYS, "vision")

    def write_keys(self, w: gguf.GGUFWriter, spec: ModelSpec, processor: dict[str, Any]) -> None:
        vision = spec.tower_configs["vision"]
        w.add_clip_projector_type(gguf.VisionProjectorType.GEMMA3)
        w.add_vision_attention_layernorm_eps(vision.get("layer_norm_eps", 1e-6))
        w.add_vision_use_gelu(True)
        # soft tokens per image side differing from llama.cpp's default pooling (4): tiny test models
        n_per_side = int(processor.get("image_seq_length", 256) ** 0.5)
        scale_factor = (vision["image_size"] // vision["patch_size"]) // n_per_side
        if scale_factor > 0 and scale_factor != 4:
            w.add_vision_projector_scale_factor(scale_factor)


class _Gemma4:
    """llama.cpp's Gemma4VisionAudioModel: the vision tower with its projector, and (E2B/E4B) the
    Conformer audio tower with its projector, in one file."""

    suffixes = _GEMMA4_SUFFIXES
    vision_projector, audio_projector = gguf.VisionProjectorType.GEMMA4V, gguf.VisionProjectorType.GEMMA4A

    def source_name(self, hf_name: str) -> str | None:
        # an untied lm_head is the language model's too (the converter would stop at it: "Can not map tensor")
        return None if "language_model." in hf_name or hf_name == "lm_head.weight" else hf_name

    @staticmethod
    def _is_audio(name: str) -> bool:
        return "audio_tower" in name or "embed_audio" in name

    def prepare(self, name: str, spec: ModelSpec) -> tuple[str, Transform]:
        steps: list[Transform] = [lambda d: d.unsqueeze(0) if d.dim() == 0 else d]  # clamp bounds: shape [1]
        if self._is_audio(name):
            name = name.replace("model.audio_tower.", "conformer.").replace(".linear.", ".")
            if name.endswith(("per_dim_scale", "per_dim_key_scale")):
                name += ".weight"
                steps.append(torch.nn.functional.softplus)  # llama.cpp stores the applied scale
            if "lconv1d.depthwise_conv1d" in name and name.endswith(".weight"):
                steps.append(_squeeze_depthwise)
        else:
            name = name.replace("model.vision_tower.encoder.", "vision_model.model.")
            name = name.replace(".linear.weight", ".weight")
            if name.endswith(("layer_scalar", "position_embedding_table")):
                name += ".weight"
            if name.endswith("patch_embedder.input_proj.weight"):
                steps.append(_patch_kernel)

        return name, _chain(steps)

    def forced_type(self, name: str) -> QType | None:
        # (sic: `and` binds first, as in the converter: any audio ".conv" tensor, or "_conv" weights)
        if self._is_audio(name) and (".conv" in name or "_conv" in name and ".weight" in name):
            return QType.F32
        if "position_embedding_table" in name:
            return QType.F32
        return None

    def tower_hparams(self, spec: ModelSpec) -> tuple[dict[str, Any], dict[str, Any] | None]:
        # image size 224: unused by llama.cpp (Gemma 4 takes images of any size); the converter writes it
        vision = {**spec.tower_configs["vision"], "image_size": 224}
        audio = spec.tower_configs.get("audio")
        if audio:
            audio = {**audio, "feat_in": audio.get("input_feat_size", 128)}
            if "hidden_size" in audio:
                audio["intermediate_size"] = audio["hidden_size"] * 4  # the Conformer's feed-forward width
        return vision, audio or None

    def tensor_name(self, name_map: gguf.TensorNameMap, name: str) -> str | None:
        return name_map.get_name(name, try_suffixes=self.suffixes)

    def name_blocks(self, spec: ModelSpec) -> int:
        # the converter's fixed count for classes with two encoders; the numbers cover more than layers
        # (subsample_conv_projection.layer{0,1} -> a.conv1d.{0,1}), so a 1-layer tower still needs them
        return 128

    def write_keys(self, w: gguf.GGUFWriter, spec: ModelSpec, processor: dict[str, Any]) -> None:
        vision, audio = self.tower_hparams(spec)
        w.add_clip_vision_projector_type(self.vision_projector)
        w.add_vision_attention_layernorm_eps(vision.get("layer_norm_eps", 1e-6))
        if audio:
            w.add_clip_audio_projector_type(self.audio_projector)
            w.add_audio_num_mel_bins(audio["feat_in"])
            w.add_audio_attention_layernorm_eps(audio.get("layer_norm_eps", 1e-6))


class _Gemma4Unified(_Gemma4):
    """llama.cpp's Gemma4UnifiedVisionAudioModel (a Gemma4VisionAudioModel): no towers. The vision input is
    raw 48x48 (tiny: 12x12) HWC pixel patches through LayerNorm -> Linear -> LayerNorm -> + factorised 2D
    position embedding -> LayerNorm -> RMSNorm (no weight) -> Linear; the audio input raw waveform frames
    through RMSNorm (no weight) -> Linear. llama.cpp runs the patch Linear as a convolution over CHW input,
    so its columns (and patch_ln1's entries) are permuted from HWC to CHW order."""

    # "gemma4uv" / "gemma4ua": gguf-py's VisionProjectorType.GEMMA4UV / GEMMA4UA, newer than gguf 0.19
    vision_projector, audio_projector = "gemma4uv", "gemma4ua"
    # the embedder's clip names, as the converter's gguf-py maps them (gguf 0.19's map has no entry for them):
    # V_ENC_EMBD_PATCH, V_ENC_EMBD_PATCH_NORM ("v.patch_norm.{bid}", pos_norm renamed to patch_ln3), V_ENC_EMBD_POS
    _EMBEDDER = {"model.vision_embedder.patch_dense": "v.patch_embd",
                 "model.vision_embedder.patch_ln1": "v.patch_norm.1",
                 "model.vision_embedder.patch_ln2": "v.patch_norm.2",
                 "model.vision_embedder.patch_ln3": "v.patch_norm.3",
                 "model.vision_embedder.pos_embedding": "v.position_embd"}
    # the embedder's module paths in transformers' tree, where the Hub names them model.vision_embedder.*
    _MODULE_PARTS = tuple(f"model.embed_vision.{part}." for part in ("patch_ln1", "patch_dense", "patch_ln2",
                                                                     "pos_norm"))

    def source_name(self, hf_name: str) -> str | None:
        # transformers' module names (model.embed_vision.patch_*, ...multimodal_embedder.embedding_projection)
        # read as the Hub's, which transformers 5.24 writes back on save (conversion_mapping "gemma4_unified")
        if hf_name.startswith(self._MODULE_PARTS) or hf_name == "model.embed_vision.pos_embedding":
            hf_name = hf_name.replace("model.embed_vision.", "model.vision_embedder.", 1)
        hf_name = hf_name.replace("model.embed_vision.multimodal_embedder.embedding_projection",
                                  "model.embed_vision.embedding_projection")
        return super().source_name(hf_name)

    def tower_hparams(self, spec: ModelSpec) -> tuple[dict[str, Any], dict[str, Any] | None]:
        vision, audio = super().tower_hparams(spec)
        # transformer-less: the converter writes the embedding widths and zero layers, heads and feed-forward
        vision = {**vision, "hidden_size": vision["mm_embed_dim"], "intermediate_size": 0, "num_layers": 0,
                  "num_attention_heads": 0}
        if audio:
            audio = {**audio, "hidden_size": audio["audio_embed_dim"], "intermediate_size": 0, "num_layers": 0,
                     "num_attention_heads": 0}
        return vision, audio

    def prepare(self, name: str, spec: ModelSpec) -> tuple[str, Transform]:
        vision = spec.tower_configs["vision"]
        patch = int(vision.get("model_patch_size") or vision["patch_size"] * vision["pooling_kernel_size"])
        steps: list[Transform] = []
        if name.endswith("pos_embedding"):
            name += ".weight"
            steps.append(lambda d: d.permute(1, 0, 2).contiguous())  # [positions, 2, dim] -> [2, positions, dim]
        elif ".pos_norm." in name:
            name = name.replace(".pos_norm.", ".patch_ln3.")
        elif "patch_dense.weight" in name:
            steps.append(lambda d: d[:, _hwc_to_chw(patch, d.device)].contiguous())
        elif "patch_ln1.weight" in name or "patch_ln1.bias" in name:
            steps.append(lambda d: d[_hwc_to_chw(patch, d.device)].contiguous())
        name, rest = super().prepare(name, spec)
        steps.append(rest)

        return name, _chain(steps)

    def tensor_name(self, name_map: gguf.TensorNameMap, name: str) -> str | None:
        for suffix in self.suffixes:
            if name.endswith(suffix) and name.removesuffix(suffix) in self._EMBEDDER:
                return self._EMBEDDER[name.removesuffix(suffix)] + suffix
        return super().tensor_name(name_map, name)


def _hwc_to_chw(patch: int, device: torch.device) -> torch.Tensor:
    """For each position of a CHW-ordered patch (what llama.cpp's im2col gives), the index of the same pixel
    channel in the HWC order that transformers' patches use."""
    i = torch.arange(patch * patch * 3, device=device)
    channel, row, col = i // (patch * patch), (i % (patch * patch)) // patch, i % patch
    return row * patch * 3 + col * 3 + channel


def _chain(steps: list[Transform]) -> Transform:
    """The transforms applied one after the other."""

    def transform(data: torch.Tensor) -> torch.Tensor:
        for step in steps:
            data = step(data)
        return data

    return transform


def _squeeze_depthwise(data: torch.Tensor) -> torch.Tensor:
    """Conv1d depthwise kernel [C, 1, K] -> [C, K]."""
    if data.shape[1] != 1:
        raise UserError(f"audio depthwise convolution kernel of shape {tuple(data.shape)}: expected [C, 1, K]")
    return data.reshape(data.shape[0], data.shape[2])


def _patch_kernel(data: torch.Tensor) -> torch.Tensor:
    """Gemma 4's patch embedding, a linear layer over HWC-ordered patches [n_embd, p*p*3], as the conv
    kernel llama.cpp runs [n_embd, 3, p, p]."""
    n_embd, columns = data.shape
    patch = int((columns // 3) ** 0.5)
    return data.reshape(n_embd, patch, patch, 3).permute(0, 3, 1, 2).contiguous()


_Projector = _Gemma3 | _Gemma4
# architecture -> how llama.cpp's converter writes its towers (its MMPROJ class for that architecture)
_PROJECTORS: dict[str, _Projector] = {"Gemma3ForConditionalGeneration": _Gemma3(),
                                      "Gemma4ForConditionalGeneration": _Gemma4(),
                                      "Gemma4UnifiedForConditionalGeneration": _Gemma4Unified()}


# ---------------------------------------------------------------------------- tensors


@dataclass(frozen=True)
class _Planned:
    hf_name: str
    gguf_name: str
    file: Path
    shape: tuple[int, ...]  # as written (numpy order), after the transform
    qtype: QType
    transform: Transform

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape)) * (2 if self.qtype == QType.F16 else 4)


def _block_id(name: str) -> int | None:
    """The converter's block id: the first all-digit part of the name."""
    return next((int(part) for part in name.split(".") if part.isdecimal()), None)


# the converter's always-F32 kinds that a clip file has (the rest of its list are text-model tensors); their
# names carry no block number, so they match only tensors whose source name has none
_POSITIONS = {gguf.TENSOR_NAMES[t] + ".weight"
              for t in (gguf.MODEL_TENSOR.V_ENC_EMBD_POS, gguf.MODEL_TENSOR.A_ENC_EMBD_POS)}


def _tensor_type(projector: _Projector, name: str, gguf_name: str, n_dims: int) -> QType:
    """The converter's choice for an f16 file (ModelBase.prepare_tensors with the class's tensor_force_quant)."""
    forced = projector.forced_type(name)
    if forced is None and (".patch_embd.weight" in gguf_name or ".patch_merger.weight" in gguf_name):
        forced = QType.F16  # MmprojModel: F16 in an f16 file
    if n_dims <= 1 or gguf_name.endswith("_norm.weight"):
        return QType.F32
    if forced is not None:
        return forced
    # always F32: position embeddings and whatever is not a weight matrix (biases, clamp bounds, scales)
    if _block_id(name) is None and gguf_name in _POSITIONS:
        return QType.F32
    if gguf_name[-7:] not in (".weight", ".lora_a", ".lora_b"):
        return QType.F32
    return QType.F16


def _plan(model_dir: Path, spec: ModelSpec, projector: _Projector) -> list[_Planned]:
    """The tower tensors in the converter's order: weight file by weight file (sorted), names sorted
    within each file."""
    files = weight_files(model_dir)
    name_map = gguf.get_tensor_name_map(gguf.MODEL_ARCH.MMPROJ, projector.name_blocks(spec))
    plan = []
    for path in sorted(set(files.values())):
        with safe_open(path, framework="pt") as f:
            for hf_name in sorted(f.keys()):
                name = projector.source_name(hf_name)
                if name is None or name.endswith((".attention.masked_bias", ".attention.bias",
                                                  ".rotary_emb.inv_freq")):
                    continue
                mapped, transform = projector.prepare(name, spec)
                gguf_name = projector.tensor_name(name_map, mapped)
                if gguf_name is None:
                    raise UserError(f"tensor {hf_name} in {path} has no name in llama.cpp's projector (mmproj) "
                                    f"format: not a Gemma {spec.family.name.removeprefix('gemma')} tower tensor")
                meta = torch.empty(tuple(f.get_slice(hf_name).get_shape()), device="meta")
                shape = tuple(transform(meta).shape)
                qtype = _tensor_type(projector, name, gguf_name, len(shape))
                plan.append(_Planned(hf_name, gguf_name, path, shape, qtype, transform))
    if not plan:
        raise UserError(f"{model_dir}: no vision tower tensors among the weights; expected the towers of a "
                        f"{spec.architecture.name} checkpoint")
    return plan


def _converted(plan: list[_Planned]) -> Iterator[np.ndarray]:
    """Each planned tensor, loaded alone, transformed and converted to its GGUF type (f16 and f32 stay as
    stored until then, other types go through f32, as in the converter)."""
    with ExitStack() as stack:
        handles = {p: stack.enter_context(safe_open(p, framework="pt")) for p in sorted({t.file for t in plan})}
        for t in plan:
            data = handles[t.file].get_tensor(t.hf_name)
            if data.dtype not in (torch.float16, torch.float32):
                data = data.to(torch.float32)
            yield gguf.quants.quantize(t.transform(data).numpy(), t.qtype)
            del data


# ---------------------------------------------------------------------------- keys


def processor_config(model_dir: Path) -> dict[str, Any]:
    """preprocessor_config.json (its media_proc_cfg merged up), then processor_config.json (its
    image_processor merged up) over it: where the converter finds the image normalization."""
    merged: dict[str, Any] = {}
    found = []
    for file_name, nested in (("preprocessor_config.json", "media_proc_cfg"),
                              ("processor_config.json", "image_processor")):
        path = model_dir / file_name
        if not path.is_file():
            continue
        found.append(path)
        try:
            cfg = json.loads(path.read_text(encoding="utf-8"))
        except json.JSONDecodeError as exc:
            raise UserError(f"{path} is not valid JSON: {exc}") from None
        if not isinstance(cfg, dict):
            raise UserError(f"{path}: expected a JSON object")
        if isinstance(cfg.get(nested), dict):
            cfg = {**cfg, **cfg[nested]}
        merged.update(cfg)
    if not found:
        raise UserError(f"{model_dir} has neither preprocessor_config.json nor processor_config.json: the "
                        "projector GGUF takes the image normalization (image_mean, image_std) from them; copy "
                        "them from the base model's folder")
    missing = [key for key in ("image_mean", "image_std") if key not in merged]
    if missing:
        raise UserError(f"{', '.join(str(p) for p in found)}: no {' or '.join(missing)}; expected the image "
                        "processor's normalization (as in the base model's processor files)")
    return merged


def _general_keys(w: gguf.GGUFWriter, model_dir: Path, name: str | None) -> None:
    """general.type and the general.* keys llama.cpp's converter derives through gguf's Metadata: sampling
    defaults from generation_config.json, name, basename, size label ... from the model card, config and
    folder name (`name` replaces only general.name, as the converter's --model-name)."""
    total, shared, experts, expert_count = w.get_total_parameter_count()
    meta = gguf.Metadata.load(None, model_dir, name, total)
    generation = gguf.Metadata.load_generation_config(model_dir)
    if "penalty_repeat" not in generation and "repetition_penalty" in generation:
        meta.sampling_penalty_repeat = generation["repetition_penalty"]  # read by the converter's newer gguf-py
    if meta.name is None:
        meta.name = model_dir.name
    if meta.size_label is None and total > 0:
        meta.size_label = gguf.size_label(total, shared, experts, expert_count)
    w.add_type(gguf.GGUFType.MMPROJ)
    meta.set_gguf_meta_model(w)


def _tower_keys(w: gguf.GGUFWriter, spec: ModelSpec, projector: _Projector, processor: dict[str, Any]) -> None:
    """MmprojModel's keys: both towers' sizes and the image normalization, then the generation's own."""
    n_embd_text = spec.text["hidden_size"]
    vision, audio = projector.tower_hparams(spec)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    w.add_clip_has_vision_encoder(True)
    w.add_vision_projection_dim(n_embd_text)
    w.add_vision_image_size(_first(vision, ("image_size",), "vision"))
    w.add_vision_patch_size(_first(vision, ("patch_size",), "vision"))
    w.add_vision_embedding_length(_first(vision, ("hidden_size", "width", "vt_hidden_size"), "vision"))
    w.add_vision_feed_forward_length(_first(vision, ("intermediate_size", "vt_intermediate_size"), "vision"))
    w.add_vision_block_count(_first(vision, _BLOCK_KEYS, "vision"))
    w.add_vision_head_count(_first(vision, ("num_attention_heads", "num_heads", "heads", "vt_num_attention_heads"),
                                   "vision"))
    w.add_vision_image_mean(processor["image_mean"])
    w.add_vision_image_std(processor["image_std"])
    if audio:
        w.add_clip_has_audio_encoder(True)
        w.add_audio_projection_dim(n_embd_text)
        w.add_audio_embedding_length(_first(audio, ("hidden_size",), "audio"))
        w.add_audio_feed_forward_length(_first(audio, ("intermediate_size",), "audio"))
        w.add_audio_block_count(_first(audio, _BLOCK_KEYS, "audio"))
        w.add_audio_head_count(_first(audio, ("num_attention_heads",), "audio"))
    projector.write_keys(w, spec, processor)


# ---------------------------------------------------------------------------- file


def write_mmproj(model_dir: Path, out_path: Path, *, name: str | None = None) -> Path:
    """Write the towers of `model_dir` (merged HF, multimodal Gemma 3 or Gemma 4) as the f16 projector GGUF
    at `out_path`, for llama.cpp (`--mmproj`) and Ollama (a second FROM line) beside the text GGUF.
    `name` is general.name (default: derived from the folder as llama.cpp's converter does)."""
    model_dir, out_path = Path(model_dir).resolve(), Path(out_path)
    spec = read_spec(model_dir)  # UserError for what is not a supported Gemma checkpoint
    if not spec.multimodal or "vision" not in spec.towers:
        raise UserError(f"{model_dir} holds a text-only checkpoint ({spec.architecture.name}): a projector (mmproj) "
                        "GGUF is written for multimodal Gemma checkpoints with a vision tower "
                        f"({', '.join(_PROJECTORS)})")
    projector = _PROJECTORS.get(spec.architecture.name)
    if projector is None:
        raise UserError(f"{model_dir}: no projector GGUF format for {spec.architecture.name}")
    processor = processor_config(model_dir)
    plan = _plan(model_dir, spec, projector)

    out_path.parent.mkdir(parents=True, exist_ok=True)
    check_room(out_path.parent, sum(t.nbytes for t in plan) + _METADATA_ALLOWANCE)
    with gguf_file(out_path, _CLIP) as writer:
        for t in plan:  # float32 stands for "not raw bytes": shapes stay logical
            writer.add_tensor_info(t.gguf_name, t.shape, np.dtype(np.float32), t.nbytes, raw_dtype=t.qtype)
        _general_keys(writer, model_dir, name)
        _tower_keys(writer, spec, projector, processor)
        writer.add_quantization_version(gguf.GGML_QUANT_VERSION)

        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        for data in _converted(plan):
            writer.write_tensor_data(data)
    return out_path
