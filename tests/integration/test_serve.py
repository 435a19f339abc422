"""`gemmaforge serve` on real HTTP (loopback), driven by the official `ollama` and `openai` Python clients:
a tiny run's adapter and its base share one transformers engine; the base's GGUF runs through llama.cpp."""

from __future__ import annotations

import base64
import functools
import io
import json
import re
import shutil
import struct
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Literal

import httpx
import pydantic
import pytest
import yaml

from gemmaforge.chat.conversation import IGNORE_INDEX
from gemmaforge.cli import build_parser, main
from gemmaforge.cli.serve import serve_options
from gemmaforge.config import Split
from gemmaforge.export.gguf import write_gguf
from gemmaforge.export.gguf_shards import split_gguf_file
from gemmaforge.families import FAMILIES
from gemmaforge.models import EMBEDDED_NAME, default_home
from gemmaforge.serve.server import ServeOptions, background_server, load_registry
from tests.helpers import reference_answer, reference_answer_to_ids, reference_embedding, write_config

pytestmark = pytest.mark.integration
ollama = pytest.importorskip("ollama")
openai = pytest.importorskip("openai")

HI = [{"role": "user", "content": "What is a flat white?"}]
GREEDY = {"temperature": 0, "num_predict": 12}


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory, tiny_gemma3_dir: Path) -> Path:
    tmp = tmp_path_factory.mktemp("serve-run")
    assert main(["train", str(write_config(tmp, tiny_gemma3_dir))]) == 0
    return tmp / "run"


@pytest.fixture(scope="module")
def server(run_dir: Path, tiny_gemma3_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    gguf = write_gguf(tiny_gemma3_dir, tmp_path_factory.mktemp("serve-gguf") / "tiny-f16.gguf", "f16")
    options = ServeOptions(max_batch=16, max_queue=64, dtype="fp32")  # fp32: batched answers equal single ones
    registry = load_registry([str(run_dir), f"base={tiny_gemma3_dir}", f"gguf={gguf}"], options, default_home())
    with background_server(registry, options) as url:
        yield url, registry
    registry.close()


@pytest.fixture(scope="module")
def client(server) -> ollama.Client:
    return ollama.Client(host=server[0])


@pytest.fixture(scope="module")
def oai(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server[0] + "/v1", api_key="unused", max_retries=0)


# ---------------------------------------------------------------------------- the Ollama client


def test_ollama_client_lists_shows_and_reports_versions(client, run_dir: Path) -> None:
    names = [m.model for m in client.list().models]
    assert names == ["tiny-coffee:latest", "base:latest", "gguf:latest"]
    show = client.show("tiny-coffee")
    assert show.details.family == "gemma3" and show.details.format == "safetensors"
    assert show.details.parent_model and "<start_of_turn>" in show.template
    assert 'stop "<end_of_turn>"' in show.parameters and "temperature 0.7" in show.parameters
    assert client.show("gguf").details.format == "gguf" and client.show("gguf").details.quantization_level == "F16"
    assert len(client.ps().models) == 3
    assert httpx.get(client._client.base_url.join("/api/version")).json()["version"]
    assert httpx.get(str(client._client.base_url)).text == "Ollama is running"


def test_chat_applies_the_adapter_and_the_base_stays_the_base(client, server) -> None:
    registry = server[1]
    tuned = client.chat(model="tiny-coffee", messages=HI, options=GREEDY)
    base = client.chat(model="base", messages=HI, options=GREEDY)
    assert tuned.message.role == "assistant" and tuned.done and tuned.done_reason in ("stop", "length")
    assert tuned.message.content == reference_answer(registry, "tiny-coffee:latest", HI, 12)
    assert base.message.content == reference_answer(registry, "base:latest", HI, 12)
    assert tuned.message.content != base.message.content
    assert tuned.prompt_eval_count > 5 and 0 < tuned.eval_count <= 12 and tuned.total_duration > 0


def test_streaming_chat_and_generate_match_the_whole_answer(client) -> None:
    whole = client.chat(model="tiny-coffee", messages=HI, options=GREEDY).message.content
    chunks = list(client.chat(model="tiny-coffee", messages=HI, options=GREEDY, stream=True))
    assert all(c.message.role == "assistant" for c in chunks) and chunks[-1].done
    assert not any(c.done for c in chunks[:-1]) and chunks[-1].message.content == ""
    assert "".join(c.message.content for c in chunks) == whole
    generated = list(client.generate(model="tiny-coffee", prompt=HI[0]["content"], options=GREEDY, stream=True))
    assert "".join(c.response for c in generated) == whole  # /api/generate uses the same chat template
    assert generated[-1].eval_count == len(generated) - 1 or generated[-1].done_reason == "stop"


def test_options_num_predict_seed_and_stop(client) -> None:
    short = client.generate(model="base", prompt="Tell me about coffee", options={"num_predict": 3, "temperature": 0})
    assert short.eval_count == 3 and short.done_reason == "length"
    sampled = [client.generate(model="base", prompt="coffee", options={"seed": 7, "temperature": 1.0,
                                                                        "num_predict": 10}).response for _ in range(2)]
    assert sampled[0] == sampled[1]
    full = client.generate(model="base", prompt="coffee", options={"temperature": 0, "num_predict": 10}).response
    stop = full.strip()[2:4]
    cut = client.generate(model="base", prompt="coffee", options={"temperature": 0, "num_predict": 10, "stop": [stop]})
    assert cut.done_reason == "stop" and stop not in cut.response and full.startswith(cut.response)


def test_options_min_p_repeat_last_n_and_num_ctx(client, server, monkeypatch: pytest.MonkeyPatch) -> None:
    for model in ("base", "gguf"):  # both engines
        greedy = client.chat(model=model, messages=HI, options={"temperature": 0, "num_predict": 8}).message.content
        hot = {"temperature": 5.0, "num_predict": 8}
        sampled = {client.chat(model=model, messages=HI, options={**hot, "seed": s}).message.content for s in (1, 2)}
        assert len(sampled) == 2  # at temperature 5 two seeds answer differently...
        for seed in (1, 2):  # ...unless min_p 1 keeps only the most likely token
            assert client.chat(model=model, messages=HI,
                               options={**hot, "seed": seed, "min_p": 1.0}).message.content == greedy
        penalised = {"temperature": 0, "num_predict": 8, "repeat_penalty": 100.0}
        assert client.chat(model=model, messages=HI, options={**penalised, "repeat_last_n": 0}).message.content == \
            greedy  # a window of 0 tokens: no penalty
        assert client.chat(model=model, messages=HI, options={**penalised, "repeat_last_n": 64}).message.content != \
            greedy  # the greedy answer repeats itself
        neutral = {"temperature": 0, "num_predict": 8, "frequency_penalty": 0, "presence_penalty": 0, "mirostat": 0,
                   "typical_p": 1.0, "num_thread": 1, "num_gpu": 0}  # unimplemented at their neutral value; runtime
        assert client.chat(model=model, messages=HI, options=neutral).message.content == greedy
    monkeypatch.setattr(server[1].get("base").engine, "stops", set())  # only the context may end the answer
    n_prompt = client.chat(model="base", messages=HI, options={"num_predict": 1}).prompt_eval_count
    short = client.chat(model="base", messages=HI, options={"num_ctx": n_prompt + 3, "num_predict": 100})
    assert (short.eval_count, short.done_reason) == (3, "length")
    with pytest.raises(ollama.ResponseError) as e:
        client.chat(model="base", messages=HI, options={"num_ctx": n_prompt})
    assert e.value.status_code == 400 and f"does not fit the context window of {n_prompt} tokens" in e.value.error
    long = [{"role": "user", "content": "coffee " * 5000}]  # beyond --num-ctx (4096): a larger num_ctx is cut to it
    with pytest.raises(ollama.ResponseError) as e:
        client.chat(model="base", messages=long, options={"num_ctx": 100_000})
    assert e.value.status_code == 400 and "does not fit the context window of 4096 tokens" in e.value.error
    assert client.chat(model="base", messages=HI, options={"num_ctx": 100_000, "num_predict": 2}).eval_count == 2


def test_the_llama_cpp_engine_answers_like_llama_cpp(client, server) -> None:
    import llama_cpp

    from gemmaforge.serve.protocol import chat_prompt

    served = server[1].get("gguf")
    answer = client.chat(model="gguf", messages=HI, options=GREEDY)
    llm = llama_cpp.Llama(model_path=str(served.engine.path), n_ctx=256, verbose=False)
    ids = llm.tokenize(chat_prompt(served, HI).encode(), add_bos=False, special=True)
    want = llm.create_completion(ids, max_tokens=12, temperature=0.0, top_k=1, stop=["<end_of_turn>"])
    assert answer.message.content == want["choices"][0]["text"]
    assert answer.prompt_eval_count == len(ids)


def test_log_probabilities_agree_between_the_engines_and_with_llama_cpp(client, oai, server) -> None:
    """logprobs / top_logprobs on /api/chat: one entry per answer token whose texts make the answer, the greedy
    token first among its alternatives. The f16 GGUF through llama.cpp and the fp32 weights through transformers
    agree within 5e-3 (measured: 4.6e-4 at most on this model; near-ties may swap places in the top list, so
    tokens listed by both are compared), and the llama.cpp engine's equal llama-cpp-python's own logprobs."""
    import llama_cpp

    from gemmaforge.serve.protocol import chat_prompt

    answers = {m: client.chat(model=m, messages=HI, options=GREEDY, logprobs=True, top_logprobs=3)
               for m in ("base", "gguf")}
    for answer in answers.values():
        assert len(answer.logprobs) == answer.eval_count == 12
        assert "".join(x.token for x in answer.logprobs) == answer.message.content
        for x in answer.logprobs:
            assert len(x.top_logprobs) == 3 and x.top_logprobs[0].token == x.token
            assert x.top_logprobs[0].logprob == x.logprob < 0
    for mine, theirs in zip(answers["base"].logprobs, answers["gguf"].logprobs, strict=True):
        assert mine.token == theirs.token and mine.logprob == pytest.approx(theirs.logprob, abs=5e-3)
        top = {t.token: t.logprob for t in theirs.top_logprobs}
        shared = [t for t in mine.top_logprobs if t.token in top]
        assert len(shared) >= 2 and all(t.logprob == pytest.approx(top[t.token], abs=5e-3) for t in shared)
    served = server[1].get("gguf")
    llm = llama_cpp.Llama(model_path=str(served.engine.path), n_ctx=256, logits_all=True, verbose=False)
    ids = llm.tokenize(chat_prompt(served, HI).encode(), add_bos=False, special=True)
    want = llm.create_completion(ids, max_tokens=12, temperature=0.0, top_k=1, logprobs=3)["choices"][0]["logprobs"]
    assert [x.logprob for x in answers["gguf"].logprobs] == pytest.approx(want["token_logprobs"], abs=1e-5)


def test_log_probabilities_streamed_and_on_the_openai_routes(client, oai) -> None:
    """A streamed answer's chunks carry their own tokens' logprobs, the same as the whole answer's; OpenAI's chat
    completions carry them in choices[0].logprobs.content (with each token's bytes), its completions as tokens,
    token_logprobs, top_logprobs and text offsets; a request without logprobs gets none."""
    whole = client.generate(model="base", prompt="Espresso is", options=GREEDY, logprobs=True, top_logprobs=2)
    chunks = list(client.generate(model="base", prompt="Espresso is", options=GREEDY, logprobs=True, top_logprobs=2,
                                  stream=True))
    streamed = [x for chunk in chunks for x in chunk.logprobs or []]
    assert [(x.token, x.logprob) for x in streamed] == [(x.token, x.logprob) for x in whole.logprobs]
    assert client.chat(model="base", messages=HI, options=GREEDY).logprobs is None
    chat = oai.chat.completions.create(model="base", messages=HI, temperature=0, max_tokens=6, logprobs=True,
                                       top_logprobs=2).choices[0]
    assert b"".join(bytes(x.bytes) for x in chat.logprobs.content).decode() == chat.message.content
    assert all(len(x.top_logprobs) == 2 and x.top_logprobs[0].token == x.token for x in chat.logprobs.content)
    text = oai.completions.create(model="gguf", prompt="Espresso is", temperature=0, max_tokens=6, logprobs=2)
    logprobs = text.choices[0].logprobs
    assert "".join(logprobs.tokens) == text.choices[0].text and len(logprobs.token_logprobs) == 6
    assert logprobs.text_offset == [len("".join(logprobs.tokens[:i])) for i in range(6)]
    assert all(len(top) == 2 and max(top.values()) == lp for top, lp in zip(logprobs.top_logprobs,
                                                                             logprobs.token_logprobs))
    with pytest.raises(ollama.ResponseError) as e:
        client.chat(model="base", messages=HI, logprobs=True, top_logprobs=21)
    assert e.value.status_code == 400 and "top_logprobs: 21 is out of range [0, 20]" in e.value.error
    with pytest.raises(ollama.ResponseError, match="top_logprobs: needs logprobs: true"):
        client.chat(model="base", messages=HI, top_logprobs=2)
    with pytest.raises(openai.BadRequestError, match=r"logprobs: -1 is out of range"):
        oai.completions.create(model="base", prompt="Espresso is", logprobs=-1)


def test_the_llama_cpp_engine_runs_one_request_at_a_time(client, server, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two requests at once: the second is submitted while the first generates (the first waits for it at
    its first token), and llama.cpp is never asked for a second generation before the first has ended."""
    engine = server[1].get("gguf").engine
    prompts = [[{"role": "user", "content": text}] for text in ("What is a flat white?", "And a cortado?")]
    alone = [client.chat(model="gguf", messages=m, options=GREEDY).message.content for m in prompts]
    real_generate, real_submit = engine.llm.generate, engine.submit
    both_submitted, generating, overlaps = threading.Event(), [], []

    def submit(job) -> None:
        real_submit(job)
        if engine.running() == 2:
            both_submitted.set()

    def generate(*args, **kwargs):
        if generating:  # refused before llama.cpp is touched: it would compute on one context from two threads
            overlaps.append(len(generating))
            raise RuntimeError("a second generation began while one was running")
        generating.append(True)
        try:
            for i, token in enumerate(real_generate(*args, **kwargs)):
                if i == 0:
                    both_submitted.wait(timeout=30)
                yield token
        finally:
            generating.pop()

    monkeypatch.setattr(engine, "submit", submit)
    monkeypatch.setattr(engine.llm, "generate", generate)
    with ThreadPoolExecutor(2) as pool:  # a request that is never answered fails at the clients' timeout
        together = list(pool.map(lambda m: ollama.Client(host=server[0], timeout=60).chat(model="gguf", messages=m,
                                                                                          options=GREEDY), prompts))
    assert both_submitted.is_set() and overlaps == []
    assert [r.message.content for r in together] == alone


def test_the_llama_cpp_engine_serves_a_split_gguf(client, server, tmp_path: Path) -> None:
    registry = server[1]
    parts = split_gguf_file(registry.get("gguf").engine.path, tmp_path / "tiny-f16.gguf", Split(max_tensors=10))
    assert [p.name for p in parts] == [f"tiny-f16-0000{i}-of-00003.gguf" for i in (1, 2, 3)]
    served = registry.add(f"split={parts[0]}")
    try:
        assert served.engine.kind == "llamacpp" and served.size == sum(p.stat().st_size for p in parts)
        answer = client.chat(model="split", messages=HI, options=GREEDY)
        assert answer.message.content == client.chat(model="gguf", messages=HI, options=GREEDY).message.content
        assert answer.eval_count > 0
    finally:
        registry.remove("split:latest")


def test_served_prompts_are_the_training_prompts(client, server, gemma3_tokenizer) -> None:
    """The prompt a served model sees is, token for token, what training put before the answer (the
    training tokenization of the same conversation, up to the first supervised token)."""
    asked = [{"role": "system", "content": "You are a barista."}, {"role": "user", "content": "What is a flat white?"}]
    answered = [*asked, {"role": "assistant", "content": "Espresso with steamed milk."}]
    ids, labels = FAMILIES["gemma3"].chat.encode(answered, gemma3_tokenizer, cutoff_len=4096)
    prompt = ids[:next(i for i, label in enumerate(labels) if label != IGNORE_INDEX)]
    assert gemma3_tokenizer.decode(prompt).endswith("<start_of_turn>model\n")
    tuned = client.chat(model="tiny-coffee", messages=asked, options=GREEDY)
    assert tuned.prompt_eval_count == len(prompt)
    assert tuned.message.content == reference_answer_to_ids(server[1], "tiny-coffee", prompt, 12)
    assert client.chat(model="gguf", messages=asked, options=GREEDY).prompt_eval_count == len(prompt)


def test_a_final_assistant_message_is_continued_and_same_role_turns_merge(client, oai, server,
                                                                         gemma3_tokenizer) -> None:
    """Open WebUI's "continue response" sends the conversation with the answer so far last: the answer goes on
    from inside that turn (the prompt ends with its text, no end-of-turn), on both APIs and both engines.
    Consecutive messages of one role are one turn, their texts a blank line apart, as Ollama merges them."""
    asked = [{"role": "user", "content": "What is a flat white?"}, {"role": "assistant", "content": "A flat white is"}]
    prompt = gemma3_tokenizer("<bos><start_of_turn>user\nWhat is a flat white?<end_of_turn>\n"
                              "<start_of_turn>model\nA flat white is", add_special_tokens=False).input_ids
    for name in ("tiny-coffee", "gguf"):
        answer = client.chat(model=name, messages=asked, options=GREEDY)
        assert answer.prompt_eval_count == len(prompt)
        if name == "tiny-coffee":
            assert answer.message.content == reference_answer_to_ids(server[1], name, prompt, 12)
    openai_answer = oai.chat.completions.create(model="tiny-coffee", messages=asked, temperature=0, max_tokens=12)
    assert openai_answer.usage.prompt_tokens == len(prompt)
    assert openai_answer.choices[0].message.content == client.chat(model="tiny-coffee", messages=asked,
                                                                   options=GREEDY).message.content
    split = [{"role": "user", "content": "What is"}, {"role": "user", "content": "a flat white?"}]
    merged = [{"role": "user", "content": "What is\n\na flat white?"}]
    assert (client.chat(model="tiny-coffee", messages=split, options=GREEDY).message.content
            == client.chat(model="tiny-coffee", messages=merged, options=GREEDY).message.content)


def test_copy_pull_and_push_answer_as_ollama_does(client) -> None:
    """Open WebUI's model admin: a copy is another name for the same model (deleting it leaves the original and
    its adapter served); pull and push say why this server does not and what to do instead."""
    tuned = client.chat(model="tiny-coffee", messages=HI, options=GREEDY).message.content
    client.copy("tiny-coffee", "barista")
    try:
        assert "barista:latest" in [m.model for m in client.list().models]
        assert client.chat(model="barista", messages=HI, options=GREEDY).message.content == tuned
        with pytest.raises(ollama.ResponseError) as e:
            client.copy("base", "barista")
        assert e.value.status_code == 400 and "already served" in e.value.error
    finally:
        client.delete("barista")
    assert client.chat(model="tiny-coffee", messages=HI, options=GREEDY).message.content == tuned  # adapter kept
    with pytest.raises(ollama.ResponseError) as e:
        client.copy("nope", "other")
    assert e.value.status_code == 404
    assert client.pull("tiny-coffee").status == "success"
    assert [part.status for part in client.pull("tiny-coffee", stream=True)] == ["success"]
    with pytest.raises(ollama.ResponseError) as e:
        client.pull("gemma3:4b")
    assert e.value.status_code == 400 and "does not pull" in e.value.error
    with pytest.raises(ollama.ResponseError) as e:
        client.push("tiny-coffee")
    assert e.value.status_code == 400 and "ollama push" in e.value.error


def test_create_serves_a_model_from_a_served_one_or_a_file(client, server) -> None:
    """/api/create FROM a served model: another name with its own SYSTEM and PARAMETERs over the same adapter;
    FROM a file on the server's disk: that file served. What needs blobs or another template is refused."""
    assert client.create(model="terse", from_="tiny-coffee", system="Answer in one word.",
                         parameters={"temperature": 0, "num_predict": 5}).status == "success"
    try:
        show = httpx.post(str(client._client.base_url.join("/api/show")), json={"model": "terse"}).json()
        assert show["system"] == "Answer in one word." and "num_predict 5" in show["parameters"]
        created = client.chat(model="terse", messages=HI)
        same = client.chat(model="tiny-coffee", options={"temperature": 0, "num_predict": 5},
                           messages=[{"role": "system", "content": "Answer in one word."}, *HI])
        assert created.message.content == same.message.content and created.eval_count <= 5
        assert created.prompt_eval_count == same.prompt_eval_count
    finally:
        client.delete("terse")
    assert client.chat(model="tiny-coffee", messages=HI, options=GREEDY).message.content  # its adapter stayed
    gguf = server[1].get("gguf").engine.path
    client.create(model="from-file", from_=str(gguf))
    try:
        assert (client.chat(model="from-file", messages=HI, options=GREEDY).message.content
                == client.chat(model="gguf", messages=HI, options=GREEDY).message.content)
    finally:
        client.delete("from-file")
    refused = {"template": ({"from_": "base", "template": "{{ .Prompt }}"}, "family's own TEMPLATE"),
               "quantize": ({"from_": "base", "quantize": "q4_0"}, "gemmaforge export gguf"),
               "adapters": ({"from_": "base", "adapters": {"a.gguf": "sha256:00"}}, "load_lora_adapter"),
               "parameters": ({"from_": "base", "parameters": {"mirostat": 1}}, "mirostat not supported"),
               "from": ({"from_": "no/such/place"}, "expected a run directory"),
               "name": ({"from_": "base", "model": "gguf"}, "already served")}
    for what, (fields, message) in refused.items():
        with pytest.raises(ollama.ResponseError) as e:
            client.create(**{"model": "refused", **fields})
        assert e.value.status_code == 400 and message in e.value.error, what
    assert [m.model for m in client.list().models] == ["tiny-coffee:latest", "base:latest", "gguf:latest"]


def _loaded(client) -> dict[str, str]:
    return {m.model: m.expires_at for m in client.ps().models}


def test_keep_alive_unloads_a_model_and_its_next_request_loads_it_again(client, server,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """Open WebUI's eject (keep_alive 0 with no prompt), a keep_alive that runs out, and the model loaded
    again by its next request, answering as before; /api/ps shows what is loaded and until when."""
    registry = server[1]
    assert all(at.year > 2200 for at in _loaded(client).values())  # --keep-alive's default: until the server stops
    before = {name: client.chat(model=name, messages=HI, options=GREEDY).message.content
              for name in ("gguf", "tiny-coffee")}
    assert client.generate(model="gguf", prompt="", keep_alive=0).done_reason == "unload"
    assert "gguf:latest" not in _loaded(client) and "gguf:latest" in [m.model for m in client.list().models]
    assert not any(e.kind == "llamacpp" for e in registry.engines.values())  # its memory is freed
    assert client.chat(model="gguf", messages=HI, options=GREEDY).message.content == before["gguf"]
    assert "gguf:latest" in _loaded(client)
    # an eject while an answer streams (Open WebUI's eject during a reply): the model stays for that answer and
    # goes when it ends, as Ollama orders keep_alive (the latest request's counts, not the latest to finish)
    monkeypatch.setattr(registry.get("base").engine, "stops", set())  # only the client may end this answer
    body = {"model": "base", "prompt": "coffee", "options": {"num_predict": 4000, "temperature": 0}}
    with httpx.stream("POST", server[0] + "/api/generate", json=body, timeout=30) as response:
        lines = response.iter_lines()  # kept: a discarded line iterator closes the connection when collected
        assert json.loads(next(lines))["done"] is False
        assert client.generate(model="base", prompt="", keep_alive=0).done_reason == "unload"
        assert "base:latest" in _loaded(client)  # still answering
    deadline = time.monotonic() + 10
    while "base:latest" in _loaded(client) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert "base:latest" not in _loaded(client) and "tiny-coffee:latest" in _loaded(client)
    monkeypatch.undo()
    assert client.generate(model="base", prompt="coffee", options=GREEDY).done  # loaded again

    answer = client.chat(model="tiny-coffee", messages=HI, options=GREEDY, keep_alive="1s")
    assert answer.message.content == before["tiny-coffee"]
    assert _loaded(client)["tiny-coffee:latest"].year < 2200
    deadline = time.monotonic() + 15
    while "tiny-coffee:latest" in _loaded(client) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert "tiny-coffee:latest" not in _loaded(client) and "base:latest" in _loaded(client)
    assert "tiny-coffee:latest" not in registry.get("base").engine.adapters  # the base stays, the adapter went
    assert client.chat(model="tiny-coffee", messages=HI, options=GREEDY).message.content == before["tiny-coffee"]
    assert client.chat(model="tiny-coffee", messages=[], keep_alive=0).done_reason == "unload"
    assert client.chat(model="tiny-coffee", messages=HI, options=GREEDY).message.content == before["tiny-coffee"]
    assert set(_loaded(client)) == {"tiny-coffee:latest", "base:latest", "gguf:latest"}
    with pytest.raises(ollama.ResponseError) as e:
        client.chat(model="base", messages=HI, keep_alive="300")
    assert e.value.status_code == 400 and "keep_alive: '300' is not a duration" in e.value.error


def test_ollama_errors(client) -> None:
    with pytest.raises(ollama.ResponseError) as e:
        client.chat(model="nope", messages=HI)
    assert e.value.status_code == 404 and e.value.error == "model 'nope' not found"
    with pytest.raises(ollama.ResponseError) as e:
        client.chat(model="base", messages=[{"role": "robot", "content": "hi"}])
    assert e.value.status_code == 400 and "'robot' is not supported" in e.value.error
    with pytest.raises(ollama.ResponseError) as e:
        client.chat(model="base", messages=[{"role": "system", "content": "Be brief."}])
    assert e.value.status_code == 400 and "no user or assistant message" in e.value.error
    for model, reason in (("base", "Invalid type: objectx"), ("gguf", "Unrecognized schema")):
        with pytest.raises(ollama.ResponseError) as e:
            client.generate(model=model, prompt="hi", format={"type": "objectx"})
        assert e.value.status_code == 400 and "this JSON schema cannot be enforced" in e.value.error
        assert reason in e.value.error
    assert client.generate(model="base", prompt="").done_reason == "load"


# ---------------------------------------------------------------------------- structured outputs


class Order(pydantic.BaseModel):
    drink: Literal["latte", "flat white", "espresso"]
    cups: int
    iced: bool


@pytest.mark.parametrize("model", ["gguf", "base", "tiny-coffee"])
def test_structured_outputs_hold_every_answer_to_the_schema(client, oai, model: str) -> None:
    """Ollama's `format` (JSON mode, a pydantic model's schema as the ollama client sends it) and OpenAI's
    `response_format` (json_object, json_schema through the openai client's parse helper) on the llama.cpp engine
    (its grammar sampler) and the transformers engine (llguidance), with and without an adapter: every answer
    parses, and validates, greedy or sampled, ending on the end of turn."""
    sampled = {"temperature": 1.0, "seed": 7, "num_predict": 96}
    for options in ({"temperature": 0, "num_predict": 96}, sampled):
        answer = client.chat(model=model, messages=HI, format=Order.model_json_schema(), options=options)
        Order.model_validate_json(answer.message.content)
        assert answer.done_reason == "stop"
        chunks = list(client.chat(model=model, messages=HI, format=Order.model_json_schema(), options=options,
                                  stream=True))
        assert "".join(c.message.content for c in chunks) == answer.message.content
    parsed = oai.chat.completions.parse(model=model, messages=HI, response_format=Order, temperature=0,
                                        max_tokens=96)
    assert isinstance(parsed.choices[0].message.parsed, Order)
    # JSON mode on these random models runs on to the token budget (the object never closes): the answer is held
    # to the grammar all the same; that it parses and stops is shown on a model that closes it, below
    json_mode = client.generate(model=model, prompt="Describe a latte.", format="json", options=sampled)
    json_object = oai.chat.completions.create(model=model, messages=HI, response_format={"type": "json_object"},
                                              max_tokens=96, seed=7)
    plain = client.generate(model=model, prompt="Describe a latte.", options=sampled).response
    for text in (json_mode.response, json_object.choices[0].message.content):
        assert text.startswith("{") and text != plain


@pytest.fixture(scope="module")
def closing_model(tmp_path_factory: pytest.TempPathFactory, tiny_gemma3_dir: Path) -> Path:
    """The tiny Gemma 3 made to close a JSON object as soon as the grammar lets it: every layer's output projection
    zeroed (the last hidden state is the current token's embedding), and one embedding coordinate that every token
    shares ranks the next tokens end of turn > '"' > '}' > the rest. Unconstrained it ends its turn at once."""
    import torch
    from transformers import AutoTokenizer, Gemma3ForCausalLM

    target = tmp_path_factory.mktemp("closing") / "model"
    tokenizer = AutoTokenizer.from_pretrained(tiny_gemma3_dir)
    model = Gemma3ForCausalLM.from_pretrained(tiny_gemma3_dir, dtype=torch.float32)
    with torch.no_grad():
        for name, weight in model.named_parameters():
            if name.endswith(("o_proj.weight", "down_proj.weight")):
                weight.zero_()
        model.model.norm.weight[0] = 0.0  # Gemma's norm scales by 1 + weight: keep the shared coordinate's sign
        embeddings = model.model.embed_tokens.weight
        embeddings[:, 0] = 1.0
        for token, rank in (("<end_of_turn>", 120.0), ('"', 60.0), ("}", 30.0)):
            embeddings[tokenizer.convert_tokens_to_ids(token), 0] = rank
    model.save_pretrained(target)
    tokenizer.save_pretrained(target)
    return target


@pytest.mark.parametrize("engine", ["transformers", "llamacpp"])
def test_json_mode_answers_parse_and_stop_when_the_object_closes(closing_model: Path, engine: str) -> None:
    """Ollama's `format: "json"` and OpenAI's json_object on both engines, with a model that would otherwise say
    nothing: the grammar carries it past its end of turn into an object, and the answer stops once the object is
    closed (a grammar that never let it end, or one not applied, fails here)."""
    source = closing_model
    if engine == "llamacpp":
        source = write_gguf(closing_model, closing_model.parent / "closing-f32.gguf", "f32")
    options = ServeOptions(max_batch=2, max_queue=8, dtype="fp32")
    registry = load_registry([f"closing={source}"], options, default_home())
    try:
        with background_server(registry, options) as url:
            client = ollama.Client(host=url)
            oai = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
            plain = client.generate(model="closing", prompt="Describe a latte.", options=GREEDY)
            assert plain.response == "" and plain.done_reason == "stop"
            for options_ in ({"temperature": 0, "num_predict": 64}, {"temperature": 1.0, "seed": 7, "num_predict": 64}):
                answer = client.generate(model="closing", prompt="Describe a latte.", format="json", options=options_)
                assert answer.done_reason == "stop" and answer.eval_count < 64, answer
                assert isinstance(json.loads(answer.response), dict)
                chunks = list(client.chat(model="closing", messages=HI, format="json", options=options_, stream=True))
                assert chunks[-1].done_reason == "stop"
                assert isinstance(json.loads("".join(c.message.content for c in chunks)), dict)
            completion = oai.chat.completions.create(model="closing", messages=HI, max_tokens=64, seed=7,
                                                     response_format={"type": "json_object"})
            assert completion.choices[0].finish_reason == "stop"
            assert isinstance(json.loads(completion.choices[0].message.content), dict)
    finally:
        registry.close()


# ---------------------------------------------------------------------------- embeddings


def _unit(vector: list[float]) -> list[float]:
    norm = sum(v * v for v in vector) ** 0.5
    return [v / norm for v in vector]


def _cosine(a: list[float], b: list[float]) -> float:
    return sum(x * y for x, y in zip(_unit(a), _unit(b)))


def test_embeddings_on_both_apis_and_both_engines(client, oai, server) -> None:
    """/api/embed (normalised, batch, dimensions, truncate), /api/embeddings (as pooled), /v1/embeddings (float
    and the openai client's base64): the mean of transformers' own final hidden states, with the served adapter;
    the llama.cpp engine's MEAN pooling of the same base agrees."""
    texts = ["What is a flat white?", "冷萃咖啡"]
    registry = server[1]
    for name in ("base", "tiny-coffee"):
        expected = [reference_embedding(registry, name, t) for t in texts]
        got = client.embed(model=name, input=texts)
        assert len(got.embeddings) == 2 and got.prompt_eval_count == sum(
            len(registry.get(name).engine.encode(t)) + 1 for t in texts)
        for vector, reference in zip(got.embeddings, expected):
            assert vector == pytest.approx(_unit(reference), abs=1e-5)
        assert client.embeddings(model=name, prompt=texts[0]).embedding == pytest.approx(expected[0], rel=1e-4,
                                                                                          abs=1e-5)
    assert _cosine(client.embed(model="base", input=texts[0]).embeddings[0],
                   client.embed(model="tiny-coffee", input=texts[0]).embeddings[0]) < 1 - 1e-6  # the adapter acts
    full = client.embed(model="base", input=texts[0]).embeddings[0]
    assert client.embed(model="base", input=texts[0], dimensions=8).embeddings[0] == pytest.approx(_unit(full[:8]))
    gguf = client.embed(model="gguf", input=texts).embeddings
    for vector, reference in zip(gguf, client.embed(model="base", input=texts).embeddings):
        assert _cosine(vector, reference) > 0.999  # llama.cpp on the f16 file against transformers in fp32
    assert client.embed(model="base", input=[]).embeddings == []  # Ollama's way of loading a model
    long = "espresso " * 5000
    assert client.embed(model="base", input=long).prompt_eval_count == registry.num_ctx
    with pytest.raises(ollama.ResponseError) as e:
        client.embed(model="base", input=long, truncate=False)
    assert e.value.status_code == 400 and "exceeds the context length" in e.value.error
    expected = client.embed(model="tiny-coffee", input=texts).embeddings
    for encoding in (None, "float", "base64"):  # unless told, the openai client asks for base64 and decodes it
        answer = oai.embeddings.create(model="tiny-coffee", input=texts, **({"encoding_format": encoding}
                                                                           if encoding else {}))
        assert [d.index for d in answer.data] == [0, 1] and answer.usage.prompt_tokens > 0
        for d, reference in zip(answer.data, expected):
            vector = d.embedding
            if encoding == "base64":  # asked for by name: the client hands the string over as it came
                raw = base64.b64decode(vector)
                vector = list(struct.unpack(f"<{len(raw) // 4}f", raw))
            assert vector == pytest.approx(reference, abs=1e-6)
    assert len(oai.embeddings.create(model="tiny-coffee", input=texts[0]).data[0].embedding) == len(full)


def test_embedding_errors(client, oai) -> None:
    with pytest.raises(ollama.ResponseError) as e:
        client.embed(model="nope", input="hi")
    assert e.value.status_code == 404
    with pytest.raises(openai.BadRequestError) as oe:
        oai.embeddings.create(model="base", input=[[1, 2, 3]])
    assert "token ids are not supported" in oe.value.message
    with pytest.raises(openai.BadRequestError) as oe:
        oai.embeddings.create(model="base", input=[])
    assert "at least one text" in oe.value.message
    response = httpx.post(str(client._client.base_url.join("/api/embed")), json={"model": "base", "input": [1]})
    assert response.status_code == 400 and "token ids" in response.json()["error"]


# ---------------------------------------------------------------------------- the OpenAI client


def test_openai_client_models_chat_and_completions(oai, client) -> None:
    assert [m.id for m in oai.models.list()] == ["tiny-coffee:latest", "base:latest", "gguf:latest"]
    assert oai.models.retrieve("tiny-coffee:latest").parent
    whole = client.chat(model="tiny-coffee", messages=HI, options=GREEDY).message.content
    reply = oai.chat.completions.create(model="tiny-coffee", messages=HI, max_tokens=12, temperature=0)
    assert reply.choices[0].message.content == whole and reply.choices[0].message.role == "assistant"
    assert reply.object == "chat.completion" and reply.id.startswith("chatcmpl-")
    assert reply.usage.total_tokens == reply.usage.prompt_tokens + reply.usage.completion_tokens
    assert reply.choices[0].finish_reason in ("stop", "length")
    text = oai.completions.create(model="base", prompt="coffee", max_tokens=5, temperature=0)
    assert text.object == "text_completion" and text.usage.completion_tokens == 5
    assert text.choices[0].finish_reason == "length"


def test_openai_streaming_with_usage_ends_in_done(oai, server) -> None:
    chunks = list(oai.chat.completions.create(model="tiny-coffee", messages=HI, max_tokens=12, temperature=0,
                                              stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens > 0
    assert chunks[-2].choices[0].finish_reason in ("stop", "length")
    whole = oai.chat.completions.create(model="tiny-coffee", messages=HI, max_tokens=12, temperature=0)
    assert "".join(c.choices[0].delta.content or "" for c in chunks[:-1]) == whole.choices[0].message.content
    raw = httpx.post(server[0] + "/v1/completions", json={"model": "base", "prompt": "hi", "max_tokens": 3,
                                                          "stream": True}).text
    assert raw.endswith("data: [DONE]\n\n") and raw.startswith("data: {")


def test_openai_options_top_p_seed_and_stop(oai) -> None:
    def ask(**kwargs) -> openai.types.chat.ChatCompletion:
        return oai.chat.completions.create(model="base", messages=HI, max_tokens=10, **kwargs)

    greedy = ask(temperature=0).choices[0].message.content
    assert ask(seed=7).choices[0].message.content == ask(seed=7).choices[0].message.content
    assert ask(seed=7).choices[0].message.content != ask(seed=8).choices[0].message.content
    assert {ask(seed=s, top_p=1e-9).choices[0].message.content for s in (7, 8)} == {greedy}  # only the best token
    stop = greedy.strip()[2:4]
    cut = ask(temperature=0, stop=[stop]).choices[0]
    assert cut.finish_reason == "stop" and stop not in cut.message.content and greedy.startswith(cut.message.content)


def test_openai_errors(oai) -> None:
    with pytest.raises(openai.NotFoundError) as e:
        oai.chat.completions.create(model="nope", messages=HI)
    assert e.value.body["message"] == "model 'nope' not found" and e.value.body["type"] == "not_found_error"
    with pytest.raises(openai.BadRequestError) as e:
        oai.chat.completions.create(model="base", messages=[])
    assert "at least one message" in e.value.body["message"]
    with pytest.raises(openai.BadRequestError) as e:
        oai.chat.completions.create(model="base", messages=HI, temperature="hot")
    assert e.value.body["message"] == "temperature: expected number, got string"


# ---------------------------------------------------------------------------- abuse and concurrency


@pytest.mark.parametrize(("path", "payload", "status", "message"), [
    ("/api/chat", b"{not json", 400, "invalid JSON"),
    ("/api/chat", b"", 400, "missing request body"),
    ("/api/chat", b"[1, 2]", 400, "must be a JSON object"),
    ("/api/chat", b'{"messages": []}', 400, "model is required"),
    ("/api/chat", b'{"model": "base", "messages": "hi"}', 400, "messages: expected array, got string"),
    ("/api/chat", b'{"model": "base", "messages": [{"role": "user", "content": 5}]}', 400, "content: expected string"),
    ("/api/chat", b'{"model": "base", "messages": [{"role": "user", "content": "hi"}], "options": {"top_p": 3}}', 400,
     "top_p: 3.0 is out of range"),
    ("/api/generate", b'{"model": "base", "prompt": "x", "options": {"top_p": 0}}', 400,
     "top_p: 0.0 is out of range (0, 1]"),
    ("/api/generate", b'{"model": "base", "prompt": "x", "options": {"repeat_penalty": 0}}', 400,
     "repeat_penalty: 0.0 is out of range"),
    ("/api/generate", b'{"model": "base", "prompt": "x", "options": {"seed": 99999999999999999999999}}', 400,
     "seed: 99999999999999999999999 is out of range"),
    ("/v1/chat/completions", (b'{"model": "base", "messages": [{"role": "user", "content": "x"}], '
                              b'"response_format": "json_object"}'), 400, "response_format: expected object"),
    ("/api/generate", b'{"model": "base", "prompt": "x", "options": {"num_predict": "many"}}', 400,
     "options.num_predict: expected number"),
    ("/api/generate", b'{"model": "base", "prompt": "x", "raw": true, "system": "s"}', 400,
     "raw mode does not support"),
    ("/api/chat", b'{"model": "base", "messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]}',
     400, "tools[0]: expected a tool definition"),
    ("/api/chat", b'{"model": "base", "messages": [{"role": "user", "content": "x", "images": ["aGk="]}]}', 400,
     "messages[0].images[0]: not a picture PIL can read"),
    ("/api/generate", b'{"model": "base", "prompt": "x", "images": ["aGk="]}', 400,
     "images[0]: not a picture PIL can read"),
    ("/api/chat", b'{"model": "base", "messages": [{"role": "user", "content": "x"}], "think": true}', 400,
     "think: base:latest does not support thinking"),
    ("/api/chat", b'{"model": "base", "messages": [{"role": "user", "content": "x"}], "format": {"$ref": "#/no"}}',
     400, "format / response_format: this JSON schema cannot be enforced"),
    ("/v1/chat/completions", (b'{"model": "base", "messages": [{"role": "user", "content": "x"}], '
                              b'"response_format": {"type": "json_schema", "json_schema": {"schema": '
                              b'{"type": "object", "properties": {"a": {"type": "string", "pattern": "("}}}}}}'), 400,
     "format / response_format: this JSON schema cannot be enforced"),
    ("/v1/completions", b'{"model": "base", "prompt": "x", "response_format": {"type": "json_schema"}}', 400,
     "response_format.json_schema.schema: required"),
    ("/v1/completions", b'{"model": "gguf", "prompt": "x", "response_format": {"type": "xml"}}', 400,
     "response_format.type: 'xml' is not supported"),
    ("/api/generate", b'{"model": "gguf", "prompt": "x", "format": "yaml"}', 400,
     "format: expected a JSON schema object, got string"),
    ("/v1/chat/completions", (b'{"model": "base", "messages": [{"role": "user", "content": "x"}], '
                              b'"tools": [{"type": "function", "function": {"name": "f"}}]}'), 400,
     "tools: base:latest does not support tools"),
    ("/v1/chat/completions", (b'{"model": "base", "messages": [{"role": "user", "content": [{"type": "image_url", '
                              b'"image_url": {"url": "data:image/png;base64,aGk="}}]}]}'), 400,
     "messages[0].content[0].image_url: not a picture PIL can read"),
    ("/v1/chat/completions", (b'{"model": "base", "messages": [{"role": "user", "content": "x"}], '
                              b'"frequency_penalty": 0.5}'), 400, "frequency_penalty: not supported"),
    ("/v1/chat/completions", (b'{"model": "base", "messages": [{"role": "user", "content": "x"}], '
                              b'"presence_penalty": -1}'), 400, "presence_penalty: not supported"),
    ("/api/chat", b'{"model": "base", "messages": [{"role": "user", "content": "x"}], "options": {"mirostat": 2}}',
     400, "options.mirostat: not supported (leave it out or use 0)"),
    ("/api/generate", b'{"model": "base", "prompt": "x", "options": {"frequency_penalty": 0.5}}', 400,
     "options.frequency_penalty: not supported"),
    ("/api/generate", b'{"model": "base", "prompt": "x", "options": {"presence_penalty": 1}}', 400,
     "options.presence_penalty: not supported"),
    ("/api/generate", b'{"model": "base", "prompt": "x", "options": {"typical_p": 0.5}}', 400,
     "options.typical_p: not supported (leave it out or use 1)"),
    ("/api/chat", b'{"model": "base", "messages": [{"role": "user", "content": "x"}], "options": {"min_p": 2}}', 400,
     "min_p: 2.0 is out of range [0, 1]"),
    ("/api/chat", b'{"model": "base", "messages": [{"role": "user", "content": "x"}], "options": {"num_ctx": "big"}}',
     400, "options.num_ctx: expected number"),
    ("/api/chat", (b'{"model": "base", "messages": [{"role": "user", "content": "x"}], '
                   b'"options": {"repeat_last_n": "all"}}'), 400, "options.repeat_last_n: expected number, got string"),
    ("/api/generate", b'{"model": "no-such-model", "prompt": "x"}', 404, "model 'no-such-model' not found"),
    ("/v1/chat/completions", b"{oops", 400, "invalid JSON"),
    ("/v1/chat/completions", b'{"model": "base", "messages": [{"role": "function", "content": "x"}]}', 400,
     "'function' is not supported"),
    ("/v1/completions", b'{"model": "base", "prompt": ["a"]}', 400, "prompt: expected a string"),
    ("/api/nothing", b"{}", 404, "is not a route"),
    ("/v1/nothing", b"{}", 404, "is not a route"),
    ("/api/copy", b'{"source": "base"}', 400, "source and destination are required"),
    ("/api/copy", b'{"source": "base", "destination": 7}', 400, "destination: expected string, got number"),
    ("/v1/load_lora_adapter", b'{"lora_name": "x", "lora_path": ""}', 400, "lora_name and lora_path are required"),
    ("/v1/unload_lora_adapter", b"{}", 400, "lora_name is required"),
])
def test_malformed_requests_get_4xx_in_the_apis_shape(server, path: str, payload: bytes, status: int,
                                                      message: str) -> None:
    response = httpx.post(server[0] + path, content=payload)
    assert response.status_code == status
    error = response.json()["error"]
    text = error["message"] if path.startswith("/v1") else error
    assert message in text
    assert httpx.get(server[0] + "/api/tags").status_code == 200


def test_oversized_prompt_and_body_are_refused(server) -> None:
    long = {"model": "base", "messages": [{"role": "user", "content": "coffee " * 5000}]}
    response = httpx.post(server[0] + "/api/chat", json=long)
    assert response.status_code == 400 and "does not fit the context window of 4096 tokens" in response.json()["error"]
    huge = b'{"model": "base", "prompt": "' + b"x" * (33 * 2**20) + b'"}'
    assert httpx.post(server[0] + "/api/generate", content=huge).status_code == 413
    pieces = iter([huge[i:i + 2**20] for i in range(0, len(huge), 2**20)])  # no Content-Length: chunked encoding
    response = httpx.post(server[0] + "/api/generate", content=pieces)
    assert response.status_code == 413 and "request body larger than 33554432 bytes" in response.json()["error"]
    assert httpx.get(server[0] + "/api/tags").status_code == 200


def test_sixteen_concurrent_streaming_clients_get_their_own_answers(client, server) -> None:
    prompts = [[{"role": "user", "content": f"Question {i}: " + "coffee " * (i % 5)}] for i in range(16)]
    models = ["tiny-coffee" if i % 2 else "base" for i in range(16)]

    def ask(i: int) -> str:
        own = ollama.Client(host=server[0])
        return "".join(c.message.content for c in own.chat(model=models[i], messages=prompts[i], options=GREEDY,
                                                          stream=True))

    with ThreadPoolExecutor(16) as pool:
        together = list(pool.map(ask, range(16)))
    alone = [client.chat(model=models[i], messages=prompts[i], options=GREEDY).message.content for i in range(16)]
    assert together == alone
    assert len(set(alone)) > 1  # the requests have answers of their own: equal lists would not be a coincidence
    assert idle(server[1].get("base").engine)


def idle(engine, within_s: float = 5) -> bool:
    """Whether the engine has no request within `within_s`: it sends a request's end just before it drops the
    request's row from its batch, so running() may count a request whose answer a client already has."""
    deadline = time.monotonic() + within_s
    while engine.running() and time.monotonic() < deadline:
        time.sleep(0.05)
    return engine.running() == 0


def test_a_client_that_disconnects_stops_its_generation(server, monkeypatch: pytest.MonkeyPatch,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    engine = server[1].get("base").engine
    # no stop tokens: the random model must not end its answer by itself (greedy decoding of it can pick a stop
    # token within a few steps), only the disconnect may end it
    monkeypatch.setattr(engine, "stops", set())
    body = {"model": "base", "messages": HI, "options": {"num_predict": 4000, "temperature": 0}}
    with httpx.stream("POST", server[0] + "/api/chat", json=body, timeout=30) as response:
        lines = response.iter_lines()  # kept: a discarded line iterator closes the connection when collected
        assert json.loads(next(lines))["done"] is False
        assert engine.running() == 1
    assert idle(engine, within_s=10)
    # the request's log line says what ended it
    logged = r"serve: POST /api/chat base:latest \(\d+ prompt tokens\): cancelled: the client went away, [\d.]+ s\n"
    assert re.search(logged, capsys.readouterr().err)


def test_adapters_load_and_unload_at_runtime(server, run_dir: Path, client) -> None:
    import torch
    from safetensors.torch import load_file

    url = server[0]
    adapter = str(run_dir / "adapter")
    response = httpx.post(url + "/v1/load_lora_adapter", json={"lora_name": "again", "lora_path": adapter})
    assert response.status_code == 200, response.text
    again = client.chat(model="again", messages=HI, options=GREEDY).message.content
    assert again == client.chat(model="tiny-coffee", messages=HI, options=GREEDY).message.content
    bad = httpx.post(url + "/v1/load_lora_adapter", json={"lora_name": "../x", "lora_path": str(run_dir / "adapter")})
    assert bad.status_code == 400 and "lora_name '../x'" in bad.json()["error"]["message"]
    broken = shutil.copytree(run_dir / "adapter", run_dir.parent / "broken-adapter")
    (broken / "adapter_model.safetensors").write_bytes(b"not safetensors")
    garbage = httpx.post(url + "/v1/load_lora_adapter", json={"lora_name": "z", "lora_path": str(broken)})
    assert garbage.status_code == 400 and "could not load the adapter" in garbage.json()["error"]["message"]
    assert "z:latest" not in [m.model for m in client.list().models]
    missing = httpx.post(url + "/v1/load_lora_adapter", json={"lora_name": "y", "lora_path": str(run_dir / "nothing")})
    assert missing.status_code == 400 and "is not a folder" in missing.json()["error"]["message"]
    pickled = shutil.copytree(run_dir / "adapter", run_dir.parent / "pickled-adapter")  # a loadable pickle adapter
    torch.save(load_file(pickled / "adapter_model.safetensors"), pickled / "adapter_model.bin")
    (pickled / "adapter_model.safetensors").unlink()
    refused = httpx.post(url + "/v1/load_lora_adapter", json={"lora_name": "p", "lora_path": str(pickled)})
    assert refused.status_code == 400 and "no adapter_model.safetensors file; only safetensors and GGUF are loaded" \
        in refused.json()["error"]["message"]
    assert "p:latest" not in [m.model for m in client.list().models]
    assert httpx.post(url + "/v1/unload_lora_adapter", json={"lora_name": "again"}).status_code == 200
    with pytest.raises(ollama.ResponseError) as e:
        client.chat(model="again", messages=HI)
    assert e.value.status_code == 404
    assert client.chat(model="tiny-coffee", messages=HI, options=GREEDY).message.content == again


def test_runs_on_one_base_share_it_and_answer_with_their_modelfile_defaults(client, oai, server,
                                                                            run_dir: Path) -> None:
    """A second run on the same base (a copy of the tiny run, its Modelfile parameters changed to temperature 0
    and a context just past the prompt, no export.ollama.name) joins the loaded base as one more adapter,
    named after its folder; a request without options takes those defaults (but OpenAI's temperature is 1)."""
    registry = server[1]
    greedy = client.chat(model="tiny-coffee", messages=HI, options=GREEDY)
    n_answer = min(greedy.eval_count, 5)
    copy = run_dir.parent / "espresso"
    shutil.copytree(run_dir / "adapter", copy / "adapter")
    config = yaml.safe_load((run_dir / "run.yaml").read_text(encoding="utf-8"))
    config["output_dir"] = str(copy)
    config["export"]["ollama"].update(name=None, temperature=0, num_ctx=greedy.prompt_eval_count + n_answer)
    (copy / "run.yaml").write_text(yaml.safe_dump(config), encoding="utf-8")
    engines = dict(registry.engines)
    served = registry.add(str(copy))
    try:
        assert served.name == "espresso:latest" and served.adapter == "espresso:latest"
        assert served.engine is registry.get("tiny-coffee").engine is registry.get("base").engine
        assert registry.engines == engines and {"espresso:latest", "tiny-coffee:latest"} <= set(served.engine.adapters)
        answers = [client.chat(model="espresso", messages=HI) for _ in range(2)]  # unseeded, no options
        assert all((a.eval_count, a.done_reason) == (n_answer, "length") for a in answers)
        want = client.chat(model="tiny-coffee", messages=HI, options={"temperature": 0, "num_predict": n_answer})
        assert [a.message.content for a in answers] == [want.message.content] * 2
        sampled = oai.chat.completions.create(model="espresso", messages=HI, seed=7)  # OpenAI: temperature 1
        want = oai.chat.completions.create(model="tiny-coffee", messages=HI, seed=7, temperature=1, top_p=1,
                                           max_tokens=n_answer)
        assert sampled.choices[0].message.content == want.choices[0].message.content != answers[0].message.content
    finally:
        registry.remove("espresso:latest")


def test_a_full_queue_answers_503_with_retry_after(tiny_gemma3_dir: Path) -> None:
    options = ServeOptions(max_batch=1, max_queue=1)
    registry = load_registry([str(tiny_gemma3_dir)], options, default_home())
    body = {"model": registry.get(next(iter(registry.models))).name, "prompt": "coffee", "stream": False,
            "options": {"num_predict": 200, "temperature": 0}}
    try:
        with background_server(registry, options) as url:
            with ThreadPoolExecutor(4) as pool:
                responses = list(pool.map(lambda _: httpx.post(url + "/api/generate", json=body, timeout=60), range(4)))
            busy = [r for r in responses if r.status_code == 503]
            assert busy and all(r.headers["retry-after"] == "1" and "busy" in r.json()["error"] for r in busy)
            assert any(r.status_code == 200 for r in responses)
            assert httpx.post(url + "/api/generate", json=body, timeout=60).status_code == 200  # healthy after
    finally:
        registry.close()


def test_a_request_stops_at_the_time_limit(tiny_gemma3_dir: Path) -> None:
    options = ServeOptions(timeout_s=1.0)
    registry = load_registry([f"tiny={tiny_gemma3_dir}"], options, default_home())
    body = {"model": "tiny", "prompt": "coffee", "stream": False, "options": {"num_predict": 3000, "temperature": 0}}
    try:
        with background_server(registry, options) as url:
            reply = httpx.post(url + "/api/generate", json=body, timeout=60).json()
            assert reply["done_reason"] == "length"  # cut by the 1 s limit, far short of 3000 tokens
            assert 0 < reply["eval_count"] < 3000 and idle(registry.get("tiny").engine)
    finally:
        registry.close()


def test_models_are_named_after_their_folder_or_file_and_max_tokens_caps_answers(server,
                                                                                tiny_gemma3_dir: Path) -> None:
    options = ServeOptions(max_tokens=3)
    gguf = server[1].get("gguf").engine.path
    registry = load_registry([str(tiny_gemma3_dir), str(gguf)], options, default_home())
    try:
        assert list(registry.models) == [f"{tiny_gemma3_dir.name}:latest", "tiny-f16:latest"]
        for served in registry.models.values():
            served.engine.stops = set()  # only the limit may end the answer
        with background_server(registry, options) as url:
            for name in registry.models:
                body = {"model": name, "prompt": "coffee", "stream": False, "options": {"num_predict": 100}}
                reply = httpx.post(url + "/api/generate", json=body, timeout=60).json()
                assert (reply["eval_count"], reply["done_reason"]) == (3, "length")
            body = {"model": "tiny-f16", "messages": HI, "max_tokens": 100}
            assert httpx.post(url + "/v1/chat/completions", json=body).json()["usage"]["completion_tokens"] == 3
    finally:
        registry.close()


def test_the_embedded_model_is_served_by_its_name(embedded_model) -> None:
    options = ServeOptions()
    registry = load_registry([EMBEDDED_NAME], options, default_home())
    try:
        served = registry.get(EMBEDDED_NAME)
        assert list(registry.models) == ["gemma3-270m:latest"] and served.source == embedded_model.path
        assert served.details["family"] == "gemma3" and served.details["parameter_size"] == "268M"
        question = [{"role": "user", "content": "What is the capital of France?"}]
        with background_server(registry, options) as url:
            answer = ollama.Client(host=url).chat(model=EMBEDDED_NAME, messages=question,
                                                  options={"temperature": 0, "num_predict": 8})
        assert answer.eval_count > 0  # transformers' own greedy answer, through the served model
        assert answer.message.content == reference_answer(registry, EMBEDDED_NAME, question, 8)
    finally:
        registry.close()


def test_an_api_key_guards_every_route_but_the_root(tiny_gemma3_dir: Path, run_dir: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GEMMAFORGE_API_KEY", "s3cret")  # as `gemmaforge serve` reads it without --api-key
    options = serve_options(build_parser().parse_args(["serve", str(tiny_gemma3_dir)]))
    registry = load_registry([f"tiny={tiny_gemma3_dir}"], options, default_home())
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}
    guarded = [("GET", "/api/tags", None), ("GET", "/v1/models", None), ("POST", "/api/chat", chat),
               ("POST", "/v1/chat/completions", chat), ("POST", "/api/generate", {"model": "tiny", "prompt": "hi"}),
               ("POST", "/v1/load_lora_adapter", {"lora_name": "new", "lora_path": str(run_dir / "adapter")}),
               ("DELETE", "/api/delete", {"model": "tiny"})]
    try:
        with background_server(registry, options) as url:
            for method, path, payload in guarded:
                for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"}):
                    response = httpx.request(method, url + path, json=payload, headers=headers)
                    assert response.status_code == 401, (method, path, headers)
            assert registry.get("tiny") is not None and registry.get("new") is None  # nothing deleted, nothing loaded
            assert httpx.get(url + "/").status_code == 200  # Ollama clients probe the root
            with pytest.raises(openai.AuthenticationError):
                openai.OpenAI(base_url=url + "/v1", api_key="wrong", max_retries=0).models.list()
            keyed_openai = openai.OpenAI(base_url=url + "/v1", api_key="s3cret")
            assert [m.id for m in keyed_openai.models.list()] == ["tiny:latest"]
            keyed = ollama.Client(host=url, headers={"Authorization": "Bearer s3cret"})
            assert keyed.generate(model="tiny", prompt="hi", options={"num_predict": 2}).eval_count == 2
    finally:
        registry.close()


def test_chat_cli_streams_keeps_history_and_obeys_commands(server, capsys) -> None:
    from io import StringIO

    from gemmaforge.serve.chat import chat_loop

    lines = iter(["/system You are a barista.", "What is a flat white?", "/bogus", "And a latte?", "/reset", "/exit"])
    out = StringIO()
    seen: list[dict] = []
    real_stream = httpx.stream

    def spy(method, url, **kwargs):
        seen.append(kwargs["json"])
        return real_stream(method, url, **kwargs)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(httpx, "stream", spy)
        chat_loop(server[0], "tiny-coffee", options={"temperature": 0, "num_predict": 6}, read=lambda _: next(lines),
                  out=out)
    text = out.getvalue()
    assert "(system prompt set)" in text and "unknown command /bogus" in text and "(conversation forgotten)" in text
    assert [m["role"] for m in seen[1]["messages"]] == ["system", "user", "assistant", "user"]
    assert seen[1]["messages"][0]["content"] == "You are a barista."
    assert seen[1]["messages"][2]["content"] and seen[1]["messages"][2]["content"] in text


def test_chat_cli_serves_a_folder_or_a_gguf_in_process_until_ctrl_d(client, server, tiny_gemma3_dir: Path,
                                                                      capsys: pytest.CaptureFixture[str],
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """`gemmaforge chat MODEL` with typed input: one question, then end of input (Ctrl-D) leaves."""
    import gemmaforge.serve.server as server_module  # where the chat verb takes its options from when it runs

    monkeypatch.setattr(server_module, "ServeOptions", functools.partial(ServeOptions, max_tokens=8))  # a short answer
    for target, served_as, flags in ((tiny_gemma3_dir, "base", ["--dtype", "fp32"]),
                                     (server[1].get("gguf").engine.path, "gguf", [])):
        monkeypatch.setattr("sys.stdin", io.StringIO(HI[0]["content"] + "\n"))
        capsys.readouterr()
        assert main(["chat", str(target), "--temperature", "0", *flags]) == 0
        out = capsys.readouterr().out
        want = client.chat(model=served_as, messages=HI, options={"temperature": 0, "num_predict": 8}).message.content
        assert f"chatting with {Path(target).stem}:latest at http://127.0.0.1:" in out
        assert out.endswith(f"/exit)\n>>> {want}\n>>> \n")  # input()'s prompt, the answer; Ctrl-D: a newline


def test_delete_unloads_a_model_and_keeps_the_rest_serving(client, server) -> None:
    engine = server[1].get("gguf").engine
    client.delete("gguf")
    assert "gguf:latest" not in [m.model for m in client.list().models]
    assert not engine._thread.is_alive()  # its llama.cpp engine is closed: no other model used it
    with pytest.raises(ollama.ResponseError) as e:
        client.delete("gguf")
    assert e.value.status_code == 404
    assert client.chat(model="base", messages=HI, options=GREEDY).done


def test_serve_and_chat_refuse_bad_input_with_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                     tiny_gemma3_dir: Path) -> None:
    assert main(["serve", str(tiny_gemma3_dir), "--host", "0.0.0.0"]) == 2
    assert "exposes the server beyond this machine: give --api-key" in capsys.readouterr().err
    assert main(["serve", str(tmp_path)]) == 2
    assert "expected a run directory (run.yaml), a Hugging Face model folder" in capsys.readouterr().err
    assert main(["serve", f"bad/../name={tiny_gemma3_dir}"]) == 2
    assert "model name 'bad/../name'" in capsys.readouterr().err
    (tmp_path / "config.json").write_text('{"model_type": "gemma3_text"}')
    assert main(["serve", str(tmp_path)]) == 2
    assert "only safetensors and GGUF are loaded" in capsys.readouterr().err
    assert main(["chat", "http://127.0.0.1:9"]) == 2
    assert "no Ollama-compatible server answers there" in capsys.readouterr().err


def test_the_last_adapter_can_be_deleted_and_loaded_again(client, server, run_dir: Path) -> None:
    before = client.chat(model="tiny-coffee", messages=HI, options=GREEDY).message.content
    base = client.chat(model="base", messages=HI, options=GREEDY).message.content
    client.delete("tiny-coffee")  # the only adapter: its layers leave the base model
    assert client.chat(model="base", messages=HI, options=GREEDY).message.content == base
    body = {"lora_name": "tiny-coffee", "lora_path": str(run_dir)}  # a run directory works as well
    response = httpx.post(server[0] + "/v1/load_lora_adapter", json=body)
    assert response.status_code == 200, response.text
    assert client.chat(model="tiny-coffee", messages=HI, options=GREEDY).message.content == before
