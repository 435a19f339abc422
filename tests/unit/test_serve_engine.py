"""The serving engine's parts: step-batched generation equals transformers' own (every family, requests
joining and leaving mid-flight), stop strings and split characters in streaming, and sampling."""

from __future__ import annotations

import asyncio

import pytest
import torch

from gemmaforge.families import FAMILIES
from gemmaforge.serve.jobs import Answer, Delta, Finished, Job, Params, TextStream
from gemmaforge.serve.sampling import choose_token, new_generator
from gemmaforge.serve.transformers_engine import TransformersEngine


async def ask(engine: TransformersEngine, ids: list[int], params: Params, delay: float) -> tuple[str, Finished]:
    await asyncio.sleep(delay)
    job = Job(ids, params, None, asyncio.get_running_loop())
    engine.submit(job)
    text = ""
    while True:
        event = await job.events.get()
        if isinstance(event, Delta):
            text += event.text
        else:
            return text, event


@pytest.mark.parametrize("family", ["gemma", "gemma2", "gemma3", "gemma4"])
def test_batched_answers_equal_transformers_generate(family: str, text_checkpoint_of) -> None:
    """Three prompts of different lengths arrive one after another and share decoding steps; the long one
    crosses the sliding window (64 tokens; 32 for the tiny Gemma 4) while generating."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = text_checkpoint_of(family)
    fam = FAMILIES[family]
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation=fam.attn_implementation)
    stops = [tokenizer.eos_token_id, *tokenizer.convert_tokens_to_ids(list(fam.stop))]
    prompts = [tokenizer(p, add_special_tokens=False).input_ids
               for p in ("<bos>hi there", "<bos>" + "coffee tea milk " * 12, "<bos>what?")]
    n = 40
    with torch.inference_mode():
        wanted = [model.generate(torch.tensor([p]), max_new_tokens=n, do_sample=False, eos_token_id=stops)[0, len(p):]
                  for p in prompts]
    engine = TransformersEngine(model, tokenizer, fam)

    async def together() -> list[tuple[str, Finished]]:
        return await asyncio.gather(*[ask(engine, p, Params(max_tokens=n, temperature=0), 0.03 * k)
                                      for k, p in enumerate(prompts)])

    try:
        results = asyncio.run(together())
    finally:
        engine.close()
    for (text, end), want, prompt in zip(results, wanted, prompts):
        kept = [t for t in want.tolist() if t not in stops]
        assert text == tokenizer.decode(kept, skip_special_tokens=True)
        assert end.prompt_tokens == len(prompt) and end.completion_tokens == len(kept)
        assert end.reason == ("length" if len(kept) == n else "stop")
    assert engine.widest_batch >= 2


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
