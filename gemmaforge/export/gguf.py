"""Merged Hugging Face Gemma directory -> one GGUF file that llama.cpp and Ollama load.

Follows llama.cpp's own converter (`convert_hf_to_gguf.py`: Gemma, Gemma2, Gemma3, Gemma4Model) for keys,
tensor names and per-tensor types, but streams: the tensor table is planned from the safetensors
headers first, then each tensor is loaded, converted and written on its own, so peak memory is
about one tensor (the 262k-row embedding) rather than the model. The file (or its shards, see
gguf_shards.py) appears at `out_path` only once complete.
"""

from __future__ import annotations

import json
import math
import re
import shutil
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch
from safetensors import safe_open

from gemmaforge.config import GGUF_QUANTS, NO_SPLIT, Split
from gemmaforge.errors import UserError
from gemmaforge.export.gguf_shards import gguf_file, split_gguf_file
from gemmaforge.export.gguf_vocab import ADDED_TOKEN_SCORE, Vocab, bpe_merges, bpe_tokens, load_vocab
from gemmaforge.export.quantize import K_QUANTS, llama_cpp_quantize, quantizer
from gemmaforge.gguf_names import gguf_parts
from gemmaforge.model_spec import ModelSpec, read_spec, text_weight_name
from gemmaforge.system.memory import return_freed_memory

QType = gguf.GGMLQuantizationType

# quant name -> (general.file_type, type of the 2-D weights)
_QUANTS: dict[str, tuple[gguf.LlamaFileType, QType]] = {
    "f32": (gguf.LlamaFileType.ALL_F32, QType.F32),
    "f16": (gguf.LlamaFileType.MOSTLY_F16, QType.F16),
    "bf16": (gguf.LlamaFileType.MOSTLY_BF16, QType.BF16),
    "q8_0": (gguf.LlamaFileType.MOSTLY_Q8_0, QType.Q8_0),
    "q4_0": (gguf.LlamaFileType.MOSTLY_Q4_0, QType.Q4_0),
    "q5_0": (gguf.LlamaFileType.MOSTLY_Q5_0, QType.Q5_0),
}
# Tied Gemma models use token_embd as the output layer too: llama.cpp's quantizer keeps it at 6 bits
# (Q6_K) for 4- and 5-bit files; numpy has no Q6_K quantizer, so it stays Q8_0 there.
_EMBEDDING_FLOOR = {QType.Q4_0: QType.Q8_0, QType.Q5_0: QType.Q8_0}


# ---------------------------------------------------------------------------- hyperparameters


def _rope_parameters(cfg: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(global, sliding) RoPE settings from transformers 5 `rope_parameters` or the v4 keys."""
    params = cfg.get("rope_parameters") or {}
    if "full_attention" in params or "sliding_attention" in params:
        return params.get("full_attention", {}), params.get("sliding_attention", {})
    full = dict(params or cfg.get("rope_scaling") or {})
    full.setdefault("rope_theta", cfg.get("rope_theta"))
    return full, {"rope_theta": cfg.get("rope_local_base_freq")}


def _core_hparams(w: gguf.GGUFWriter, cfg: dict[str, Any]) -> None:
    """Sizes and attention shape, written alike by llama.cpp's converter for every Gemma generation."""
    try:
        w.add_block_count(cfg["num_hidden_layers"])
        w.add_context_length(cfg["max_position_embeddings"])
        w.add_embedding_length(cfg["hidden_size"])
        w.add_feed_forward_length(cfg["intermediate_size"])
        w.add_head_count(cfg["num_attention_heads"])
        w.add_head_count_kv(cfg.get("num_key_value_heads", cfg["num_attention_heads"]))
        w.add_key_length(cfg["head_dim"])
        w.add_value_length(cfg["head_dim"])
        w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    except KeyError as missing:
        raise UserError(f"config.json has no {missing.args[0]!r}: "
                        "expected a complete Hugging Face Gemma config") from None


def _gemma_hparams(w: gguf.GGUFWriter, cfg: dict[str, Any]) -> None:
    """Gemma 1: what llama.cpp's GemmaModel writes (RoPE base 10000 is llama.cpp's default)."""
    _core_hparams(w, cfg)


def _gemma2_hparams(w: gguf.GGUFWriter, cfg: dict[str, Any]) -> None:
    """Gemma 2: llama.cpp's Gemma2Model adds both soft-cappings and the sliding window."""
    _core_hparams(w, cfg)
    w.add_attn_logit_softcapping(cfg["attn_logit_softcapping"])
    w.add_final_logit_softcapping(cfg["final_logit_softcapping"])
    w.add_sliding_window(cfg["sliding_window"])


# transformers' Gemma3TextConfig defaults, for configs that leave keys out
_GEMMA3_DEFAULTS = {"head_dim": 256, "max_position_embeddings": 131072, "num_attention_heads": 8,
                    "num_key_value_heads": 4, "rms_norm_eps": 1e-6}


def _gemma3_hparams(w: gguf.GGUFWriter, cfg: dict[str, Any]) -> None:
    """What llama.cpp's Gemma3Model writes."""
    if cfg.get("attn_logit_softcapping") is not None:
        raise UserError(
            "config.json sets attn_logit_softcapping, which Gemma 3 does not have in "
            "llama.cpp; write a clean text-only config before exporting"
        )
    _core_hparams(w, {**_GEMMA3_DEFAULTS, **cfg})
    full, sliding = _rope_parameters(cfg)
    w.add_rope_freq_base(full.get("rope_theta") or 1_000_000.0)  # global (full-attention) layers
    if sliding.get("rope_theta") is not None:
        w.add_rope_freq_base_swa(sliding["rope_theta"])
    rope_type = full.get("rope_type", full.get("type"))
    if rope_type == "linear":  # Gemma 3 4B+ stretch the global layers' RoPE
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(full["factor"])
    elif rope_type not in (None, "default"):
        raise UserError(f"config.json: RoPE type {rope_type!r} is not supported for GGUF export")

    if cfg.get("sliding_window_pattern") != 1:  # 1 would mean every layer is global
        w.add_sliding_window(cfg["sliding_window"])
    if cfg.get("final_logit_softcapping"):
        w.add_final_logit_softcapping(cfg["final_logit_softcapping"])


def _gemma4_full_layer(cfg: dict[str, Any], key: str) -> Any:
    """A full-attention layer's own value of `key`: `global_<key>`, or the per-layer override that
    transformers 5 writes (`per_layer_config`), or None when full and sliding layers share it."""
    if cfg.get(f"global_{key}") is not None:
        return cfg[f"global_{key}"]
    for index, override in sorted((cfg.get("per_layer_config") or {}).items(), key=lambda kv: int(kv[0])):
        if cfg["layer_types"][int(index)] == "full_attention" and key in override:
            return override[key]
    return None


def _gemma4_head_dims(cfg: dict[str, Any]) -> tuple[int, int]:
    """(full-attention head dim, sliding-window head dim)."""
    return _gemma4_full_layer(cfg, "head_dim") or cfg["head_dim"], cfg["head_dim"]


def _gemma4_hparams(w: gguf.GGUFWriter, cfg: dict[str, Any]) -> None:
    """What llama.cpp's Gemma4Model writes: Gemma 3's keys with the full-attention head size, plus shared KV
    layers, per-layer input embeddings, the layer pattern and both head sizes and RoPE widths."""
    full_dim, swa_dim = _gemma4_head_dims(cfg)
    layer_types = cfg["layer_types"]
    swa = [t == "sliding_attention" for t in layer_types]
    kv_full = cfg.get("num_global_key_value_heads") or _gemma4_full_layer(cfg, "num_key_value_heads")
    core = {**_GEMMA3_DEFAULTS, **cfg, "head_dim": full_dim}
    if kv_full is not None:  # a count per layer: sliding and full layers differ
        core["num_key_value_heads"] = [cfg["num_key_value_heads"] if s else kv_full for s in swa]
    if cfg.get("use_double_wide_mlp"):
        first_shared = cfg["num_hidden_layers"] - cfg["num_kv_shared_layers"]
        n_ff = cfg["intermediate_size"]
        core["intermediate_size"] = [n_ff if i < first_shared else 2 * n_ff for i in range(cfg["num_hidden_layers"])]
    _core_hparams(w, core)
    if cfg.get("num_experts") is not None:  # 26B-A4B: a MoE block beside the dense MLP in every layer
        w.add_expert_count(cfg["num_experts"])
        w.add_expert_used_count(cfg["top_k_experts"])
    if cfg.get("moe_intermediate_size") is not None:
        w.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
    full, sliding = _rope_parameters(cfg)
    w.add_rope_freq_base(full.get("rope_theta") or 1_000_000.0)
    if sliding.get("rope_theta") is not None:
        w.add_rope_freq_base_swa(sliding["rope_theta"])
    if cfg.get("final_logit_softcapping"):
        w.add_final_logit_softcapping(cfg["final_logit_softcapping"])
    w.add_sliding_window(cfg["sliding_window"])
    w.add_shared_kv_layers(cfg["num_kv_shared_layers"])
    w.add_embedding_length_per_layer_input(cfg.get("hidden_size_per_layer_input") or 0)
    w.add_sliding_window_pattern(swa)
    w.add_key_length_swa(swa_dim)
    w.add_value_length_swa(swa_dim)
    w.add_rope_dimension_count(full_dim)  # "proportional" RoPE: the unrotated part is in rope_freqs
    w.add_rope_dimension_count_swa(int(swa_dim * sliding.get("partial_rotary_factor", 1.0)))


def _gemma4_rope_freqs(cfg: dict[str, Any]) -> np.ndarray:
    """Frequency factors of the full-attention layers' proportional RoPE: 1 for the rotated pairs, 1e30
    (no rotation) for the rest, as llama.cpp's converter writes them."""
    full, _ = _rope_parameters(cfg)
    if full.get("rope_type") != "proportional":
        raise UserError(f"config.json: Gemma 4 RoPE type {full.get('rope_type')!r}; expected 'proportional'")
    full_dim, _ = _gemma4_head_dims(cfg)
    rotated = int(full_dim * full["partial_rotary_factor"] / 2)
    return np.array([1.0] * rotated + [1e30] * (full_dim // 2 - rotated), dtype=np.float32)


# HF model_type -> its hyperparameter writer
_HPARAM_WRITERS: dict[str, Callable[[gguf.GGUFWriter, dict[str, Any]], None]] = {
    "gemma": _gemma_hparams,
    "gemma2": _gemma2_hparams,
    "gemma3": _gemma3_hparams,
    "gemma4": _gemma4_hparams,  # Gemma 4 12B Unified's text model (gemma4_unified_text) is Gemma 4's decoder too
}
# Architectures whose generation_config.json `suppress_tokens` llama.cpp's converter copies into the text file
# (Gemma4UnifiedModel: the end-of-audio / end-of-image ids, whose embedding rows carry projected extra embeddings
# and must never be sampled); llama.cpp's common sampler then never picks them.
_SUPPRESS_TOKENS_ARCHITECTURES = {"Gemma4UnifiedForConditionalGeneration"}
_SUPPRESS_TOKENS_KEY = "tokenizer.ggml.suppress_tokens"  # gguf-py's Keys.Tokenizer.SUPPRESS_TOKENS (newer than 0.19)


def _suppress_tokens(model_dir: Path) -> list[int] | None:
    """generation_config.json's `suppress_tokens`, as llama.cpp's Gemma4UnifiedModel reads it (None: none)."""
    path = model_dir / "generation_config.json"
    if not path.is_file():
        return None
    try:
        tokens = json.loads(path.read_text(encoding="utf-8")).get("suppress_tokens")
    except json.JSONDecodeError as exc:
        raise UserError(f"{path} is not valid JSON: {exc}") from None
    if tokens is not None and (not isinstance(tokens, list) or not all(isinstance(t, int) for t in tokens)):
        raise UserError(f"{path}: suppress_tokens must be a list of token ids, not {tokens!r}")
    return tokens or None  # (an empty list: the converter would fail on it; nothing to suppress)


# ---------------------------------------------------------------------------- tensors


@dataclass(frozen=True)
class _Planned:
    hf_name: str
    gguf_name: str
    file: Path
    shape: tuple[int, ...]  # numpy order (rows, cols)
    qtype: QType
    nbytes: int


def weight_files(model_dir: Path) -> dict[str, Path]:
    """HF tensor name -> safetensors file holding it."""
    index = model_dir / "model.safetensors.index.json"
    single = model_dir / "model.safetensors"
    if index.is_file():
        weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        files = {name: model_dir / fname for name, fname in weight_map.items()}
    elif single.is_file():
        with safe_open(single, framework="pt") as f:
            files = dict.fromkeys(f.keys(), single)
    else:
        raise UserError(f"no weights in {model_dir}: expected {single.name} or {index.name}")
    for path in set(files.values()):
        if not path.is_file():
            raise UserError(f"weight file {path} named in {index} is missing")
    return files


def _tensor_type(gguf_name: str, shape: tuple[int, ...], weights: QType) -> QType:
    """The reference's choice: vectors and norms stay F32; a row that does not fill whole quant
    blocks falls back to F16; everything else (token_embd included) gets the file's type."""
    if len(shape) <= 1 or gguf_name.endswith(("_norm.weight", "ffn_gate_inp.weight")):  # and a MoE router
        return QType.F32
    if gguf_name == "token_embd.weight":
        weights = _EMBEDDING_FLOOR.get(weights, weights)
    block_size, _ = gguf.GGML_QUANT_SIZES[weights]
    return weights if shape[-1] % block_size == 0 else QType.F16


def _plan(model_dir: Path, spec: ModelSpec, arch: gguf.MODEL_ARCH, weights: QType) -> list[_Planned]:
    """The text model's tensors (a multimodal checkpoint's towers go to the projector file, gguf_mmproj.py)."""
    files = weight_files(model_dir)
    cfg = spec.text
    name_map = gguf.get_tensor_name_map(arch, cfg["num_hidden_layers"])
    skip = {"lm_head.weight"} if cfg.get("tie_word_embeddings", True) else set()  # llama.cpp reuses token_embd
    shapes: dict[str, tuple[int, ...]] = {}
    for path in sorted(set(files.values())):
        with safe_open(path, framework="pt") as f:
            shapes.update({n: tuple(f.get_slice(n).get_shape()) for n in f.keys()})  # noqa: SIM118 (not iterable)
    plan = []
    for hf_name in sorted(files):
        text_name = text_weight_name(spec, hf_name)
        if text_name is None or text_name in skip or text_name.endswith(".rotary_emb.inv_freq"):
            continue
        gguf_name = name_map.get_name(text_name, try_suffixes=(".weight", ".bias"))
        if gguf_name is not None and not gguf_name.endswith((".weight", ".bias")):
            gguf_name += ".weight"  # a bare parameter (Gemma 4's layer_scalar): named as llama.cpp's converter does
        gguf_name = _moe_scale_name(text_name) or gguf_name
        if gguf_name is None:
            raise UserError(f"tensor {hf_name} in {files[hf_name]} has no GGUF name for {gguf.MODEL_ARCH_NAMES[arch]}")
        shape = shapes[hf_name]
        qtype = _tensor_type(gguf_name, shape, weights)
        nbytes = math.prod(gguf.quant_shape_to_byte_shape(shape, qtype))
        plan.append(_Planned(hf_name, gguf_name, files[hf_name], shape, qtype, nbytes))
    return plan


# Gemma 4 MoE router scales: llama.cpp's Gemma4Model names them after the tensors they scale
_MOE_SCALES = {"router.scale": "ffn_gate_inp.scale", "router.per_expert_scale": "ffn_down_exps.scale"}
_MOE_SCALE = re.compile(r"model\.layers\.(\d+)\.(router\.(?:scale|per_expert_scale))")


def _moe_scale_name(text_name: str) -> str | None:
    match = _MOE_SCALE.fullmatch(text_name)
    return f"blk.{match[1]}.{_MOE_SCALES[match[2]]}" if match else None


def _converted(plan: list[_Planned], norm_shift: bool) -> Iterator[np.ndarray]:
    """Each planned tensor, loaded alone and converted to its GGUF type."""
    with ExitStack() as stack:
        handles = {p: stack.enter_context(safe_open(p, framework="pt")) for p in sorted({t.file for t in plan})}
        for t in plan:
            data = handles[t.file].get_tensor(t.hf_name).to(torch.float32).numpy()
            if norm_shift and t.hf_name.endswith("norm.weight"):
                data = data + 1.0  # Gemma's RMSNorm scales by (1 + w); llama.cpp's by w
            yield gguf.quants.quantize(data, t.qtype)
            del data  # free it before the next tensor is loaded


# ---------------------------------------------------------------------------- file


def _vocab_to_gguf(w: gguf.GGUFWriter, vocab: Vocab, chat_template: str | None) -> None:
    w.add_tokenizer_model("llama")  # SentencePiece, as llama.cpp's converter writes Gemma 1-3
    w.add_tokenizer_pre("default")
    w.add_token_list(vocab.tokens)
    w.add_token_scores(vocab.scores)
    w.add_token_types(vocab.types)
    setters = {
        "bos": w.add_bos_token_id,
        "eos": w.add_eos_token_id,
        "unk": w.add_unk_token_id,
        "pad": w.add_pad_token_id,
        "mask": w.add_mask_token_id,
    }
    for name, token_id in vocab.special_ids.items():
        setters[name](token_id)
    w.add_add_bos_token(vocab.add_bos)
    w.add_add_eos_token(vocab.add_eos)
    w.add_add_sep_token(False)
    w.add_add_space_prefix(False)  # Gemma's tokenizer adds no leading "▁"
    template = chat_template if chat_template is not None else vocab.chat_template
    if template:
        w.add_chat_template(template)


_METADATA_ALLOWANCE = 64 * 2**20  # vocabulary, chat template, header: a few MiB for a 262k vocabulary


def check_room(folder: Path, needed: int) -> None:
    """Refuse before writing rather than leave a disk full and a file half-written."""
    free = shutil.disk_usage(folder).free
    if free < needed:
        raise UserError(f"{folder}: {free / 2**30:.2f} GiB free, the GGUF file needs {needed / 2**30:.2f} GiB")


def _gemma4_vocab_to_gguf(w: gguf.GGUFWriter, model_dir: Path, n_vocab: int, chat_template: str | None,
                          visible: tuple[str, ...]) -> None:
    """Gemma 4's BPE vocabulary with its merges, written as llama.cpp's Gemma4Model writes it (tokens as the gguf
    package's tokenizer.json reader gives them, every score -1000, merges and special ids by its SpecialVocab); the
    chat-syntax tokens `visible` are user-defined, so that they stay in output for chat parsers."""
    tokens, types = [], []
    for text, kind in bpe_tokens(model_dir):
        tokens.append(text)
        types.append(gguf.TokenType.USER_DEFINED if text in visible else kind)
    if len(tokens) != n_vocab:
        raise UserError(f"{model_dir}/tokenizer.json has {len(tokens)} tokens, the embedding {n_vocab} rows")
    w.add_tokenizer_model("gemma4")
    w.add_token_list(tokens)
    w.add_token_scores([ADDED_TOKEN_SCORE] * len(tokens))  # BPE: the merges rank pairs, not scores
    w.add_token_types(types)
    special = gguf.SpecialVocab(model_dir)  # the special ids; the merges read here, 8x faster
    special.merges = bpe_merges(model_dir)
    special.chat_template = chat_template if chat_template is not None else special.chat_template
    special.add_special_token["bos"] = True  # Gemma 4 prompts start with <bos> whatever tokenizer_config says
    special.add_to_gguf(w)
    w.add_add_space_prefix(False)


def write_gguf(
    model_dir: Path, out_path: Path, quant: str, *, chat_template: str | None = None, name: str | None = None,
    split: Split = NO_SPLIT,
) -> Path:
    """Write `model_dir` (merged HF, text-only Gemma) as a GGUF of type `quant` at `out_path`, or as its
    shards with `split`; returns the file llama.cpp opens (the first shard when split). `name` is
    general.name (default: the folder's name, as llama.cpp's converter). K-quants are made by llama.cpp's
    quantizer from an f16 file written first (and removed after), then split."""
    if quant in K_QUANTS:
        quantizer(quant)
        source = out_path.with_name(f".{out_path.name}.f16-source.tmp.gguf")
        whole = out_path.with_name(f".{out_path.name}.{quant}.tmp.gguf")
        try:
            write_gguf(model_dir, source, "f16", chat_template=chat_template, name=name)
            if not split.enabled:
                return llama_cpp_quantize(source, out_path, quant)
            llama_cpp_quantize(source, whole, quant)
            return split_gguf_file(whole, out_path, split)[0]
        finally:
            source.unlink(missing_ok=True)
            whole.unlink(missing_ok=True)
    if quant not in _QUANTS:
        raise UserError(f"unknown GGUF quant {quant!r}; choose one of: {', '.join(GGUF_QUANTS)}")
    model_dir, out_path = Path(model_dir), Path(out_path)
    spec = read_spec(model_dir)  # UserError for what is not a supported Gemma checkpoint
    family, cfg = spec.family, spec.text
    arch = next(a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == family.gguf_arch)
    file_type, weights = _QUANTS[quant]
    plan = _plan(model_dir, spec, arch, weights)
    embedding = next((t for t in plan if t.hf_name.endswith("embed_tokens.weight")), None)
    if embedding is None:
        raise UserError(f"no embed_tokens.weight among the weights in {model_dir}")

    out_path.parent.mkdir(parents=True, exist_ok=True)
    check_room(out_path.parent, sum(t.nbytes for t in plan) + _METADATA_ALLOWANCE)
    gemma4 = family.gguf_arch == "gemma4"
    extras = {"rope_freqs.weight": _gemma4_rope_freqs(cfg)} if gemma4 else {}
    with gguf_file(out_path, family.gguf_arch, split) as writer:
        for extra_name, data in extras.items():  # small generated tensors, written first as llama.cpp does
            writer.add_tensor_info(extra_name, data.shape, data.dtype, data.nbytes)
        for t in plan:  # float32 stands for "not raw bytes": shapes stay logical
            writer.add_tensor_info(t.gguf_name, t.shape, np.dtype(np.float32), t.nbytes, raw_dtype=t.qtype)
        writer.add_type(gguf.GGUFType.MODEL)
        writer.add_name(name or model_dir.resolve().name)
        writer.add_size_label(gguf.size_label(*writer.get_total_parameter_count()))
        _HPARAM_WRITERS[family.gguf_arch](writer, cfg)
        suppress = _suppress_tokens(model_dir) if spec.architecture.name in _SUPPRESS_TOKENS_ARCHITECTURES else None
        if suppress:
            writer.add_array(_SUPPRESS_TOKENS_KEY, suppress)
        writer.add_file_type(file_type)
        writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
        if gemma4:
            _gemma4_vocab_to_gguf(writer, model_dir, embedding.shape[0], chat_template, family.chat.syntax_tokens)
        else:
            _vocab_to_gguf(writer, load_vocab(model_dir, embedding.shape[0], spec.special_token_ids), chat_template)

        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        for data in [*extras.values()]:
            writer.write_tensor_data(data)
        for data in _converted(plan, family.gguf_norm_shift):
            writer.write_tensor_data(data)
            del data
            return_freed_memory()  # one tensor at a time stays one tensor in memory, not the file's size
    return gguf_parts(out_path)[0]
