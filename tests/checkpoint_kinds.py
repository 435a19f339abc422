"""Tiny random Hugging Face checkpoints with the structure of each real multimodal Gemma checkpoint kind.

    KINDS: the kind names
    build_checkpoint(kind, target, tokenizer_dir, seed=0) -> target

Each kind keeps what the real checkpoints have (architecture class, sub-configs and tower types, layer types,
special token ids, the real text vocabulary sizes, RoPE settings, tied embeddings, MoE fields, the files shipped
beside the weights) and shrinks only dimensions: text hidden 64, 2 to 6 text layers, 1 vision layer of width 32,
1 audio layer of width 32, 4 experts; 100 to 170 MB of float32, most of it the 262k-row embedding tables. A build
takes 0.5 to 1.5 s on 2 busy cores; the first one in a process also pays 1 to 2 s of transformers imports.

On disk the weights use the key names of the checkpoints on the Hub ("hub layout"), which are not always the ones
transformers >= 5 writes itself (see _hub_layout); pass hub_layout=False for a plain save_pretrained. Norm
weights are random (tests.tiny_models.save_tiny), and so are the other values that real checkpoints carry as
trained numbers but transformers initialises to a constant (layer scalars, router scales, clip bounds, vision
standardisation), so that an export that drops one of them cannot go unnoticed.

The tokenizer is the real Gemma 3 one (262144 tokens) from `tokenizer_dir`:
- gemma3-mm: with `<image_soft_token>` added as id 262144, as in google/gemma-3-*-it.
- gemma4-*: with the Gemma 4 special tokens renamed in place (see _GEMMA4_SPECIAL_TOKENS). The Gemma 4 vocabulary
  has the same 262144 entries as Gemma 3's at the ids checked (text pieces such as "thought" 45518, "Tokyo" 89265),
  its multimodal and chat tokens sit on ids that are `<unusedN>`, `<start_of_image>`, `<end_of_image>`,
  `<start_of_turn>` and `<end_of_turn>` in Gemma 3, and no token is added beyond 262144, so the renamed Gemma 3
  tokenizer has the real Gemma 4 id layout. The Gemma 4 chat template and response schema are not written.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

KINDS: tuple[str, ...] = ("gemma3-mm", "gemma4-e2b", "gemma4-moe", "gemma4-dense", "gemma4-unified")

# Tiny sizes shared by the kinds. Head dims: 16 in sliding layers, 32 in Gemma 4 full layers (real 256 / 512).
HIDDEN = 64
HEAD_DIM = 16
GLOBAL_HEAD_DIM = 32
SLIDING_WINDOW = 32  # real: 512 (E2B, E4B) or 1024 (Gemma 3 4B+, Gemma 4 26B/31B/12B); small so it matters in tests
VISION = dict(hidden_size=32, intermediate_size=128, num_hidden_layers=1, num_attention_heads=2)
IMAGE_SOFT_TOKENS = 70  # Gemma 4 processors accept only 70, 140, 280 (real default), 560 or 1120
VISION_PATCH = 4  # Gemma 4 real: 16 (x pooling kernel 3 = 48 px per soft token); tiny: 4 (12 px per soft token)


# ---------------------------------------------------------------------------------------------------------------
# gemma3-mm: google/gemma-3-4b-it, -12b-it, -27b-it (and -pt): Gemma3ForConditionalGeneration
#
# Sources
# - config.json of google/gemma-3-4b-it (verbatim copy at mlx-community/gemma-3-4b-it-bf16; 12b/27b copies the
#   same keys): top level architectures, boi_token_index 255999, eoi_token_index 256000, image_token_index 262144,
#   mm_tokens_per_image 256, eos_token_id [1, 106], initializer_range; text_config (model_type gemma3_text) holds
#   hidden_size, intermediate_size, num_hidden_layers, rope_scaling {"factor": 8.0, "rope_type": "linear"},
#   sliding_window 1024 (12b/27b also num_attention_heads, num_key_value_heads, vocab_size 262208; 27b head_dim
#   128 and query_pre_attn_scalar 168); vision_config (model_type siglip_vision_model) hidden_size 1152,
#   image_size 896, intermediate_size 4304, num_attention_heads 16, num_hidden_layers 27, patch_size 14,
#   vision_use_head false. No layer_types key: the 5 sliding : 1 full pattern is Gemma3TextConfig's default.
# - transformers convert_gemma3_weights.py (_VARIANTS gemma3_4b/12b/27b, _VISION_CONFIG): rope_theta 1e6 on
#   full layers, rope_local_base_freq 1e4 on sliding ones, linear factor 8 on full layers only, head_dim 256,
#   query_pre_attn_scalar 256 (= head_dim for 4B/12B), attn_logit_softcapping None; the vision checkpoints get 64
#   extra embedding rows (vocab_size 262144 + 64 = 262208); tokenizer extra_special_tokens image_token
#   "<image_soft_token>" (id 262144, added), boi "<start_of_image>" (255999), eoi "<end_of_image>" (256000);
#   Gemma3ImageProcessor(image_seq_length=256, image_mean=image_std=(0.5,)*3, size=896x896, resample BILINEAR);
#   GenerationConfig(cache_implementation="hybrid", do_sample, top_k 64, top_p 0.95); lm_head tied.
# - transformers configuration_gemma3.py (Gemma3Config, Gemma3TextConfig) and configuration_siglip.py
#   (SiglipVisionConfig): defaults for the keys the real config.json leaves out (tie_word_embeddings True,
#   max_position_embeddings 131072, head_dim 256, sliding pattern 6); rope_scaling is read into
#   rope_parameters["full_attention"] by Gemma3TextConfig.convert_rope_params_to_dict.
# - llama.cpp conversion/gemma.py (llama-cpp-python 0.3.36 sdist): Gemma3Model trims the embedding to the
#   tokenizer's size and adds 1 to norm weights; Gemma3VisionModel takes only tensors named vision_tower.* /
#   multi_modal_projector.*, adds 1 to mm_soft_emb_norm, and derives the pooling kernel as
#   (image_size // patch_size) // sqrt(image_seq_length from preprocessor_config.json) (4 in the real models, and
#   here). llama.cpp's gemma3 text model assumes the 5:1 sliding pattern, hence 6 tiny text layers.
# Tiny: 6 text layers (5 sliding + 1 full, the only layer with the linear RoPE), 4 heads / 2 KV heads (the 4B
# ratio), head_dim 16 = query_pre_attn_scalar; SigLIP 1 layer, image 32 px, patch 4 -> 8x8 patches pooled by 4 ->
# mm_tokens_per_image 4.
# ---------------------------------------------------------------------------------------------------------------
def _gemma3_mm_config():
    from transformers import Gemma3Config

    return Gemma3Config(**{
        "architectures": ["Gemma3ForConditionalGeneration"],
        "boi_token_index": 255999,
        "eoi_token_index": 256000,
        "eos_token_id": [1, 106],
        "image_token_index": 262144,
        "initializer_range": 0.02,
        "mm_tokens_per_image": 4,
        "text_config": {
            "hidden_size": HIDDEN,
            "intermediate_size": 4 * HIDDEN,
            "model_type": "gemma3_text",
            "num_hidden_layers": 6,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": HEAD_DIM,
            "query_pre_attn_scalar": HEAD_DIM,
            "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
            "rope_theta": 1_000_000.0,
            "rope_local_base_freq": 10_000.0,
            "sliding_window": SLIDING_WINDOW,
            "vocab_size": 262208,
        },
        "vision_config": {
            **VISION,
            "image_size": 32,
            "model_type": "siglip_vision_model",
            "patch_size": VISION_PATCH,
            "vision_use_head": False,
        },
    })


def _gemma3_mm_processor_files(target: Path) -> None:
    """preprocessor_config.json and processor_config.json with the keys google/gemma-3-4b-it ships (written from
    the converter's Gemma3ImageProcessor arguments; the pan-and-scan keys are null there, i.e. off, as discussed in
    google/gemma-3-4b-it discussion #26), tiny values."""
    _write_json(target / "preprocessor_config.json", {
        "do_convert_rgb": None,
        "do_normalize": True,
        "do_pan_and_scan": None,
        "do_rescale": True,
        "do_resize": True,
        "image_mean": [0.5, 0.5, 0.5],
        "image_processor_type": "Gemma3ImageProcessor",
        "image_seq_length": 4,
        "image_std": [0.5, 0.5, 0.5],
        "pan_and_scan_max_num_crops": None,
        "pan_and_scan_min_crop_size": None,
        "pan_and_scan_min_ratio_to_activate": None,
        "processor_class": "Gemma3Processor",
        "resample": 2,
        "rescale_factor": 1 / 255,
        "size": {"height": 32, "width": 32},
    })
    _write_json(target / "processor_config.json", {"image_seq_length": 4, "processor_class": "Gemma3Processor"})


# ---------------------------------------------------------------------------------------------------------------
# Gemma 4 (all kinds below)
#
# Sources
# - transformers convert_gemma4_weights.py (_VARIANTS gemma-4-e2b / -e4b / -31b / -26b-a4b, _ROPE_PARAMS,
#   _ON_DEVICE_VISION_CONFIG, _LARGE_MODEL_VISION_CONFIG, _DEFAULT_AUDIO_CONFIG, main()): every value quoted as
#   "real" below; rope_parameters {"full_attention": proportional, partial_rotary_factor 0.25, theta 1e6,
#   "sliding_attention": default, theta 1e4}; final_logit_softcapping 30; vision_soft_tokens_per_image 280;
#   eos_token_id [1, 106] for -it; token ids taken from the tokenizer: image "<|image|>" 258880, boi "<|image>"
#   255999, eoi "<image|>" 258882, audio "<|audio|>" 258881, boa "<|audio>" 256000, eoa "<audio|>" 258883 (written
#   as eoa_token_id; Gemma4Config's own field is eoa_token_index, both are in the real config.json); every
#   variant gets a Gemma4Processor with Gemma4AudioFeatureExtractor, Gemma4ImageProcessor(max_soft_tokens=280,
#   pooling_kernel_size=3, do_normalize=False) and Gemma4VideoProcessor(); GenerationConfig eos = [eos, eot
#   "<turn|>" 106, str_token "<|tool_response>" 50], do_sample, top_k 64, top_p 0.95; lm_head tied.
# - transformers configuration_gemma4.py (Gemma4Config, Gemma4TextConfig, Gemma4VisionConfig,
#   Gemma4AudioConfig): defaults (vocab_size 262144, vocab_size_per_layer_input 262144, video_token_id 258884,
#   tie_word_embeddings True, sliding_window 512, max_position_embeddings 131072); global_head_dim and
#   num_global_key_value_heads become per_layer_config of the full-attention layers.
# - transformers modeling_gemma4.py: KV-shared layers (the last num_kv_shared_layers) have no k_proj / v_proj /
#   k_norm and reuse the KV of the last earlier layer of their type; use_double_wide_mlp doubles their MLP;
#   attention_k_eq_v drops v_proj in full layers; Gemma4ClippableLinear wraps the vision/audio linears as
#   `<name>.linear` with input_min/max, output_min/max buffers when use_clipped_linears.
# - google/gemma-4-*-it file lists (Hub commit "Preparing for release!" of gemma-4-31B-it): config.json,
#   generation_config.json, processor_config.json, tokenizer.json, tokenizer_config.json, chat_template.jinja; no
#   tokenizer.model, no preprocessor_config.json. tokenizer_config.json of gemma-4-E2B-it (copied in third-party
#   repos): the named tokens above plus extra_special_tokens ["<|video|>"], padding_side "left",
#   processor_class "Gemma4Processor". Chat-token ids (<|turn> 105, <turn|> 106, <|channel> 100, <channel|> 101,
#   <|think|> 98, <|tool> 46 ... <|"|> 52) come from third-party test fixtures copied from the real vocabulary,
#   not from a Google source: treat them as likely, not certain.
# - llama.cpp conversion/gemma.py: Gemma4Model reads layer_types (sliding pattern), global_head_dim,
#   num_global_key_value_heads, use_double_wide_mlp (n_ff doubled from layer n - num_kv_shared_layers on),
#   num_kv_shared_layers, hidden_size_per_layer_input, expert_intermediate_size / moe_intermediate_size,
#   rope_parameters["full_attention"] (must be proportional); no norm +1. Gemma4VisionAudioModel maps
#   model.vision_tower.encoder.* and model.audio_tower.* (audio mel bins input_feat_size, default 128).
# - transformers 5.5.2 release note "[gemma4] Remove all shared weights, and silently skip them during loading":
#   the Hub E2B/E4B safetensors still hold k_proj / v_proj / k_norm of the KV-shared layers (the converter writes
#   kv_einsum for every layer); the hub layout adds random ones (see _hub_layout).
# ---------------------------------------------------------------------------------------------------------------
_GEMMA4_ROPE = {
    "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1_000_000.0},
    "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
}
_GEMMA4_TOKEN_IDS = dict(image_token_id=258880, boi_token_id=255999, eoi_token_id=258882, audio_token_id=258881,
                         boa_token_id=256000, eoa_token_index=258883, video_token_id=258884)


def _gemma4_text(**overrides):
    from transformers import Gemma4TextConfig

    fields = dict(
        vocab_size=262144,
        vocab_size_per_layer_input=262144,
        hidden_size=HIDDEN,
        intermediate_size=4 * HIDDEN,
        num_attention_heads=4,
        head_dim=HEAD_DIM,
        global_head_dim=GLOBAL_HEAD_DIM,
        sliding_window=SLIDING_WINDOW,
        final_logit_softcapping=30.0,
        rope_parameters=_GEMMA4_ROPE,
        pad_token_id=0,
        bos_token_id=2,
        eos_token_id=1,
        tie_word_embeddings=True,
    )
    fields.update(overrides)
    return Gemma4TextConfig(**fields)


def _gemma4_vision(on_device: bool):
    """Real on-device (E2B, E4B): 768 wide, 16 layers, 12 heads of 64, clipped linears. Real large (26B-A4B,
    31B): 1152 wide, 27 layers, 16 heads of 72, standardize. Both: patch 16, pooling kernel 3."""
    from transformers import Gemma4VisionConfig

    return Gemma4VisionConfig(**VISION, num_key_value_heads=2, head_dim=16, patch_size=VISION_PATCH,
                              pooling_kernel_size=3, position_embedding_size=256,
                              use_clipped_linears=on_device, standardize=not on_device)


def _gemma4_config(text, vision, audio=None, **top):
    from transformers import Gemma4Config

    return Gemma4Config(text_config=text, vision_config=vision, audio_config=audio, **_GEMMA4_TOKEN_IDS,
                        eoa_token_id=258883, vision_soft_tokens_per_image=IMAGE_SOFT_TOKENS, eos_token_id=[1, 106],
                        tie_word_embeddings=True, initializer_range=0.02, **top)


# gemma4-e2b: google/gemma-4-E2B-it (E4B: same structure, 42 layers 5:1, 2 KV heads, 18 KV-shared layers, no
# double-wide MLP). Real E2B text: hidden 1536, hidden_size_per_layer_input 256, intermediate 4*1536, 35 layers
# (4 sliding : 1 full) x 7, 8 heads / 1 KV head, no global KV heads, attention_k_eq_v False, 20 KV-shared layers,
# use_double_wide_mlp True; vision on-device; audio Gemma4AudioConfig() defaults (1024 wide, 12 layers, 8 heads,
# subsampling_conv_channels [128, 32], conv kernel 5, chunk 12, left 13, right 0, logit cap 50, clipped linears,
# output_proj_dims 1536). Tiny: 4 layers [S, F, S, F], the last 2 KV-shared (so each shared layer type has a
# producer), double-wide MLP on them, per-layer inputs of 16; audio 32 wide, 1 layer, 2 heads, output_proj_dims 48
# (real: 1536, not the text width on E4B either); subsampling_conv_channels kept [128, 32]: modeling_gemma4 sizes
# input_proj_linear from channels[0] // 4, which only fits the 128 mel bins of the feature extractor that way.
def _gemma4_e2b_config():
    from transformers import Gemma4AudioConfig

    text = _gemma4_text(num_hidden_layers=4, layer_types=["sliding_attention", "full_attention"] * 2,
                        num_key_value_heads=1, num_global_key_value_heads=None, attention_k_eq_v=False,
                        use_bidirectional_attention=None, hidden_size_per_layer_input=16, num_kv_shared_layers=2,
                        use_double_wide_mlp=True, enable_moe_block=False)
    audio = Gemma4AudioConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                              subsampling_conv_channels=[128, 32], conv_kernel_size=5, attention_chunk_size=12,
                              attention_context_left=13, attention_context_right=0, attention_logit_cap=50.0,
                              use_clipped_linears=True, output_proj_dims=48)
    return _gemma4_config(text, _gemma4_vision(on_device=True), audio)


# gemma4-moe: google/gemma-4-26B-A4B-it. Real text: hidden 2816, intermediate 2112 (the dense MLP that runs beside
# the experts), 30 layers (5 sliding : 1 full) x 5, 16 heads / 8 KV heads, 2 global KV heads, attention_k_eq_v
# True (no v_proj in full layers), use_bidirectional_attention "vision", no KV sharing, no per-layer inputs,
# enable_moe_block True, num_experts 128, top_k_experts 8, moe_intermediate_size 704, sliding_window 1024,
# max_position_embeddings 262144; vision large; no audio. Tiny: 2 layers [S, F], 4 experts, top-2,
# moe_intermediate 16, dense MLP 48 (real ratios to hidden: 0.25 and 0.75).
def _gemma4_moe_config():
    text = _gemma4_text(num_hidden_layers=2, layer_types=["sliding_attention", "full_attention"],
                        intermediate_size=48, num_key_value_heads=2, num_global_key_value_heads=1,
                        attention_k_eq_v=True, use_bidirectional_attention="vision", hidden_size_per_layer_input=0,
                        num_kv_shared_layers=0, use_double_wide_mlp=False, enable_moe_block=True, num_experts=4,
                        top_k_experts=2, moe_intermediate_size=16, max_position_embeddings=262144)
    return _gemma4_config(text, _gemma4_vision(on_device=False))


# gemma4-dense: google/gemma-4-31B-it. Real text: hidden 5376, intermediate 4*5376, 60 layers (5:1) x 10,
# 32 heads / 16 KV heads, 4 global KV heads, attention_k_eq_v True, use_bidirectional_attention "vision", no KV
# sharing, no per-layer inputs, sliding_window 1024, max_position_embeddings 262144; vision large; no audio.
def _gemma4_dense_config():
    text = _gemma4_text(num_hidden_layers=2, layer_types=["sliding_attention", "full_attention"],
                        num_key_value_heads=2, num_global_key_value_heads=1, attention_k_eq_v=True,
                        use_bidirectional_attention="vision", hidden_size_per_layer_input=0, num_kv_shared_layers=0,
                        use_double_wide_mlp=False, enable_moe_block=False, max_position_embeddings=262144)
    return _gemma4_config(text, _gemma4_vision(on_device=False))


# ---------------------------------------------------------------------------------------------------------------
# gemma4-unified: google/gemma-4-12B-it, Gemma4UnifiedForConditionalGeneration (encoder-free: no vision or audio
# tower; raw 48x48 patches go through LayerNorm -> Linear -> LayerNorm -> + factorised 2D position embedding ->
# LayerNorm -> RMSNorm -> Linear, raw 40 ms waveform frames through RMSNorm -> Linear).
#
# Sources
# - transformers convert_gemma4_unified_weights.py (_VARIANTS gemma-4-12b): text hidden 3840, intermediate
#   4*3840, 48 layers (5:1) x 8, 16 heads / 8 KV heads, 1 global KV head, attention_k_eq_v True,
#   use_bidirectional_attention "vision", no KV sharing, no double-wide MLP, final_logit_softcapping 30,
#   rope as Gemma 4; vision_config Gemma4UnifiedVisionConfig() (patch 16, pooling kernel 3, mm_embed_dim 3840,
#   mm_posemb_size 1120, output_proj_dims 3840) and audio_config Gemma4UnifiedAudioConfig() (audio_embed_dim 640 =
#   samples per token); Hub weight names model.vision_embedder.* and model.embed_vision.embedding_projection /
#   model.embed_audio.embedding_projection; the EOA / EOI rows of the embedding carry projected extra
#   embeddings; GenerationConfig suppress_tokens [eoa, eoi]; processor Gemma4UnifiedProcessor with
#   Gemma4UnifiedAudioFeatureExtractor, Gemma4UnifiedImageProcessor(do_normalize=False, pooling_kernel_size 3),
#   Gemma4UnifiedVideoProcessor; same tokenizer construction as Gemma 4. Not mirrored: the EOA / EOI embedding
#   rows are as random as the others.
# - transformers configuration_gemma4_unified.py (Gemma4UnifiedConfig and its text / vision / audio configs:
#   sliding_window 1024, max_position_embeddings 262144, the same token-id defaults as Gemma 4) and
#   conversion_mapping.py ("gemma4_unified": vision_embedder.patch_* -> embed_vision.patch_*,
#   embed_vision.embedding_projection -> embed_vision.multimodal_embedder.embedding_projection).
# - llama.cpp conversion/gemma.py Gemma4UnifiedModel (text as Gemma 4, suppress_tokens from
#   generation_config.json) and Gemma4UnifiedVisionAudioModel (mm_embed_dim, audio_embed_dim, model_patch_size or
#   patch_size * pooling_kernel_size; pos_embedding, patch_ln*, patch_dense).
# Tiny: 2 text layers [S, F], patch 4 (12 px model patches), mm_embed_dim 64 (= text width, as real),
# mm_posemb_size 256; audio_embed_dim kept at the real 640, since it is the feature extractor's frame length.
# ---------------------------------------------------------------------------------------------------------------
def _gemma4_unified_config():
    from transformers import (
        Gemma4UnifiedAudioConfig,
        Gemma4UnifiedConfig,
        Gemma4UnifiedTextConfig,
        Gemma4UnifiedVisionConfig,
    )

    text = Gemma4UnifiedTextConfig(
        vocab_size=262144, hidden_size=HIDDEN, intermediate_size=4 * HIDDEN, num_hidden_layers=2,
        layer_types=["sliding_attention", "full_attention"], num_attention_heads=4, num_key_value_heads=2,
        num_global_key_value_heads=1, head_dim=HEAD_DIM, global_head_dim=GLOBAL_HEAD_DIM, attention_k_eq_v=True,
        use_bidirectional_attention="vision", num_kv_shared_layers=0, use_double_wide_mlp=False,
        final_logit_softcapping=30.0, rope_parameters=_GEMMA4_ROPE, sliding_window=SLIDING_WINDOW,
        pad_token_id=0, bos_token_id=2, eos_token_id=1, tie_word_embeddings=True,
        # "BC: not used by the model" keys the converter passes, so they are in the real config.json (llama.cpp's
        # Gemma4Model.set_gguf_parameters needs moe_intermediate_size present, even null)
        vocab_size_per_layer_input=0, hidden_size_per_layer_input=0, enable_moe_block=False, num_experts=None,
        top_k_experts=None, moe_intermediate_size=None)
    vision = Gemma4UnifiedVisionConfig(patch_size=VISION_PATCH, pooling_kernel_size=3, mm_embed_dim=HIDDEN,
                                       mm_posemb_size=256, output_proj_dims=HIDDEN)
    audio = Gemma4UnifiedAudioConfig(audio_embed_dim=640)
    return Gemma4UnifiedConfig(text_config=text, vision_config=vision, audio_config=audio, **_GEMMA4_TOKEN_IDS,
                               eos_token_id=[1, 106], tie_word_embeddings=True, initializer_range=0.02)


# ---------------------------------------------------------------------------------------------------------------
# Files beside the weights
# ---------------------------------------------------------------------------------------------------------------
# id -> Gemma 4 token that replaces the Gemma 3 token at that id (see the module docstring and the sources above).
_GEMMA4_SPECIAL_TOKENS = {
    46: "<|tool>", 47: "<tool|>", 48: "<|tool_call>", 49: "<tool_call|>", 50: "<|tool_response>",
    51: "<tool_response|>", 52: '<|"|>', 98: "<|think|>", 100: "<|channel>", 101: "<channel|>", 105: "<|turn>",
    106: "<turn|>", 255999: "<|image>", 256000: "<|audio>", 258880: "<|image|>", 258881: "<|audio|>",
    258882: "<image|>", 258883: "<audio|>", 258884: "<|video|>",
}
# tokenizer_config.json names of google/gemma-4-*-it.
_GEMMA4_NAMED_TOKENS = {
    "image_token": "<|image|>", "boi_token": "<|image>", "eoi_token": "<image|>", "audio_token": "<|audio|>",
    "boa_token": "<|audio>", "eoa_token": "<audio|>", "sot_token": "<|turn>", "eot_token": "<turn|>",
    "soc_token": "<|channel>", "eoc_token": "<channel|>", "think_token": "<|think|>", "escape_token": '<|"|>',
    "str_token": "<|tool_response>", "etr_token": "<tool_response|>", "stc_token": "<|tool_call>",
    "etc_token": "<tool_call|>", "std_token": "<|tool>", "etd_token": "<tool|>",
}
_GEMMA3_NAMED_TOKENS = {"boi_token": "<start_of_image>", "eoi_token": "<end_of_image>",
                        "image_token": "<image_soft_token>"}


def _write_json(path: Path, data: Any) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def _patch_tokenizer_json(path: Path, renames: dict[int, str], additions: list[str], add_bos: bool = True) -> None:
    """Rename tokens in place (added_tokens entry and vocabulary key), append special tokens after the last id and
    keep or drop the <bos> that the post-processor adds. Only the part before "model" is parsed; the 31 MB
    vocabulary (in id order, as the tokenizers library writes it) is edited as bytes in one forward pass."""
    data = path.read_bytes()
    split = data.index(b'"model"')
    head = json.loads(data[:split].decode("utf-8") + '"": null}')
    del head[""]
    by_id = {entry["id"]: entry for entry in head["added_tokens"]}
    parts, cursor = [], split
    for token_id in sorted(renames):
        suffix = b": %d," % token_id
        entry = json.dumps(by_id[token_id]["content"], ensure_ascii=False).encode("utf-8") + suffix
        found = data.find(entry, cursor)
        if found < 0:
            raise ValueError(f"{path}: no vocabulary entry {entry.decode()!r} after the previous one")
        parts += [data[cursor:found], json.dumps(renames[token_id], ensure_ascii=False).encode("utf-8") + suffix]
        cursor = found + len(entry)
        by_id[token_id]["content"] = renames[token_id]
    parts.append(data[cursor:])
    next_id = max(by_id) + 1
    for content in additions:
        head["added_tokens"].append({"id": next_id, "content": content, "single_word": False, "lstrip": False,
                                     "rstrip": False, "normalized": False, "special": True})
        next_id += 1
    if not add_bos:  # what GemmaTokenizer(add_bos_token=False) writes
        head["post_processor"] = {
            "type": "TemplateProcessing", "single": [{"Sequence": {"id": "A", "type_id": 0}}],
            "pair": [{"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
            "special_tokens": {}}
    text = json.dumps(head, indent=2, ensure_ascii=False)
    path.write_bytes(text[:text.rindex("}")].rstrip().encode("utf-8") + b",\n  " + b"".join(parts))


def _patch_tokenizer_config(path: Path, updates: dict[str, Any]) -> None:
    config = json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}
    config.update(updates)
    config.pop("added_tokens_decoder", None)  # stale for renamed ids; tokenizer.json is the source of truth
    _write_json(path, config)


def _tokenizer_files(kind: str, target: Path) -> None:
    if kind == "gemma3-mm":
        _patch_tokenizer_json(target / "tokenizer.json", {}, ["<image_soft_token>"])
        _patch_tokenizer_config(target / "tokenizer_config.json", {
            **_GEMMA3_NAMED_TOKENS, "extra_special_tokens": dict(_GEMMA3_NAMED_TOKENS),
            "processor_class": "Gemma3Processor"})
        return
    # The converters build Gemma 4's GemmaTokenizer with add_bos_token=False for the -it checkpoints (the chat
    # template writes <bos>); Gemma 3's adds it.
    _patch_tokenizer_json(target / "tokenizer.json", _GEMMA4_SPECIAL_TOKENS, [], add_bos=False)
    processor = "Gemma4UnifiedProcessor" if kind == "gemma4-unified" else "Gemma4Processor"
    _patch_tokenizer_config(target / "tokenizer_config.json", {
        **_GEMMA4_NAMED_TOKENS, "extra_special_tokens": ["<|video|>"], "padding_side": "left",
        "processor_class": processor})
    for name in ("tokenizer.model", "special_tokens_map.json"):  # not shipped by Gemma 4; would disagree
        (target / name).unlink(missing_ok=True)


def write_gemma4_tokenizer(target: Path, tokenizer_dir: Path) -> Path:
    """Only the tokenizer files of a Gemma 4 checkpoint (its special tokens at their real ids) in `target`."""
    import shutil

    from tests.tiny_models import TOKENIZER_FILES

    target.mkdir(parents=True, exist_ok=True)
    for name in TOKENIZER_FILES:
        if (tokenizer_dir / name).is_file():
            shutil.copy(tokenizer_dir / name, target / name)
    _tokenizer_files("gemma4-e2b", target)
    return target


def _gemma4_processor_files(kind: str, target: Path) -> None:
    """processor_config.json in the nested form google/gemma-4-*-it ship (no preprocessor_config.json)."""
    image = {
        "do_convert_rgb": True, "do_normalize": False, "do_rescale": True, "do_resize": True,
        "image_mean": [0.0, 0.0, 0.0], "image_std": [1.0, 1.0, 1.0], "max_soft_tokens": IMAGE_SOFT_TOKENS,
        "patch_size": VISION_PATCH, "pooling_kernel_size": 3, "resample": 3, "rescale_factor": 1 / 255,
    }
    video = {**image, "do_normalize": True, "do_sample_frames": True, "num_frames": 32, "max_soft_tokens": 70}
    if kind == "gemma4-unified":
        from transformers import Gemma4UnifiedAudioFeatureExtractor

        features = json.loads(Gemma4UnifiedAudioFeatureExtractor().to_json_string())
        names = ("Gemma4UnifiedImageProcessor", "Gemma4UnifiedVideoProcessor", "Gemma4UnifiedProcessor")
    else:
        from transformers import Gemma4AudioFeatureExtractor

        features = json.loads(Gemma4AudioFeatureExtractor().to_json_string())
        names = ("Gemma4ImageProcessor", "Gemma4VideoProcessor", "Gemma4Processor")
    _write_json(target / "processor_config.json", {
        "audio_ms_per_token": 40,
        "audio_seq_length": 750,
        "feature_extractor": features,
        "image_processor": {**image, "image_processor_type": names[0]},
        "image_seq_length": IMAGE_SOFT_TOKENS,
        "processor_class": names[2],
        "video_processor": {**video, "video_processor_type": names[1]},
    })


def _generation_config(kind: str, config, target: Path) -> None:
    """generation_config.json as the converters write it for the -it checkpoints (sampling on by default)."""
    from transformers import GenerationConfig

    if kind == "gemma3-mm":
        generation = GenerationConfig(pad_token_id=0, bos_token_id=2, eos_token_id=[1, 106],
                                      cache_implementation="hybrid", do_sample=True, top_k=64, top_p=0.95)
    else:
        suppress = [config.eoa_token_index, config.eoi_token_id] if kind == "gemma4-unified" else None
        generation = GenerationConfig(pad_token_id=0, bos_token_id=2, eos_token_id=[1, 106, 50], temperature=1.0,
                                      do_sample=True, top_k=64, top_p=0.95, suppress_tokens=suppress)
    generation.save_pretrained(target)


# ---------------------------------------------------------------------------------------------------------------
# Weights
# ---------------------------------------------------------------------------------------------------------------
def _randomize_trained_constants(model) -> None:
    """Give random values to what real checkpoints hold as trained numbers but transformers initialises to a
    constant: layer_scalar (1), router scale / per_expert_scale (1), clip bounds (+-inf), std_bias / std_scale
    (0 / 1), Gemma 3's image projection (0: every picture would give the same soft tokens). The clip bounds (2 to 4
    in magnitude) are a guess: the real ones are per-layer activation ranges."""
    import torch

    with torch.no_grad():
        for name, buffer in model.named_buffers():
            if name.endswith("layer_scalar"):
                buffer.uniform_(0.5, 1.5)
            elif name.endswith(("input_min", "output_min")):
                buffer.fill_(-float(torch.empty(()).uniform_(2.0, 4.0)))
            elif name.endswith(("input_max", "output_max")):
                buffer.fill_(float(torch.empty(()).uniform_(2.0, 4.0)))
            elif name.endswith("std_bias"):
                buffer.normal_(0.0, 0.1)
            elif name.endswith("std_scale"):
                buffer.uniform_(0.5, 1.5)
        for name, param in model.named_parameters():
            if name.endswith(("router.scale", "router.per_expert_scale")):
                param.uniform_(0.5, 1.5)
            elif name.endswith("mm_input_projection_weight"):  # (vision width, text width), as nn.Linear would draw
                param.normal_(0.0, param.shape[0] ** -0.5)


def _hub_layout(kind: str, model, target: Path) -> None:
    """Rewrite model.safetensors with what the Hub checkpoints hold where transformers 5.x save_pretrained differs:
    - gemma3-mm: the SigLIP tower as vision_tower.vision_model.* (transformers 5 loads it into model.vision_tower.*
      through conversion_mapping's "SiglipVisionModel" PrefixChange and saves vision_tower.*, which llama.cpp's
      mmproj converter cannot map: "Can not map tensor 'vision_tower.embeddings.patch_embedding.bias'").
    - gemma4-e2b: self_attn.k_proj / v_proj / k_norm in the KV-shared layers (unused; transformers >= 5.5.2 skips
      them on load and does not save them).
    - gemma4-unified: model.vision_embedder.{patch_ln1,patch_dense,patch_ln2,pos_embedding,pos_norm} and
      model.embed_vision.embedding_projection (conversion_mapping "gemma4_unified"; transformers 5.24 already
      writes these names back, so this is a no-op there)."""
    import torch
    from safetensors.torch import load_file, save_file

    path = target / "model.safetensors"
    tensors = load_file(path)
    renamed: dict[str, torch.Tensor] = {}
    for key, value in tensors.items():
        if kind == "gemma3-mm" and key.startswith("vision_tower.") and not key.startswith("vision_tower.vision_model."):
            key = "vision_tower.vision_model." + key.removeprefix("vision_tower.")
        elif kind == "gemma4-unified":
            for part in ("patch_ln1", "patch_dense", "patch_ln2", "pos_embedding", "pos_norm"):
                key = key.replace(f"model.embed_vision.{part}", f"model.vision_embedder.{part}")
            key = key.replace("model.embed_vision.multimodal_embedder.embedding_projection",
                              "model.embed_vision.embedding_projection")
        renamed[key] = value
    if kind == "gemma4-e2b":
        text = model.config.text_config
        first_shared = text.num_hidden_layers - text.num_kv_shared_layers
        for layer in range(first_shared, text.num_hidden_layers):
            layer_config = text.per_layer_config[layer]
            width = layer_config.num_key_value_heads * layer_config.head_dim
            prefix = f"model.language_model.layers.{layer}.self_attn"
            renamed[f"{prefix}.k_proj.weight"] = torch.randn(width, text.hidden_size) * 0.02
            renamed[f"{prefix}.v_proj.weight"] = torch.randn(width, text.hidden_size) * 0.02
            renamed[f"{prefix}.k_norm.weight"] = torch.empty(layer_config.head_dim).uniform_(-0.5, 0.5)
    save_file(renamed, path, metadata={"format": "pt"})


_BUILDERS = {
    "gemma3-mm": ("Gemma3ForConditionalGeneration", _gemma3_mm_config),
    "gemma4-e2b": ("Gemma4ForConditionalGeneration", _gemma4_e2b_config),
    "gemma4-moe": ("Gemma4ForConditionalGeneration", _gemma4_moe_config),
    "gemma4-dense": ("Gemma4ForConditionalGeneration", _gemma4_dense_config),
    "gemma4-unified": ("Gemma4UnifiedForConditionalGeneration", _gemma4_unified_config),
}


def build_checkpoint(kind: str, target: Path, tokenizer_dir: Path, seed: int = 0, *, hub_layout: bool = True) -> Path:
    """Write a tiny random checkpoint of `kind` (one of KINDS) with the tokenizer from `tokenizer_dir` (the real
    Gemma 3 one) into `target`, and return `target`. The same seed gives the same weights."""
    import torch
    import transformers

    from tests.tiny_models import save_tiny

    if kind not in _BUILDERS:
        raise ValueError(f"unknown checkpoint kind {kind!r}; one of {', '.join(KINDS)}")
    class_name, make_config = _BUILDERS[kind]
    target = Path(target)
    target.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    config = make_config()
    model = getattr(transformers, class_name)(config)
    _randomize_trained_constants(model)
    save_tiny(model, target, Path(tokenizer_dir))
    if hub_layout:
        _hub_layout(kind, model, target)
    _generation_config(kind, config, target)
    _tokenizer_files(kind, target)
    if kind == "gemma3-mm":
        _gemma3_mm_processor_files(target)
    else:
        _gemma4_processor_files(kind, target)
    return target
