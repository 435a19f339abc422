"""The serving engine's parts: step-batched generation equals transformers' own (every family, requests
joining and leaving mid-flight), stop strings and split characters in streaming, and sampling."""

from __future__ import annotations

import asyncio

import pytest
import torch

from gemmaforge.families import FAMILIES
from gemmaforge.inference.jobs import Answer, Delta, Event, Finished, Job, Params, TextStream
from gemmaforge.inference.sampling import choose_token, new_generator
from gemmaforge.inference.transformers_engine import TransformersEngine
from tests.engine_recording import RecordingEngine, ask, submit_together


async def deltas_of(log: list[tuple[int, Event]], index: int, count: int) -> None:
    while sum(1 for i, e in log if i == index and isinstance(e, Delta)) < count:
        await asyncio.sleep(0.001)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("family", ["gemma", "gemma2", "gemma3", "gemma4"])
@pytest.mark.slow
def test_batched_answers_equal_transformers_generate(family: str, dtype: torch.dtype, text_checkpoint_of) -> None:
    """Three requests: the second is sent once the first has streamed 3 pieces, the third once the second
    has streamed 3; each joins the running batch mid-flight and they share decoding steps. The first one's
    prompt fits in the sliding window (64 tokens; 32 for the tiny Gemma 4) and its answer crosses it. Each
    answer equals transformers' own generate, in fp32 and in bf16 (what `serve` runs where the hardware
    has it)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = text_checkpoint_of(family)
    fam = FAMILIES[family]
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation=fam.attn_implementation)
    stops = [tokenizer.eos_token_id, *tokenizer.convert_tokens_to_ids(list(fam.stop))]
    prompts = [tokenizer(p, add_special_tokens=False).input_ids
               for p in ("<bos>" + "coffee tea milk " * 5, "<bos>hi there", "<bos>what?")]
    n = 56
    with torch.inference_mode():
        runs = [model.generate(torch.tensor([p]), max_new_tokens=n, do_sample=False, eos_token_id=stops,
                               output_logits=True, return_dict_in_generate=True) for p in prompts]
    wanted = [run.sequences[0, len(p):].tolist() for run, p in zip(runs, prompts)]
    window = getattr(model.config, "sliding_window", None)
    if window is not None:  # Gemma 1 has none
        assert len(prompts[0]) < window < len(prompts[0]) + len(wanted[0]) - 1
    engine = RecordingEngine(model, tokenizer, fam)
    log: list[tuple[int, Event]] = []
    jobs: list[Job] = []

    async def staggered() -> None:
        loop = asyncio.get_running_loop()
        jobs.extend(Job(p, Params(max_tokens=n, temperature=0), None, loop) for p in prompts)
        first = asyncio.create_task(ask(engine, jobs[0], log, 0))
        await deltas_of(log, 0, 3)
        second = asyncio.create_task(ask(engine, jobs[1], log, 1))
        await deltas_of(log, 1, 3)
        third = asyncio.create_task(ask(engine, jobs[2], log, 2))
        await asyncio.gather(first, second, third)

    try:
        asyncio.run(staggered())
    finally:
        engine.close()
    for k, (run, want, prompt) in enumerate(zip(runs, wanted, prompts)):
        got = engine.chosen[id(jobs[k])]
        events = [e for i, e in log if i == k]
        text, end = "".join(e.text for e in events[:-1]), events[-1]
        assert isinstance(end, Finished), end
        kept = [t for t in got if t not in stops]
        assert text == tokenizer.decode(kept, skip_special_tokens=True)
        assert end.prompt_tokens == len(prompt) and end.completion_tokens == len(kept)
        assert end.reason == ("length" if len(kept) == n else "stop")
        differ = next((j for j, (a, b) in enumerate(zip(got, want)) if a != b), None)
        if differ is None:
            assert got == want
        else:  # bf16 only, at a rounding tie: generate scored both tokens within a few bf16 steps
            logits = run.logits[differ][0].float()
            assert dtype == torch.bfloat16 and logits[want[differ]] - logits[got[differ]] <= 2**-6 * logits.abs().max()
    # mid-flight: the earlier requests still streamed after each later one had begun, all three at once
    order = [i for i, e in log]
    assert order.index(1) < max(j for j, i in enumerate(order) if i == 0)
    assert order.index(2) < min(max(j for j, i in enumerate(order) if i == k) for k in (0, 1))
    assert engine.widest_batch == 3


@pytest.mark.parametrize("split", [False, True], ids=["one-forward", "split"])
@pytest.mark.parametrize("family", ["gemma2", "gemma3", "gemma4"])
@pytest.mark.slow
def test_requests_that_arrive_together_are_prefilled_together(family: str, split: bool, text_checkpoint_of) -> None:
    """Three prompts of different lengths submitted between two steps are prefilled in one left-padded
    forward, or, with max_prefill_tokens at twice the middle length, the two shorter together and the
    longest alone; each answer still equals transformers' own generate for that prompt alone."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = text_checkpoint_of(family)
    fam = FAMILIES[family]
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation=fam.attn_implementation)
    stops = [tokenizer.eos_token_id, *tokenizer.convert_tokens_to_ids(list(fam.stop))]
    prompts = [tokenizer(p, add_special_tokens=False).input_ids
               for p in ("<bos>" + "coffee tea milk " * 5, "<bos>what?", "<bos>hi there, milk and tea")]
    shortest, middle, longest = sorted(map(len, prompts))
    assert shortest < middle < longest
    n = 24
    with torch.inference_mode():
        wanted = [model.generate(torch.tensor([p]), max_new_tokens=n, do_sample=False, eos_token_id=stops)[0, len(p):]
                  .tolist() for p in prompts]
    groups: list[int] = []

    class GroupRecordingEngine(RecordingEngine):
        def _prefill(self, adapter: str | None, jobs: list[Job]) -> None:
            groups.append(len(jobs))
            super()._prefill(adapter, jobs)

    engine = GroupRecordingEngine(model, tokenizer, fam, max_prefill_tokens=2 * middle if split else 4096)

    async def together() -> list[Job]:
        loop = asyncio.get_running_loop()
        return await submit_together(engine, [Job(p, Params(max_tokens=n, temperature=0), None, loop) for p in prompts])

    try:
        jobs = asyncio.run(together())
    finally:
        engine.close()
    assert groups == ([2, 1] if split else [3])
    assert [engine.chosen[id(job)] for job in jobs] == wanted


def test_call_computes_on_the_engine_thread_and_returns_or_raises(text_checkpoint_of) -> None:
    """engine.call(fn) runs fn(model) on the scheduler's thread (where eval computes its loss) and gives
    back its result or its exception; after close it refuses."""
    import threading

    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = text_checkpoint_of("gemma3")
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    ids = torch.tensor([tokenizer("<bos>coffee tea", add_special_tokens=False).input_ids])
    with torch.inference_mode():
        want = model(input_ids=ids, logits_to_keep=0).logits
    engine = TransformersEngine(model, tokenizer, FAMILIES["gemma3"])
    try:
        got, thread = engine.call(lambda m: (m(input_ids=ids, logits_to_keep=0).logits, threading.current_thread()))
        assert torch.equal(got, want) and thread is engine._thread
        with pytest.raises(ZeroDivisionError):
            engine.call(lambda m: 1 / 0)
    finally:
        engine.close()
    with pytest.raises(RuntimeError, match="unloaded"):
        engine.call(lambda m: None)


def test_text_stream_holds_back_stop_strings_and_split_characters() -> None:
    pieces = {1: "Hello", 2: " wor", 3: "ld", 4: "\ufffd", 5: "咖", 6: " ST", 7: "OP", 8: "after"}

    def decode(ids: list[int]) -> str:
        text = "".join(pieces[i] for i in ids)
        return text.replace("\ufffd咖", "咖")  # token 4 is half of a character that token 5 completes

    stream = TextStream(decode, ("STOP",))
    assert stream.push(1) == ("Hello", False)
    assert stream.push(2) == (" wor", False)
    assert stream.push(3) == ("ld", False)
    assert stream.push(4) == ("", False)  # an incomplete character waits
    assert stream.push(5) == ("咖", False)
    assert stream.push(6) == (" ", False)  # "ST" might begin "STOP": held back
    assert stream.push(7) == ("", True)  # the stop string ends the answer and is not sent
    assert TextStream(decode, ("STOP",)).flush() == ""


def test_text_stream_releases_a_held_back_prefix_that_is_no_stop() -> None:
    pieces = {1: "a S", 2: "T", 3: "ay"}
    stream = TextStream(lambda ids: "".join(pieces[i] for i in ids), ("STOP",))
    assert [stream.push(i) for i in (1, 2, 3)] == [("a ", False), ("", False), ("STay", False)]


def test_an_answer_ending_on_end_of_turn_keeps_text_held_back_for_a_stop_string() -> None:
    """"U" might begin the stop string "User:"; when the end-of-turn token comes instead, it is sent."""
    sent: list = []
    job = Job([2, 3], Params(max_tokens=10, stop=("User:",)), None, loop=None)  # type: ignore[arg-type]
    job.emit = sent.append  # type: ignore[method-assign]
    answer = Answer(job, TextStream(lambda ids: "".join({5: "Hi ", 6: "U"}[i] for i in ids), job.params.stop), 100)
    assert not answer.accept(5, stops={1}) and not answer.accept(6, stops={1})
    assert answer.accept(1, stops={1})
    assert [e.text for e in sent if isinstance(e, Delta)] == ["Hi ", "U"]
    assert isinstance(sent[-1], Finished) and (sent[-1].reason, sent[-1].completion_tokens) == ("stop", 2)


def test_sampling_greedy_top_k_seed_and_repeat_penalty() -> None:
    logits = torch.tensor([1.0, 3.0, 2.0, 2.9])
    greedy = Params(max_tokens=1, temperature=0)
    assert choose_token(logits, greedy, [], new_generator(0)) == 1
    assert choose_token(logits, Params(max_tokens=1, temperature=5.0, top_k=1), [], new_generator(None)) == 1
    draws = [[choose_token(logits, Params(max_tokens=1, temperature=1.0, top_p=1.0, top_k=0), [], g)
              for _ in range(20)] for g in (new_generator(3), new_generator(3))]
    assert draws[0] == draws[1] and len(set(draws[0])) > 1  # seeded: reproducible, and really sampling
    penalised = Params(max_tokens=1, temperature=0, repeat_penalty=1.5)
    assert choose_token(logits, penalised, [1], new_generator(0)) == 3  # 3.0 / 1.5 = 2.0 < 2.9
    only_best = Params(max_tokens=1, temperature=1.0, top_k=0, top_p=0.01)
    assert {choose_token(logits, only_best, [], new_generator(s)) for s in range(10)} == {1}
