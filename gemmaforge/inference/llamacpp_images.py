"""Pictures and sound for the llama.cpp engine: llama.cpp's mtmd with the exported projector (`mmproj-f16.gguf`)
beside the text GGUF, as `llama-mtmd-cli --mmproj` and `llama-server --mmproj` run it.

mtmd writes each image as its begin token, the projector's embeddings and its end token (`<start_of_image>` ...
`<end_of_image>` for Gemma 3, `<|image>` ... `<image|>` for Gemma 4) where the text has its media marker; the
chat format's placeholder becomes that marker inside the margin Gemma's processor puts around an image, so the
sequence is the one the transformers engine feeds (vision.py). A clip (Gemma 4 E2B/E4B, whose projector carries
the audio encoder) is written the same way (`<|audio>` ... `<audio|>`, no margin: audio.py), its samples given at
the rate the projector asks for. mtmd takes the media in the order of their markers in the text."""

from __future__ import annotations

import ctypes
import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from gemmaforge.families import Family


def projector_beside(gguf: Path) -> tuple[Path | None, str | None]:
    """The projector `export gguf` writes beside a multimodal model's file (mmproj*.gguf), or None and why not when
    there are several."""
    projectors = sorted(gguf.parent.glob("mmproj*.gguf"))
    if len(projectors) > 1:
        return None, (f"{len(projectors)} projector files (mmproj*.gguf) beside {gguf.name}: keep the one that "
                      "belongs to it")
    return (projectors[0] if projectors else None), None


class Projector:
    """An mtmd context over `path` for the loaded `llm`; its calls are serialised (request threads tokenize,
    the engine thread evaluates)."""

    def __init__(self, path: Path, llm: Any, family: Family):
        from llama_cpp import mtmd_cpp as mtmd
        from llama_cpp._logger import llama_log_callback

        # mtmd logs through llama-cpp-python's logger, as llama.cpp does (errors only, with verbose=False), not
        # a line per image on stderr
        mtmd.mtmd_log_set(llama_log_callback, ctypes.c_void_p(0))
        mtmd.mtmd_helper_log_set(llama_log_callback, ctypes.c_void_p(0))
        self.path, self._mtmd, self._family = path, mtmd, family
        params = mtmd.mtmd_context_params_default()
        params.use_gpu, params.n_threads, params.print_timings, params.warmup = False, os.cpu_count(), False, False
        self._ctx = mtmd.mtmd_init_from_file(str(path).encode(), llm.model, params)
        if not self._ctx:
            raise ValueError(f"{path}: llama.cpp could not load this projector beside the text model")
        if not mtmd.mtmd_support_vision(self._ctx):
            mtmd.mtmd_free(self._ctx)
            raise ValueError(f"{path}: this projector has no vision encoder")
        # the rate mtmd reads clips at (16 kHz for Gemma 4); None: this projector has no audio encoder
        self.audio_rate: int | None = mtmd.mtmd_get_audio_sample_rate(self._ctx) \
            if mtmd.mtmd_support_audio(self._ctx) else None
        self._lock = threading.Lock()

    def inputs(self, text: str, images: list[Any], clips: list[Any]) -> dict[str, Any]:
        """What Job.media holds for the engine: mtmd's text and, in the order of their markers, the pictures' RGB
        pixels ("image", width, height, bytes) and the clips' float32 samples ("audio", array)."""
        chat = self._family.chat
        marker = self._mtmd.mtmd_default_marker().decode()
        markers = {chat.image: f"{chat.image_margin}{marker}{chat.image_margin}"}
        pending: dict[str, list[tuple[Any, ...]]] = {
            chat.image: [("image", im.width, im.height, im.tobytes()) for im in images]}
        if chat.audio:
            markers[chat.audio] = marker
            pending[chat.audio] = [("audio", clip) for clip in clips]
        ordered, out, rest = [], "", text
        while True:  # each marker in the text, first to last, takes the next medium of its kind
            found = [(rest.find(m), m) for m in markers if m in rest]
            if not found:
                break
            at, which = min(found)
            ordered.append(pending[which].pop(0))
            out, rest = out + rest[:at] + markers[which], rest[at + len(which):]
        return {"text": out + rest, "media": ordered}

    def prompt_ids(self, inputs: dict[str, Any]) -> list[int]:
        """The prompt's token ids, each image's positions holding -1 (their count is what the context holds)."""
        ids: list[int] = []
        with self._chunks(inputs) as chunks:
            for chunk in chunks:
                text = self._text_tokens(chunk)
                ids += text if text is not None else [-1] * self._mtmd.mtmd_input_chunk_get_n_tokens(chunk)
        return ids

    def evaluate(self, llm: Any, inputs: dict[str, Any]) -> list[int]:
        """Evaluate the prompt into `llm`'s cleared context (text chunks by llm.eval, images by mtmd), and return
        what llm.generate then continues from: its own record of the prompt, whose image positions it never
        compares with another prompt (the engine resets llm after the request)."""
        import llama_cpp

        llm.reset()
        llm._ctx.kv_cache_clear()
        with self._chunks(inputs) as chunks:
            for chunk in chunks:
                text = self._text_tokens(chunk)
                if text is not None:
                    llm.eval(text)
                    continue
                n_past = llama_cpp.llama_pos(0)
                if self._mtmd.mtmd_helper_eval_chunk_single(self._ctx, llm._ctx.ctx, chunk, llm.n_tokens, 0,
                                                             llm.n_batch, False, ctypes.byref(n_past)) != 0:
                    raise RuntimeError("llama.cpp could not evaluate a picture or a clip")
                llm.n_tokens = n_past.value
        return llm.input_ids[:llm.n_tokens].tolist()

    def close(self) -> None:
        with self._lock:  # a request thread may be tokenizing: it finishes first, and later ones are refused
            self._mtmd.mtmd_free(self._ctx)
            self._ctx = None

    @contextmanager
    def _chunks(self, inputs: dict[str, Any]) -> Iterator[list[Any]]:
        mtmd = self._mtmd
        with self._lock:
            if self._ctx is None:
                raise ValueError("the model was unloaded")
            chunks, bitmaps = mtmd.mtmd_input_chunks_init(), []
            try:
                for medium in inputs["media"]:
                    bitmaps.append(_bitmap(mtmd, medium))
                encoded = inputs["text"].encode()
                text = mtmd.mtmd_input_text(encoded, len(encoded), False, True)  # no <bos> added; specials parsed
                array = (mtmd.mtmd_bitmap_p_ctypes * len(bitmaps))(*bitmaps)
                status = mtmd.mtmd_tokenize(self._ctx, chunks, ctypes.byref(text), array, len(bitmaps))
                if status != 0:
                    raise ValueError(f"llama.cpp could not read the media with this prompt (mtmd_tokenize: {status})")
                yield [mtmd.mtmd_input_chunks_get(chunks, i) for i in range(mtmd.mtmd_input_chunks_size(chunks))]
            finally:
                mtmd.mtmd_input_chunks_free(chunks)
                for bitmap in bitmaps:
                    mtmd.mtmd_bitmap_free(bitmap)

    def _text_tokens(self, chunk: Any) -> list[int] | None:
        """A text chunk's tokens; None for an image chunk."""
        mtmd = self._mtmd
        if mtmd.mtmd_input_chunk_get_type(chunk) != mtmd.MTMD_INPUT_CHUNK_TYPE_TEXT:
            return None
        n = ctypes.c_size_t()
        tokens = mtmd.mtmd_input_chunk_get_tokens_text(chunk, ctypes.byref(n))
        return [tokens[i] for i in range(n.value)]


def _bitmap(mtmd: Any, medium: tuple[Any, ...]) -> Any:
    """An mtmd bitmap of a picture ("image", width, height, RGB bytes) or a clip ("audio", float32 samples)."""
    if medium[0] == "audio":
        import numpy as np

        samples = np.ascontiguousarray(medium[1], dtype=np.float32)  # mtmd copies them into the bitmap
        return mtmd.mtmd_bitmap_init_from_audio(len(samples), samples.ctypes.data_as(ctypes.POINTER(ctypes.c_float)))
    _, width, height, rgb = medium
    return mtmd.mtmd_bitmap_init(width, height, (ctypes.c_uint8 * len(rgb)).from_buffer_copy(rgb))
