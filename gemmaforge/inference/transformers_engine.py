"""One base model in memory, any number of LoRA adapters beside it, and a scheduler thread that batches
every running request at each decoding step.

Requests on the same adapter decode together as one batch whose KV cache lives on a shared, left-padded
timeline: the requests that arrive between two steps are prefilled together (one left-padded forward per
`max_prefill_tokens`) and join the batch at the next step (their cache padded on the left to the batch's
width, or the batch's to theirs); a finished or disconnected request leaves at once.
Requests on plain LoRA adapters (trained token rows included) and on the base model share one batch: a step
whose rows are on several of them computes each row with its own adapter in one forward (adapter_mix.py). An
adapter of another kind (DoRA, whole modules saved, LoRA on parameters) has a batch of its own, and the batches
take turns step by step (PEFT switches the active adapter between steps, so every adapter kind computes exactly
what it computes alone).
"""

from __future__ import annotations

import inspect
import itertools
import re
import threading
import time
from collections import deque
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, TypeVar

import torch

from gemmaforge.audio import AudioPrompt
from gemmaforge.families import Family
from gemmaforge.inference.constrained import Grammars, Matcher
from gemmaforge.inference.jobs import (
    Answer,
    Finished,
    Job,
    QueueFull,
    TextStream,
    TokenLogprob,
    decode_with_markers,
    marker_ids,
)
from gemmaforge.inference.sampling import choose_token, new_generator, token_logprob
from gemmaforge.media import merged_token_types
from gemmaforge.models import fast_last_position_logits
from gemmaforge.vision import ImagePrompt

if TYPE_CHECKING:  # PEFT is imported with the first adapter
    from gemmaforge.inference.adapter_mix import AdapterMix

T = TypeVar("T")
_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # SentencePiece's byte fallback


@dataclass
class _Running:
    answer: Answer
    generator: torch.Generator
    history: list[int]  # prompt and answer ids, for the repeat penalty
    constraint: Matcher | None  # structured output: where the answer is in its grammar

    @property
    def job(self) -> Job:
        return self.answer.job


@dataclass
class _Batch:
    """The running requests of one lane (see TransformersEngine._lane): row i of every tensor belongs to rows[i]."""

    rows: list[_Running] = field(default_factory=list)
    cache: Any = None  # DynamicCache, (B, heads, width, head_dim) per layer
    mask: torch.Tensor | None = None  # (B, width): 1 where a row has a real token
    positions: torch.Tensor | None = None  # (B,): the position of each row's next token
    last: torch.Tensor | None = None  # (B,): each row's latest token, the next step's input
    slots: torch.Tensor | None = None  # (B,): each row's adapter slot in the AdapterMix (0: the base model)

    def tensors(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """mask, positions, last and slots: set while the batch has rows (_select clears them with its last row)."""
        assert self.mask is not None and self.positions is not None and self.last is not None \
            and self.slots is not None, "an empty batch"
        return self.mask, self.positions, self.last, self.slots


class TransformersEngine:
    kind = "transformers"

    def __init__(self, model: Any, tokenizer: Any, family: Family, *, max_batch: int = 16, max_queue: int = 64,
                 num_ctx: int = 4096, max_prefill_tokens: int = 4096, base_path: Path | None = None,
                 base_name: str | None = None, vision: ImagePrompt | None = None,
                 no_vision: str = "the model has no vision tower", audio: AudioPrompt | None = None,
                 no_audio: str = "the model has no audio tower"):
        self.model, self.tokenizer, self.family = fast_last_position_logits(model.eval()), tokenizer, family
        self.base_path, self.base_name = base_path, base_name  # the folder loaded, as the user named it
        self.vision, self.no_vision = vision, no_vision  # how images enter a prompt, or why they cannot
        self.audio, self.no_audio = audio, no_audio  # how sound enters a prompt, or why it cannot
        self.audio_rate = audio.rate if audio else None
        self.device = next(model.parameters()).device
        self.peft: Any = None  # the PeftModel once an adapter is loaded
        self._tuner_layer: Any = None  # one of PEFT's adapter layers, once an adapter is loaded (see _use)
        self.mix: AdapterMix | None = None  # the plain LoRA adapters stacked, once an adapter is loaded
        self.adapters: dict[str, Path] = {}
        self.max_batch, self.max_queue, self.num_ctx = max_batch, max_queue, num_ctx
        self.max_prefill_tokens = max_prefill_tokens  # padded prompt tokens in one prefill forward (its memory)
        self.stops = family.stop_ids(tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids)
        self.grammars = Grammars(tokenizer, sorted(self.stops))
        self.markers = marker_ids(tokenizer, family)  # decoded, not skipped (see ChatFormat.markers)
        self._special = set(tokenizer.all_special_ids)  # written as nothing (see _piece)
        # transformers 5.x renamed `past_key_values` to `cache` (the old name warns, then goes in 5.40)
        self._cache_kw = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
        self._waiting: deque[Job] = deque()
        self._admitted: set[int] = set()  # ids of jobs taken from the queue and not yet in a batch (prefill)
        self._batches: dict[str | None, _Batch] = {}
        self._calls: deque[tuple[Callable[[Any], Any], str | None, Future[Any]]] = deque()  # see call()
        self._wake = threading.Condition()
        self._model_lock = threading.Lock()  # adapter loading vs. a step in flight
        self._closed = False
        self.widest_batch = 0  # the most requests one decoding step has served (observability, tests)
        self.most_adapters_in_a_forward = 0  # the most adapters (the base model counted) one forward has served
        self._thread = threading.Thread(target=self._loop, name="gemmaforge-transformers-engine", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ adapters and requests

    def encode(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False).input_ids

    def encode_media(self, text: str, images: Sequence[Any], clips: Sequence[Any] = ()
                     ) -> tuple[list[int], dict[str, Any]]:
        inputs: dict[str, Any] = {}
        if images:
            if self.vision is None:
                raise ValueError(self.no_vision)
            text, pictures = self.vision.expand(text, list(images))
            inputs.update(pictures)
        if clips:
            if self.audio is None:
                raise ValueError(self.no_audio)
            text, sound = self.audio.expand(text, list(clips))
            inputs.update(sound)
        return self.encode(text), inputs

    def parameter_count(self) -> int:
        return sum(p.numel() for p in self.model.parameters())

    def quantization_level(self) -> str:
        return str(next(self.model.parameters()).dtype).removeprefix("torch.").upper().replace("FLOAT", "F")

    def weight_files(self) -> list[Path]:
        return sorted(self.base_path.glob("*.safetensors")) if self.base_path else []

    def load_adapter(self, name: str, path: Path) -> None:
        from peft import PeftModel
        from peft.tuners.tuners_utils import BaseTunerLayer

        from gemmaforge.inference.adapter_mix import AdapterMix
        from gemmaforge.train.template_tokens import use_sparse_template_tokens

        with self._model_lock:
            if self.peft is None:
                self.peft = PeftModel.from_pretrained(self.model, path, adapter_name=name, is_trainable=False)
            else:
                self.peft.load_adapter(path, adapter_name=name, is_trainable=False)
            use_sparse_template_tokens(self.peft)
            self.adapters[name] = path
            self._tuner_layer = next(m for m in self.peft.modules() if isinstance(m, BaseTunerLayer))
            self.mix = self.mix or AdapterMix(self.peft)
            self.mix.refresh(list(self.adapters)) if not __import__("os").environ.get("NOMIX") else None

    def unload_adapter(self, name: str) -> None:
        with self._model_lock:  # between steps: its requests end now, and new ones can no longer name it
            self._fail_where(lambda job: job.adapter == name, f"the adapter {name} was unloaded")
            del self.adapters[name]
            if self.adapters:
                self.peft.delete_adapter(name)
                self.mix.refresh(list(self.adapters))  # type: ignore[union-attr]  # made by the first load
            else:  # the last one: take the adapter layers out, so that the next load starts clean
                self.model, self.peft, self.mix = self.peft.unload(), None, None

    def submit(self, job: Job) -> None:
        with self._wake:
            if self._closed:
                job.fail("the model was unloaded")
                return
            if len(self._waiting) >= self.max_queue:
                raise QueueFull(f"{len(self._waiting)} requests are waiting")
            self._waiting.append(job)
            self._wake.notify()

    def compile_grammar(self, spec: str) -> None:
        self.grammars.compile(spec)

    def call(self, fn: Callable[[Any], T], adapter: str | None = None) -> T:
        """fn(model) computed on the engine's thread between two steps, with `adapter` (None: the base model),
        under inference mode. A caller's own forward passes (eval's loss) run where the engine's run: torch
        work done on the caller's thread slows the engine's next steps (benchmarks/README.md, evaluation)."""
        done: Future[T] = Future()
        with self._wake:
            if self._closed:
                raise RuntimeError("the model was unloaded")
            self._calls.append((fn, adapter, done))
            self._wake.notify()
        return done.result()

    def embed(self, texts: list[str], adapter: str | None) -> tuple[list[list[float]], int]:
        """Mean pooling of the text model's final hidden states (after its last norm, which llama.cpp's MEAN
        pooling reads too), one text per forward: no padding enters the mean."""
        bos = self.tokenizer.bos_token_id
        inputs = [[bos, *self.encode(text)][:self.num_ctx] for text in texts]

        def pooled(model: Any) -> list[list[float]]:
            decoder = model.get_decoder()
            return [decoder(input_ids=torch.tensor([ids], device=self.device)).last_hidden_state[0]
                    .float().mean(dim=0).cpu().tolist() for ids in inputs]

        return self.call(pooled, adapter), sum(map(len, inputs))

    def running(self) -> int:
        with self._wake:
            return sum(len(b.rows) for b in list(self._batches.values())) + len(self._waiting) + len(self._admitted)

    def close(self) -> None:
        with self._wake:
            self._closed = True
            self._wake.notify()
        self._thread.join(timeout=10)
        with self._model_lock:
            self._fail_where(lambda _job: True, "the model was unloaded")

    def _fail_where(self, doomed: Any, message: str) -> None:
        """End every waiting or running request that `doomed(job)` picks with Failed(message)."""
        with self._wake:
            for job in [j for j in self._waiting if doomed(j)]:
                self._waiting.remove(job)
                job.fail(message)
        for batch in self._batches.values():
            keep = [i for i, r in enumerate(batch.rows) if not doomed(r.job)]
            for r in batch.rows:
                if doomed(r.job):
                    r.job.fail(message)
            if len(keep) < len(batch.rows):
                _select(batch, keep)

    # ------------------------------------------------------------------ the scheduler

    def _loop(self) -> None:
        # this thread's own intra-op setting: without it steps are slower (benchmarks/README.md, evaluation),
        # although get_num_threads() reads the same number either way
        torch.set_num_threads(torch.get_num_threads())
        turns = itertools.count()
        while True:
            with self._wake:
                while (not self._closed and not self._waiting and not self._calls
                       and not any(b.rows for b in self._batches.values())):
                    self._wake.wait()
                if self._closed:
                    for _fn, _adapter, done in self._calls:
                        done.set_exception(RuntimeError("the model was unloaded"))
                    return
                room = self.max_batch - sum(len(b.rows) for b in self._batches.values())
                admitted = [self._waiting.popleft() for _ in range(min(room, len(self._waiting)))]
                self._admitted = {id(job) for job in admitted}
                calls, self._calls = self._calls, deque()
            with self._model_lock, torch.inference_mode():
                for fn, adapter, done in calls:
                    try:
                        self._use(adapter)
                        done.set_result(fn(self.model))
                    except Exception as e:  # noqa: BLE001  (the caller gets the error; the engine goes on)
                        done.set_exception(e)
                for lane, group in self._prefill_groups(admitted):
                    try:
                        self._prefill(lane, group)
                    except Exception as e:  # noqa: BLE001  (a fault ends these requests with an error, not the engine)
                        with self._wake:
                            self._admitted -= {id(job) for job in group}
                        for job in group:
                            job.fail(e)
                self._end_cancelled()
                active = [lane for lane, b in self._batches.items() if b.rows]
                if active:  # one step for one lane's batch, lanes in turn
                    lane = active[next(turns) % len(active)]
                    try:
                        self._step(lane)
                    except Exception as e:  # noqa: BLE001  (a fault in a step fails that batch, not the engine)
                        for row in self._batches.pop(lane).rows:
                            row.job.fail(e)

    def _lane(self, adapter: str | None) -> str | None:
        """The batch a request on `adapter` decodes in: None for the base model and every adapter the AdapterMix
        takes (one forward for all of them), the adapter's name for any other."""
        return None if adapter is None or (self.mix is not None and adapter in self.mix.slots) else adapter

    def _forward(self, adapters: list[str | None], slots: torch.Tensor, cache: Any, **inputs: Any) -> torch.Tensor:
        """Last-position logits (B, vocab) in float32, row i computed with adapters[i] (None: the base model): through
        PEFT when the rows have one, else each row with the adapter in its slot of the AdapterMix (slots[i])."""
        inputs[self._cache_kw] = cache
        present = set(adapters)
        self.most_adapters_in_a_forward = max(self.most_adapters_in_a_forward, len(present))
        if len(present) == 1:
            self._use(adapters[0])  # the LoRA layers sit inside self.model: it is called as generate calls it
            out = self.model(**inputs, use_cache=True, logits_to_keep=1)
        else:
            assert self.mix is not None, "rows on several adapters without an adapter loaded"
            self._use(None)  # every PEFT layer computes the base model, but the mix's layers follow the slots
            with self.mix.rows(slots, {a for a in present if a is not None}):
                out = self.model(**inputs, use_cache=True, logits_to_keep=1)
        return out.logits[:, -1].float().cpu()

    def _use(self, adapter: str | None) -> None:
        """Make self.model compute with `adapter` (None: the base model, every adapter disabled). PEFT is
        switched only when one of its layers says otherwise (it switches them all together): its
        disable_adapter() context surveys every layer on each entry, which made each base step slower."""
        if self.peft is None:
            return
        layer = self._tuner_layer
        if adapter is None:
            if not layer.disable_adapters:
                self.peft.base_model.disable_adapter_layers()
            return
        if layer.disable_adapters:
            self.peft.base_model.enable_adapter_layers()
        if layer.active_adapters != [adapter]:
            self.peft.set_adapter(adapter)

    def _prefill_groups(self, jobs: list[Job]) -> list[tuple[str | None, list[Job]]]:
        """`jobs` as prefill forwards: by lane, then in order of prompt length (less padding), each group
        at most `max_prefill_tokens` once padded (a longer prompt goes alone). Cancelled jobs end here."""
        by_lane: dict[str | None, list[Job]] = {}
        for job in jobs:
            if job.cancelled.is_set():
                with self._wake:
                    self._admitted.discard(id(job))
                job.emit(Finished("cancelled", len(job.prompt_ids), 0, 0, 0))
            else:
                by_lane.setdefault(self._lane(job.adapter), []).append(job)
        groups: list[tuple[str | None, list[Job]]] = []
        for lane, waiting in by_lane.items():
            group: list[Job] = []
            for job in sorted(waiting, key=lambda j: len(j.prompt_ids)):  # each job is the group's longest so far
                if job.media:  # its media inputs go through the towers in a forward of its own, with its adapter
                    groups.append((lane, [job]))
                    continue
                if group and (len(group) + 1) * len(job.prompt_ids) > self.max_prefill_tokens:
                    groups.append((lane, group))
                    group = []
                group.append(job)
            if group:
                groups.append((lane, group))
        return groups

    def _prefill(self, lane: str | None, jobs: list[Job]) -> None:
        """One forward over the prompts of `jobs` (of one lane), left-padded to the longest; each job's first token
        is chosen and the rows that go on join the lane's batch."""
        from transformers import DynamicCache

        start = time.perf_counter_ns()
        width = max(len(job.prompt_ids) for job in jobs)
        on = {"device": self.device}
        ids = torch.zeros((len(jobs), width), dtype=torch.long)  # the padding is masked: any id will do
        mask = torch.zeros((len(jobs), width), dtype=torch.long)
        for i, job in enumerate(jobs):  # left padding: every prompt ends in the last column
            ids[i, width - len(job.prompt_ids):] = torch.tensor(job.prompt_ids)
            mask[i, width - len(job.prompt_ids):] = 1
        ids, mask = ids.to(self.device), mask.to(self.device)
        positions = (mask.cumsum(dim=1) - 1).clamp(min=0)
        cache = DynamicCache()  # full-length layers: the sliding window is applied by the attention mask
        media = self._media_inputs(jobs[0], ids) if jobs[0].media else {}  # a job with media is alone
        adapters = [job.adapter for job in jobs]
        slots = torch.tensor([self.mix.slots.get(a, 0) if self.mix is not None and a else 0 for a in adapters], **on)
        logits = self._forward(adapters, slots, cache, input_ids=ids, attention_mask=mask, position_ids=positions,
                               cache_position=torch.arange(width, **on), **media)
        now = time.perf_counter_ns()
        rows = [_Running(Answer(job, TextStream(self._decode, job.params.stop), self.num_ctx, prompt_ns=now - start,
                                started_ns=now), new_generator(job.params.seed), list(job.prompt_ids),
                         self.grammars.matcher(job.params.grammar) if job.params.grammar else None)
                for job in jobs]
        last = torch.zeros(len(jobs), dtype=torch.long, **on)
        new = _Batch(rows, cache, mask, positions[:, -1] + 1, last, slots)
        with self._wake:  # the first tokens are sent as the jobs join their batch: running() never misses one
            self._admitted -= {id(job) for job in jobs}
            keep = []
            for i, row in enumerate(rows):
                token, logprob = self._choose(row, logits[i])
                if not self._accept(row, token, logprob):
                    last[i] = token
                    keep.append(i)
            if len(keep) < len(rows):
                _select(new, keep)
            if new.rows:
                self._batches[lane] = _join(self._batches.get(lane), new)

    def _media_inputs(self, job: Job, ids: torch.Tensor) -> dict[str, Any]:
        """A job's media inputs for the prefill forward: pixels and audio features in the model's dtype, the media
        tokens marked."""
        assert job.media is not None  # only encode_media gives a job media, with the towers they need
        dtype = next(self.model.parameters()).dtype
        inputs = {key: value.to(self.device, dtype=dtype) if value.is_floating_point() else value.to(self.device)
                  for key, value in job.media.items()}
        types = [prompt.token_types(ids) for prompt, key in ((self.vision, "pixel_values"),
                                                              (self.audio, "input_features"))
                 if prompt is not None and key in inputs]
        return {**inputs, **merged_token_types(*types)}

    def _step(self, lane: str | None) -> None:
        batch = self._batches[lane]
        self.widest_batch = max(self.widest_batch, len(batch.rows))
        mask, positions, last, slots = batch.tensors()
        width = mask.shape[1]
        batch.mask = mask = torch.cat([mask, mask.new_ones((len(batch.rows), 1))], dim=1)
        logits = self._forward([row.job.adapter for row in batch.rows], slots, batch.cache, input_ids=last[:, None],
                               attention_mask=mask, position_ids=positions[:, None],
                               cache_position=torch.tensor([width], device=self.device))
        batch.positions = positions + 1
        keep = []
        for i, row in enumerate(batch.rows):
            token, logprob = self._choose(row, logits[i])
            if not self._accept(row, token, logprob):
                last[i] = token
                keep.append(i)
        if len(keep) < len(batch.rows):
            _select(batch, keep)

    def _choose(self, row: _Running, logits: torch.Tensor) -> tuple[int, TokenLogprob | None]:
        """The next token, and its log-probabilities when the job asked for them (read before the grammar's mask,
        which changes `logits` in place)."""
        top = row.job.params.logprobs
        raw = logits.clone() if top is not None and row.constraint is not None else logits
        if row.constraint is not None:
            row.constraint.mask(logits)
        token = choose_token(logits, row.job.params, row.history, row.generator)
        return token, None if top is None else token_logprob(raw, token, top, self._piece)

    def _piece(self, token: int) -> bytes:
        """A token's bytes as llama.cpp's token_to_piece writes them: SentencePiece's space mark as a space, a
        byte token as its byte, a special token as nothing."""
        if token in self._special:
            return b""
        piece = self.tokenizer.convert_ids_to_tokens(token)
        byte = _BYTE_TOKEN.fullmatch(piece)
        return bytes([int(byte[1], 16)]) if byte else piece.replace("\u2581", " ").encode()

    def _accept(self, row: _Running, token: int, logprob: TokenLogprob | None = None) -> bool:
        finished = row.answer.accept(token, self.stops, logprob)
        if not finished:
            row.history.append(token)
            if row.constraint is not None:
                row.constraint.advance(token)
        return finished

    def _end_cancelled(self) -> None:
        """Drop requests whose client went away without another step."""
        for batch in self._batches.values():
            keep = [i for i, r in enumerate(batch.rows) if not r.job.cancelled.is_set()]
            for r in batch.rows:
                if r.job.cancelled.is_set():
                    r.answer.finish("cancelled")
            if len(keep) < len(batch.rows):
                _select(batch, keep)
        with self._wake:
            for job in [j for j in self._waiting if j.cancelled.is_set()]:
                self._waiting.remove(job)
                job.emit(Finished("cancelled", len(job.prompt_ids), 0, 0, 0))

    def _decode(self, ids: list[int]) -> str:
        return decode_with_markers(ids, self.markers, lambda run: self.tokenizer.decode(run, skip_special_tokens=True))


def _join(batch: _Batch | None, new: _Batch) -> _Batch:
    """`new` (prefilled rows) added to `batch`, both padded on the left to a common width so that every
    row's latest token sits in the last column."""
    if batch is None or not batch.rows:
        return new
    width, new_width = batch.tensors()[0].shape[1], new.tensors()[0].shape[1]
    if new_width < width:
        _pad_left(new, width - new_width)
    elif width < new_width:
        _pad_left(batch, new_width - width)
    for layer, extra in zip(batch.cache.layers, new.cache.layers):
        layer.keys = torch.cat([layer.keys, extra.keys])
        layer.values = torch.cat([layer.values, extra.values])
    batch.rows += new.rows
    batch.mask, batch.positions, batch.last, batch.slots = (  # padded ones
        torch.cat([mine, theirs]) for mine, theirs in zip(batch.tensors(), new.tensors()))
    return batch


def _pad_left(batch: _Batch, n: int) -> None:
    for layer in batch.cache.layers:
        shape = (*layer.keys.shape[:2], n, layer.keys.shape[3])
        layer.keys = torch.cat([layer.keys.new_zeros(shape), layer.keys], dim=2)
        layer.values = torch.cat([layer.values.new_zeros(shape), layer.values], dim=2)
    mask = batch.tensors()[0]
    batch.mask = torch.cat([mask.new_zeros((mask.shape[0], n)), mask], dim=1)


def _select(batch: _Batch, keep: list[int]) -> None:
    """Keep only rows `keep`, and drop the left columns that no remaining row uses."""
    batch.rows = [batch.rows[i] for i in keep]
    if not keep:
        batch.cache = batch.mask = batch.positions = batch.last = batch.slots = None
        return
    mask, positions, last, slots = batch.tensors()  # set: the batch had rows, `keep` names some of them
    index = torch.tensor(keep, device=mask.device)
    mask = mask[index]
    first = int(mask.any(dim=0).int().argmax())  # the first column some row still needs
    batch.mask, batch.positions, batch.last, batch.slots = mask[:, first:], positions[index], last[index], slots[index]
    for layer in batch.cache.layers:
        layer.keys = layer.keys[index, :, first:]
        layer.values = layer.values[index, :, first:]
