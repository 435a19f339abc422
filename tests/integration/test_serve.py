"""`gemmaforge serve` on real HTTP (loopback), driven by the official `ollama` and `openai` Python clients:
a tiny run's adapter and its base share one transformers engine; the base's GGUF runs through llama.cpp."""

from __future__ import annotations

import json
import shutil
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from gemmaforge.cli import build_parser, main
from gemmaforge.cli.serve import serve_options
from gemmaforge.export.gguf import write_gguf
from gemmaforge.models import default_home
from gemmaforge.serve.server import ServeOptions, background_server, load_registry
from tests.helpers import reference_answer, write_config

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


def test_ollama_errors(client) -> None:
    with pytest.raises(ollama.ResponseError) as e:
        client.chat(model="nope", messages=HI)
    assert e.value.status_code == 404 and e.value.error == "model 'nope' not found"
    with pytest.raises(ollama.ResponseError) as e:
        client.chat(model="base", messages=[{"role": "robot", "content": "hi"}])
    assert e.value.status_code == 400 and "'robot' is not supported" in e.value.error
    with pytest.raises(ollama.ResponseError) as e:
        client.chat(model="base", messages=[{"role": "user", "content": "a"}, {"role": "user", "content": "b"}])
    assert e.value.status_code == 400 and "roles must alternate" in e.value.error
    with pytest.raises(ollama.ResponseError) as e:
        client.generate(model="base", prompt="hi", format="json")
    assert e.value.status_code == 400 and "JSON mode" in e.value.error
    assert client.generate(model="base", prompt="").done_reason == "load"


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
    ("/api/generate", b'{"model": "no-such-model", "prompt": "x"}', 404, "model 'no-such-model' not found"),
    ("/v1/chat/completions", b"{oops", 400, "invalid JSON"),
    ("/v1/chat/completions", b'{"model": "base", "messages": [{"role": "tool", "content": "x"}]}', 400,
     "'tool' is not supported"),
    ("/v1/completions", b'{"model": "base", "prompt": ["a"]}', 400, "prompt: expected a string"),
    ("/api/nothing", b"{}", 404, "is not a route"),
    ("/v1/nothing", b"{}", 404, "is not a route"),
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
    huge = b'{"model": "base", "prompt": "' + b"x" * (5 * 2**20) + b'"}'
    assert httpx.post(server[0] + "/api/generate", content=huge).status_code == 413
    pieces = iter([huge[i:i + 2**20] for i in range(0, len(huge), 2**20)])  # no Content-Length: chunked encoding
    response = httpx.post(server[0] + "/api/generate", content=pieces)
    assert response.status_code == 413 and "request body larger than 4194304 bytes" in response.json()["error"]
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
    assert server[1].get("base").engine.running() == 0


def test_a_client_that_disconnects_stops_its_generation(server, monkeypatch: pytest.MonkeyPatch) -> None:
    engine = server[1].get("base").engine
    # no stop tokens: the random model must not end its answer by itself (greedy decoding of it can pick a stop
    # token within a few steps), only the disconnect may end it
    monkeypatch.setattr(engine, "stops", set())
    body = {"model": "base", "messages": HI, "options": {"num_predict": 4000, "temperature": 0}}
    with httpx.stream("POST", server[0] + "/api/chat", json=body, timeout=30) as response:
        assert json.loads(next(response.iter_lines()))["done"] is False
        assert engine.running() == 1
    deadline = time.monotonic() + 10
    while engine.running() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert engine.running() == 0


def test_adapters_load_and_unload_at_runtime(server, run_dir: Path, client) -> None:
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
    assert httpx.post(url + "/v1/unload_lora_adapter", json={"lora_name": "again"}).status_code == 200
    with pytest.raises(ollama.ResponseError) as e:
        client.chat(model="again", messages=HI)
    assert e.value.status_code == 404
    assert client.chat(model="tiny-coffee", messages=HI, options=GREEDY).message.content == again


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
            assert 0 < reply["eval_count"] < 3000 and registry.get("tiny").engine.running() == 0
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
