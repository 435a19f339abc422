"""A GGUF file served through llama.cpp (llama-cpp-python), one request at a time as llama.cpp's own
single-slot server does. Prompts are the same token ids the transformers engine sees; stop tokens, stop
strings and streaming go through the same TextStream, so both engines answer alike."""

from __future__ import annotations

import os
import queue
import threading
import time
from pathlib import Path

from gemmaforge.families import Family
from gemmaforge.serve.jobs import Delta, Failed, Finished, Job, QueueFull, TextStream


class LlamaCppEngine:
    kind = "llamacpp"

    def __init__(self, gguf: Path, family: Family, *, num_ctx: int = 4096, max_queue: int = 64):
        import llama_cpp

        self.llm = llama_cpp.Llama(model_path=str(gguf), n_ctx=num_ctx, n_threads=os.cpu_count(), verbose=False)
        self.family, self.num_ctx, self.path = family, num_ctx, gguf
        self.stops = {self.llm.token_eos(), *(self.encode(s)[0] for s in family.stop)}
        self._jobs: queue.Queue[Job | None] = queue.Queue(maxsize=max_queue)
        self._busy = 0
        self._thread = threading.Thread(target=self._loop, name="gemmaforge-llamacpp-engine", daemon=True)
        self._thread.start()

    def encode(self, text: str) -> list[int]:
        return self.llm.tokenize(text.encode(), add_bos=False, special=True)

    def submit(self, job: Job) -> None:
        if job.adapter is not None:
            raise ValueError("the llama.cpp engine serves GGUF files without runtime adapters")
        try:
            self._jobs.put_nowait(job)
        except queue.Full:
            raise QueueFull(f"{self._jobs.qsize()} requests are waiting") from None

    def running(self) -> int:
        return self._jobs.qsize() + self._busy

    def close(self) -> None:
        self._jobs.put(None)
        self._thread.join(timeout=10)

    def _loop(self) -> None:
        while (job := self._jobs.get()) is not None:
            self._busy = 1
            try:
                self._run(job)
            except Exception as e:  # noqa: BLE001  (an engine fault ends this request with an error, never the server)
                job.emit(Failed(f"generation failed: {type(e).__name__}: {e}"))
            finally:
                self._busy = 0

    def _run(self, job: Job) -> None:
        params, n_prompt = job.params, len(job.prompt_ids)
        if job.cancelled.is_set():
            job.emit(Finished("cancelled", n_prompt, 0, 0, 0))
            return
        if params.seed is not None and params.seed >= 0:
            self.llm.set_seed(params.seed)
        stream = TextStream(lambda ids: self.llm.detokenize(ids).decode("utf-8", errors="replace"), params.stop)
        start = time.perf_counter_ns()
        first = start
        answer, reason = 0, "length"
        # the penalty window is read from this attribute when generate() builds its sampler
        self.llm.last_n_tokens_size = params.repeat_last_n if params.repeat_last_n >= 0 else self.num_ctx
        tokens = self.llm.generate(
            job.prompt_ids, top_k=params.top_k if params.temperature > 0 else 1, top_p=params.top_p,
            min_p=params.min_p, temp=params.temperature, repeat_penalty=params.repeat_penalty, reset=True,
        )
        for token in tokens:
            if answer == 0:
                first = time.perf_counter_ns()
            if job.cancelled.is_set():
                reason = "cancelled"
                break
            if token in self.stops:
                reason = "stop"
                break
            answer += 1
            delta, stopped = stream.push(token)
            if delta:
                job.emit(Delta(delta))
            if stopped:
                reason = "stop"
                break
            if answer >= params.max_tokens or n_prompt + answer >= self.num_ctx:
                break
        if reason == "length" and (rest := stream.flush()):
            job.emit(Delta(rest))
        job.emit(Finished(reason, n_prompt, answer, first - start, time.perf_counter_ns() - first))
