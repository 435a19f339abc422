"""A GGUF file served through llama.cpp (llama-cpp-python), one request at a time as llama.cpp's own
single-slot server does, on the GPU when the installed build has a GPU backend. Prompts are the same token ids the
transformers engine sees; stop tokens, stop strings and streaming go through the same TextStream, so both engines
answer alike."""

from __future__ import annotations

import os
import queue
import random
import re
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from gemmaforge.families import Family
from gemmaforge.inference.jobs import Answer, Finished, Job, QueueFull, TextStream, TokenLogprob, decode_with_markers
from gemmaforge.inference.llamacpp_images import Projector
from gemmaforge.inference.sampling import token_logprob
from gemmaforge.media import AUDIO, IMAGE, check_placeholders
from gemmaforge.system.llamacpp_build import gpu_layers


class LlamaCppEngine:
    kind = "llamacpp"

    def __init__(self, gguf: Path, family: Family, *, num_ctx: int = 4096, max_queue: int = 64,
                 files: list[Path] | None = None, mmproj: Path | None = None, no_vision: str | None = None):
        import llama_cpp

        # every layer on the GPU where llama-cpp-python was built with one (GGML_CUDA, GGML_HIP): docs/gpu-setup.md
        layers = gpu_layers()
        self.device = "cuda" if layers else "cpu"  # /api/ps: the weights in GPU memory
        self.llm = llama_cpp.Llama(model_path=str(gguf), n_ctx=num_ctx, n_threads=os.cpu_count(), n_gpu_layers=layers,
                                   verbose=False)
        self.vision: Projector | None = None  # images: through the projector beside the file
        self.no_vision = no_vision or (f"no projector (mmproj*.gguf) beside {gguf.name}: llama.cpp reads images "
                                       "with the projector that `gemmaforge export gguf` writes for a multimodal model")
        if mmproj is not None:
            try:
                self.vision = Projector(mmproj, self.llm, family)
            except ValueError as e:  # the text model still serves
                self.no_vision = str(e)
        self.audio_rate = self.vision.audio_rate if self.vision else None
        self.no_audio = self.no_vision if self.vision is None else \
            f"{mmproj.name if mmproj else 'its projector'} has no audio encoder (only Gemma 4 E2B and E4B hear)"
        self.family, self.num_ctx, self.path = family, num_ctx, gguf
        self.base_path: Path | None = gguf
        self.base_name: str | None = gguf.name
        self.adapters: dict[str, Path] = {}
        self.files = files or [gguf]  # every shard of a split file (llama.cpp opens the first)
        self.stops = family.stop_ids(self.llm.token_eos(), lambda stop: self.encode(stop)[0])
        # decoded, not skipped (see ChatFormat.markers); a marker is one special token of the vocabulary
        self.markers = {ids[0]: m for m in family.chat.markers if len(ids := self.encode(m)) == 1}
        self._jobs: queue.Queue[Job | None] = queue.Queue(maxsize=max_queue)
        self._busy = 0
        self._closed = False
        self._grammars: dict[str, Any] = {}  # compiled LlamaGrammar by Params.grammar
        self._embedder: Any = None  # a second context in embedding mode, made on the first embeddings request
        self._embed_lock = threading.Lock()
        self._thread = threading.Thread(target=self._loop, name="gemmaforge-llamacpp-engine", daemon=True)
        self._thread.start()

    def encode(self, text: str) -> list[int]:
        return self.llm.tokenize(text.encode(), add_bos=False, special=True)

    def encode_media(self, text: str, images: Sequence[Any], clips: Sequence[Any] = ()
                     ) -> tuple[list[int], dict[str, Any]]:
        if self.vision is None:
            raise ValueError(self.no_vision)
        chat = self.family.chat
        check_placeholders(text, chat.image, list(images), IMAGE)
        if clips:
            if self.audio_rate is None or chat.audio is None:
                raise ValueError(self.no_audio)
            check_placeholders(text, chat.audio, list(clips), AUDIO)
        inputs = self.vision.inputs(text, list(images), list(clips))
        return self.vision.prompt_ids(inputs), inputs

    def _decode(self, ids: list[int]) -> str:
        return decode_with_markers(ids, self.markers,
                                   lambda run: self.llm.detokenize(run).decode("utf-8", errors="replace"))

    def load_adapter(self, name: str, path: Path) -> None:
        raise ValueError(f"{self.path.name} is a GGUF file, served without adapters: serve the run's merged model, "
                         "or the base model with the adapter (--engine transformers)")

    def unload_adapter(self, name: str) -> None:
        raise KeyError(name)  # none is ever loaded

    def submit(self, job: Job) -> None:
        if self._closed:
            job.fail("the model was unloaded")
            return
        try:
            self._jobs.put_nowait(job)
        except queue.Full:
            raise QueueFull(f"{self._jobs.qsize()} requests are waiting") from None

    def embed(self, texts: list[str], adapter: str | None) -> tuple[list[list[float]], int]:
        """llama.cpp's MEAN pooling over <bos> and each text's tokens, the whole context in one batch."""
        import llama_cpp

        assert adapter is None, "a GGUF file is served without adapters"
        with self._embed_lock:
            if self._closed:
                raise RuntimeError("the model was unloaded")
            if self._embedder is None:
                self._embedder = llama_cpp.Llama(
                    model_path=str(self.path), embedding=True, pooling_type=llama_cpp.LLAMA_POOLING_TYPE_MEAN,
                    n_ctx=self.num_ctx, n_batch=self.num_ctx, n_ubatch=self.num_ctx, n_threads=os.cpu_count(),
                    verbose=False)
            vectors, tokens = self._embedder.embed(texts, truncate=True, return_count=True)
        return vectors, tokens

    def running(self) -> int:
        return self._jobs.qsize() + self._busy

    def parameter_count(self) -> int:
        import llama_cpp

        return llama_cpp.llama_model_n_params(self.llm.model)

    def quantization_level(self) -> str:
        match = re.search(r"(f32|f16|bf16|q\d_[0k](?:_[ms])?)", self.path.name, flags=re.IGNORECASE)
        return match[1].upper() if match else ""

    def weight_files(self) -> list[Path]:
        return self.files

    def close(self) -> None:
        self._closed = True
        while True:  # whatever still waits ends now; the request in flight ends at its next token
            try:
                job = self._jobs.get_nowait()
            except queue.Empty:
                break
            if job is not None:
                job.fail("the model was unloaded")
        self._jobs.put(None)
        self._thread.join(timeout=30)
        if self.vision is not None:
            self.vision.close()
        self.llm.close()
        with self._embed_lock:
            if self._embedder is not None:
                self._embedder.close()

    def compile_grammar(self, spec: str) -> None:
        try:
            self._grammar(spec)
        except Exception as e:  # noqa: BLE001  (llama.cpp's schema converter asserts on what it cannot convert)
            raise ValueError(str(e) or type(e).__name__) from None

    def _grammar(self, spec: str | None) -> Any:
        """llama.cpp's JSON grammar, or its grammar for a JSON schema (the end of turn is allowed once the value
        is complete: the grammar sampler leaves only end-of-generation tokens then)."""
        from llama_cpp.llama_grammar import JSON_GBNF, LlamaGrammar

        if spec is None:
            return None
        if spec not in self._grammars:
            self._grammars[spec] = (LlamaGrammar.from_string(JSON_GBNF, verbose=False) if spec == "json"
                                    else LlamaGrammar.from_json_schema(spec, verbose=False))
        return self._grammars[spec]

    def _loop(self) -> None:
        while (job := self._jobs.get()) is not None:
            self._busy = 1
            try:
                self._run(job)
            except Exception as e:  # noqa: BLE001  (an engine fault ends this request with an error, never the server)
                job.fail(e)
            finally:
                self._busy = 0

    def _run(self, job: Job) -> None:
        params = job.params
        if job.cancelled.is_set() or self._closed:
            job.emit(Finished("cancelled", len(job.prompt_ids), 0, 0, 0))
            return
        # llama-cpp-python keeps a seed across calls: a request without one gets a fresh random seed
        seed = params.seed % 2**32 if params.seed is not None and params.seed >= 0 else random.getrandbits(32)
        self.llm.set_seed(seed)
        # the penalty window is read from this attribute when generate() builds its sampler
        self.llm.last_n_tokens_size = params.repeat_last_n if params.repeat_last_n >= 0 else self.num_ctx
        stream = TextStream(self._decode, params.stop)
        answer = Answer(job, stream, self.num_ctx)
        try:
            self._generate(job, answer)
        finally:
            if job.media:  # its media positions must never match a later prompt's: that one starts afresh
                self.llm.reset()

    def _generate(self, job: Job, answer: Answer) -> None:
        params = job.params
        # a prompt with media is evaluated here, then continued from the state llama.cpp holds (a full prefix hit)
        prompt = self.vision.evaluate(self.llm, job.media) if job.media and self.vision else job.prompt_ids
        tokens = self.llm.generate(
            prompt, top_k=params.top_k if params.temperature > 0 else 1, top_p=params.top_p,
            min_p=params.min_p, temp=params.temperature, repeat_penalty=params.repeat_penalty, reset=True,
            grammar=self._grammar(params.grammar),
        )
        for token in tokens:
            if answer.tokens == 0:  # prompt evaluation ends with the first sampled token
                now = time.perf_counter_ns()
                answer.prompt_ns, answer.started_ns = now - answer.started_ns, now
            if self._closed:
                job.cancelled.set()
            if answer.accept(token, self.stops, self._logprob(token, params.logprobs)):
                return

    def _logprob(self, token: int, top: int | None) -> TokenLogprob | None:
        """`token`'s log-probabilities from the logits llama.cpp sampled it from (the last position its context
        evaluated; its samplers and grammar work on a copy). A piece is read through detokenize: llama-cpp-python's
        token_to_piece returns its whole 32-byte buffer."""
        if top is None:
            return None
        import numpy as np
        import torch

        logits = np.ctypeslib.as_array(self.llm._ctx.get_logits_ith(-1), shape=(self.llm.n_vocab(),))
        return token_logprob(torch.from_numpy(logits), token, top,
                             lambda i: self.llm._model.detokenize([i], special=False))
