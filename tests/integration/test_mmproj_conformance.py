"""Our projector GGUF (mmproj) against llama.cpp's own `convert_hf_to_gguf.py --mmproj`, and in llama.cpp's mtmd.

For each multimodal checkpoint kind (tests/checkpoint_kinds.py: Gemma 3 4B-27B, Gemma 4 E2B/E4B with vision and
audio, Gemma 4 26B-A4B and 31B with vision only, Gemma 4 12B Unified with its vision and audio input projections)
the f16 mmproj must be the converter's file: every key (general.* included, in the same order and with the same
types), every tensor (names, order, types, shapes, data), down to the bytes. Then llama.cpp (llama-cpp-python's
libmtmd) loads it beside our text GGUF and encodes an image (and a second of audio for E2B and Unified) with it;
for Unified, whose projector has no tower to hide a mistake in, the image embeddings equal transformers'.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import numpy as np
import pytest

from gemmaforge.export.gguf_mmproj import write_mmproj
from gemmaforge.gguf_file import read_gguf
from tests.llama_cpp_reference import assert_same_file, run_converter

pytestmark = pytest.mark.integration
llama_cpp = pytest.importorskip("llama_cpp")

# kind -> towers
KINDS = {"gemma3-mm": ("vision",), "gemma4-e2b": ("vision", "audio"), "gemma4-moe": ("vision",),
         "gemma4-dense": ("vision",), "gemma4-unified": ("vision", "audio")}


def reference_mmproj(converter: Path, checkpoint: Path, out: Path, *extra: str) -> Path:  # noqa: F811
    run_converter(converter, "convert_hf_to_gguf.py", str(checkpoint), "--mmproj", "--outtype", "f16", "--outfile",
                  str(out), *extra)
    return out


@pytest.mark.parametrize("kind", KINDS)
def test_mmproj_equals_llama_cpps_converter(kind: str, converter: Path, checkpoint_of, mmproj_of,  # noqa: F811
                                            tmp_path: Path) -> None:
    ours_path = mmproj_of(kind)
    theirs_path = reference_mmproj(converter, checkpoint_of(kind), tmp_path / "reference-mmproj-f16.gguf")
    ours, theirs = read_gguf(ours_path), read_gguf(theirs_path)
    assert_same_file(ours, theirs, "clip", set())  # nothing allowed to differ, general.name included
    assert [(k, f.type, f.item_type) for k, f in ours.fields.items()] == \
        [(k, f.type, f.item_type) for k, f in theirs.fields.items()]
    assert [t.name for t in ours.tensors] == [t.name for t in theirs.tensors]
    assert ours_path.read_bytes() == theirs_path.read_bytes()
    assert ("clip.has_audio_encoder" in ours.fields) == ("audio" in KINDS[kind])


def test_gemma3_as_transformers_saves_it_gives_the_same_projector(checkpoint_of, embedded_model,
                                                                 tmp_path: Path) -> None:
    """transformers 5 saves a SigLIP tower it built itself as vision_tower.* (no vision_model. level), which
    llama.cpp's converter cannot map: the same tensors give the same file as the Hub layout."""
    from tests.checkpoint_kinds import build_checkpoint

    plain = build_checkpoint("gemma3-mm", tmp_path / "plain", embedded_model.path, hub_layout=False)
    hub = checkpoint_of("gemma3-mm")  # seed 0 too: the same weights under the Hub's names
    a = write_mmproj(plain, tmp_path / "plain.gguf", name="tiny")
    b = write_mmproj(hub, tmp_path / "hub.gguf", name="tiny")
    assert a.read_bytes() == b.read_bytes()


def test_gemma4_unified_with_transformers_module_names_gives_the_same_projector(checkpoint_of, mmproj_of,
                                                                              tmp_path: Path) -> None:
    """The Hub names Unified's vision embedder model.vision_embedder.* and its projection
    model.embed_vision.embedding_projection; transformers' module tree has model.embed_vision.{patch_*, pos_*,
    multimodal_embedder.embedding_projection} (transformers 5.24 saves the Hub's names back). A folder saved under the
    module names gives the same file."""
    import shutil

    from safetensors.torch import load_file, save_file

    original = checkpoint_of("gemma4-unified")
    folder = shutil.copytree(original, tmp_path / original.name)  # the same name: the same general.* keys
    renamed = {}
    for name, value in load_file(folder / "model.safetensors").items():
        name = name.replace("model.vision_embedder.", "model.embed_vision.")
        renamed[name.replace("model.embed_vision.embedding_projection",
                             "model.embed_vision.multimodal_embedder.embedding_projection")] = value
    assert "model.embed_vision.patch_dense.weight" in renamed
    save_file(renamed, folder / "model.safetensors", metadata={"format": "pt"})
    ours = write_mmproj(folder, tmp_path / "mmproj.gguf")
    assert ours.read_bytes() == mmproj_of("gemma4-unified").read_bytes()


def test_gemma4_unified_projector_computes_what_transformers_computes(checkpoint_of, mmproj_of,
                                                                      text_gguf_of) -> None:
    """Unified has no vision tower: llama.cpp runs its patch LayerNorm -> Linear on CHW-ordered pixels (hence the
    converter's HWC -> CHW permutation of patch_ln1 and patch_dense), LayerNorm, the x and y position embeddings,
    LayerNorm, RMSNorm, projection. An image of exactly 70 model patches (7 x 10 of 12 px: neither side resizes it)
    gives transformers' soft tokens, within f16 weights."""
    import torch
    from llama_cpp import mtmd_cpp as mtmd
    from PIL import Image
    from transformers import Gemma4UnifiedForConditionalGeneration

    from gemmaforge.vision_unified import UnifiedImageProcessor

    checkpoint = checkpoint_of("gemma4-unified")
    rgb = np.random.default_rng(0).integers(0, 256, size=(84, 120, 3), dtype=np.uint8)
    inputs = UnifiedImageProcessor.load(checkpoint)(images=[Image.fromarray(rgb)])
    assert int(inputs["num_soft_tokens_per_image"][0]) == 70
    model = Gemma4UnifiedForConditionalGeneration.from_pretrained(checkpoint, dtype=torch.float32).eval()
    with torch.no_grad():
        want = model.get_image_features(inputs["pixel_values"], inputs["image_position_ids"]).pooler_output[0].numpy()

    text = text_gguf_of("gemma4-unified")
    llm = llama_cpp.Llama(model_path=str(text), n_ctx=256, n_threads=2, verbose=False)
    params = mtmd.mtmd_context_params_default()
    params.use_gpu, params.n_threads, params.print_timings, params.warmup = False, 2, False, False
    ctx = mtmd.mtmd_init_from_file(str(mmproj_of("gemma4-unified")).encode(), llm.model, params)
    assert ctx, "llama.cpp refused the projector file (see its log on stderr)"
    try:
        image = mtmd.mtmd_bitmap_init(120, 84, rgb.ctypes.data_as(ctypes.POINTER(ctypes.c_uint8)))
        try:
            got = _encode(mtmd, ctx, image, llama_cpp.llama_model_n_embd(llm.model))
        finally:
            mtmd.mtmd_bitmap_free(image)
    finally:
        mtmd.mtmd_free(ctx)
        llm.close()
    assert got.shape == want.shape
    error = float(np.linalg.norm(got - want) / np.linalg.norm(want))
    print(f"gemma4-unified: image embeddings relative error {error:.2e}")
    assert error < 2e-3  # measured 4e-4


def _encode(mtmd, ctx, bitmap, n_embd: int) -> np.ndarray:
    """Tokenize "<marker>" with one image or audio clip and run the projector on its chunk: its embeddings."""
    chunks = mtmd.mtmd_input_chunks_init()
    try:
        marker = mtmd.mtmd_default_marker()
        text = mtmd.mtmd_input_text(marker, len(marker), False, True)
        bitmaps = (mtmd.mtmd_bitmap_p_ctypes * 1)(bitmap)
        assert mtmd.mtmd_tokenize(ctx, chunks, ctypes.byref(text), bitmaps, 1) == 0
        media = [mtmd.mtmd_input_chunks_get(chunks, i) for i in range(mtmd.mtmd_input_chunks_size(chunks))]
        media = [c for c in media if mtmd.mtmd_input_chunk_get_type(c) != mtmd.MTMD_INPUT_CHUNK_TYPE_TEXT]
        assert len(media) == 1
        n_tokens = mtmd.mtmd_input_chunk_get_n_tokens(media[0])
        assert n_tokens > 0
        assert mtmd.mtmd_encode_chunk(ctx, media[0]) == 0
        out = mtmd.mtmd_get_output_embd(ctx)
        return np.ctypeslib.as_array(out, shape=(n_tokens * n_embd,)).reshape(n_tokens, n_embd).copy()
    finally:
        mtmd.mtmd_input_chunks_free(chunks)


def _bitmap(mtmd, rgb: np.ndarray):
    return mtmd.mtmd_bitmap_init(rgb.shape[1], rgb.shape[0], rgb.ctypes.data_as(ctypes.POINTER(ctypes.c_uint8)))


def _clip(mtmd, hz: float):
    """One second of a tone at llama.cpp's 16 kHz."""
    t = np.arange(16000, dtype=np.float32) / 16000
    wave = (0.3 * np.sin(2 * np.pi * hz * t)).astype(np.float32)
    return mtmd.mtmd_bitmap_init_from_audio(len(wave), wave.ctypes.data_as(ctypes.POINTER(ctypes.c_float)))


def _encoded_twice_and_another(mtmd, ctx, n_embd: int, first, second) -> np.ndarray:
    """Each input gives finite embeddings, the same ones when encoded again, and other ones than the other input
    (its content reaches them)."""
    try:
        a = _encode(mtmd, ctx, first, n_embd)
        assert np.isfinite(a).all() and np.array_equal(_encode(mtmd, ctx, first, n_embd), a)
        b = _encode(mtmd, ctx, second, n_embd)
        assert np.isfinite(b).all() and (a.shape != b.shape or not np.allclose(a, b, rtol=1e-3, atol=1e-3))
    finally:
        mtmd.mtmd_bitmap_free(first)
        mtmd.mtmd_bitmap_free(second)
    return a


@pytest.mark.parametrize("kind", KINDS)
def test_llama_cpp_loads_the_projector_beside_the_text_model(kind: str, checkpoint_of, mmproj_of,
                                                            text_gguf_of) -> None:
    """llama.cpp's mtmd loads our projector beside our text file and encodes an image (and audio where the kind has
    it): finite, repeatable embeddings that follow the input; Gemma 3's image is its fixed mm_tokens_per_image."""
    import json

    from llama_cpp import mtmd_cpp as mtmd

    text = text_gguf_of(kind)
    llm = llama_cpp.Llama(model_path=str(text), vocab_only=False, n_ctx=256, n_threads=2, verbose=False)
    params = mtmd.mtmd_context_params_default()
    params.use_gpu, params.n_threads, params.print_timings, params.warmup = False, 2, False, False
    ctx = mtmd.mtmd_init_from_file(str(mmproj_of(kind)).encode(), llm.model, params)
    assert ctx, "llama.cpp refused the projector file (see its log on stderr)"
    try:
        assert mtmd.mtmd_support_vision(ctx)
        assert mtmd.mtmd_support_audio(ctx) == ("audio" in KINDS[kind])
        n_embd = llama_cpp.llama_model_n_embd(llm.model)
        rng = np.random.default_rng(0)
        rgb = [rng.integers(0, 256, size=(48, 64, 3), dtype=np.uint8) for _ in range(2)]
        image = _encoded_twice_and_another(mtmd, ctx, n_embd, _bitmap(mtmd, rgb[0]), _bitmap(mtmd, rgb[1]))
        if kind == "gemma3-mm":
            config = json.loads((checkpoint_of(kind) / "config.json").read_text())
            assert len(image) == config["mm_tokens_per_image"]
        if "audio" in KINDS[kind]:
            _encoded_twice_and_another(mtmd, ctx, n_embd, _clip(mtmd, 440), _clip(mtmd, 1000))
    finally:
        mtmd.mtmd_free(ctx)
        llm.close()
