"""The Ollama and OpenAI dialects as plain functions: a request body parsed into a Completion, events rendered back,
with no engine and no server (the live-server tests in tests/integration/test_serve*.py check the same routes with
the official clients). The cases follow what Ollama's own `openai/openai_test.go` checks of its OpenAI layer: the
conversion of messages, images, tools, options and response formats, the chunks of a stream, and the errors."""

from __future__ import annotations

import asyncio
import base64
import io
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import pytest
from PIL import Image

from gemmaforge.chat.gemma4 import THOUGHT_CLOSE, THOUGHT_OPEN, call_text
from gemmaforge.families import FAMILIES, Family
from gemmaforge.inference.jobs import Delta, Event, Failed, Finished
from gemmaforge.serve.ollama_api import OllamaDialect
from gemmaforge.serve.openai_api import OpenAIDialect
from gemmaforge.serve.protocol import ApiError, Completion, Limits, LoadOnly, sampling_params

OLLAMA, OPENAI = OllamaDialect(), OpenAIDialect()
END = Finished("stop", prompt_tokens=12, completion_tokens=3, prompt_ns=1_000, eval_ns=2_000)


@dataclass
class Model:
    """A served model as the dialects see it (protocol.ServedModel)."""

    family: Family = FAMILIES["gemma3"]
    name: str = "coffee:latest"
    system: str | None = None
    options: dict[str, Any] = field(default_factory=dict)
    tools: bool = False


GEMMA3, GEMMA4 = Model(), Model(FAMILIES["gemma4"], tools=True)


def png_base64(size: int = 4) -> str:
    out = io.BytesIO()
    Image.new("RGB", (size, size), (200, 40, 40)).save(out, format="PNG")
    return base64.b64encode(out.getvalue()).decode()


def parsed(dialect: OllamaDialect | OpenAIDialect, body: dict[str, Any], model: Model = GEMMA3,
           chat: bool = True) -> Completion:
    completion = dialect.parse({"model": model.name, **body}, model, chat)
    assert isinstance(completion, Completion)
    return completion


def refused(dialect: OllamaDialect | OpenAIDialect, body: dict[str, Any], model: Model = GEMMA3,
            chat: bool = True) -> str:
    with pytest.raises(ApiError) as e:
        dialect.parse({"model": model.name, **body}, model, chat)
    assert e.value.status == 400
    return e.value.message


def streamed(dialect: OllamaDialect | OpenAIDialect, c: Completion, events: list[Event]) -> list[bytes]:
    async def source() -> AsyncIterator[Event]:
        for event in events:
            yield event

    async def drain() -> list[bytes]:
        return [chunk async for chunk in dialect.stream(c, source())]

    return asyncio.run(drain())


def sse_objects(chunks: list[bytes]) -> list[Any]:
    text = b"".join(chunks).decode()
    assert text.endswith("data: [DONE]\n\n")
    return [json.loads(part.removeprefix("data: ")) for part in text.split("\n\n")[:-2]]


# ---------------------------------------------------------------------------- requests


def test_openai_chat_renders_the_training_template_and_takes_developer_as_system() -> None:
    messages = [{"role": "developer", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    c = parsed(OPENAI, {"messages": messages})
    expected = GEMMA3.family.chat.request_prompt([{"role": "system", "content": "Be brief."},
                                                 {"role": "user", "content": "Hi"}])
    assert c.prompt == expected and c.chat and not c.stream and not c.tools


def test_the_served_system_prompt_is_used_unless_the_request_sends_one() -> None:
    model = Model(system="You are a barista.")
    asked = parsed(OLLAMA, {"messages": [{"role": "user", "content": "Hi"}]}, model)
    own = parsed(OLLAMA, {"messages": [{"role": "system", "content": "Terse."}, {"role": "user", "content": "Hi"}]},
                 model)
    assert "You are a barista." in asked.prompt
    assert "Terse." in own.prompt and "barista" not in own.prompt


def test_openai_options_default_as_ollamas_openai_layer_sets_them() -> None:
    c = parsed(OPENAI, {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 7, "seed": 3,
                        "stop": "END"}, Model(options={"temperature": 0.2, "top_k": 5}))
    assert c.options["temperature"] == 1.0 and c.options["top_p"] == 1.0  # OpenAI's defaults, not the Modelfile's
    assert c.options["top_k"] == 5  # the Modelfile's, where OpenAI has no field
    assert c.options["num_predict"] == 7 and c.options["seed"] == 3 and c.stop == ("END",)
    newer = parsed(OPENAI, {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 7,
                            "max_completion_tokens": 9})
    assert newer.options["num_predict"] == 9


def test_usage_in_a_stream_only_when_asked_and_streaming() -> None:
    body = {"messages": [{"role": "user", "content": "Hi"}], "stream_options": {"include_usage": True}}
    assert parsed(OPENAI, {**body, "stream": True}).include_usage
    assert not parsed(OPENAI, body).include_usage


@pytest.mark.parametrize(("response_format", "grammar"), [
    ({"type": "text"}, None),
    ({"type": "json_object"}, "json"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}}, '{"type": "object"}'),
])
def test_openai_response_formats(response_format: dict[str, Any], grammar: str | None) -> None:
    c = parsed(OPENAI, {"messages": [{"role": "user", "content": "Hi"}], "response_format": response_format})
    assert c.grammar == grammar


def test_ollama_format_takes_json_or_a_schema() -> None:
    body = {"messages": [{"role": "user", "content": "Hi"}]}
    assert parsed(OLLAMA, {**body, "format": "json"}).grammar == "json"
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    assert json.loads(parsed(OLLAMA, {**body, "format": schema}).grammar or "") == schema
    assert parsed(OLLAMA, body).grammar is None


def test_an_image_part_becomes_a_placeholder_in_its_place_and_a_decoded_picture() -> None:
    url = f"data:image/png;base64,{png_base64()}"
    content = [{"type": "text", "text": "What is "}, {"type": "image_url", "image_url": {"url": url}},
               {"type": "text", "text": " this?"}]
    c = parsed(OPENAI, {"messages": [{"role": "user", "content": content}]})
    image = GEMMA3.family.chat.image
    assert f"What is {image} this?" in c.prompt
    assert len(c.images) == 1 and c.images[0].size == (4, 4)


def test_ollama_images_go_before_the_text_as_ollama_places_them() -> None:
    c = parsed(OLLAMA, {"messages": [{"role": "user", "content": "Describe.", "images": [png_base64()] * 2}]})
    assert GEMMA3.family.chat.image * 2 + "Describe." in c.prompt and len(c.images) == 2


def test_tools_ride_on_the_system_turn_and_tool_choice_none_drops_them() -> None:
    tool = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                             "parameters": {"type": "object", "properties": {
                                                 "city": {"type": "string"}}, "required": ["city"]}}}
    body = {"messages": [{"role": "user", "content": "Weather in Paris?"}], "tools": [tool]}
    offered = parsed(OPENAI, body, GEMMA4)
    assert offered.tools and "get_weather" in offered.prompt
    assert offered.prompt.index("get_weather") < offered.prompt.index("Weather in Paris?")
    dropped = parsed(OPENAI, {**body, "tool_choice": "none"}, GEMMA4)
    assert not dropped.tools and "get_weather" not in dropped.prompt


def test_ollama_think_levels_open_gemma4s_thought_channel() -> None:
    body = {"messages": [{"role": "user", "content": "Hi"}]}
    assert "<|think|>" not in parsed(OLLAMA, body, GEMMA4).prompt
    for think in (True, "high", "low"):
        assert "<|think|>" in parsed(OLLAMA, {**body, "think": think}, GEMMA4).prompt
    assert "<|think|>" in parsed(OPENAI, {**body, "reasoning_effort": "medium"}, GEMMA4).prompt
    assert "<|think|>" not in parsed(OPENAI, {**body, "reasoning_effort": "none"}, GEMMA4).prompt


def test_ollama_options_over_the_modelfile_over_ollamas_defaults() -> None:
    model = Model(options={"temperature": 0.3, "top_k": 7})
    c = parsed(OLLAMA, {"messages": [{"role": "user", "content": "Hi"}], "options": {"top_k": 2, "num_predict": 5}},
               model)
    assert c.options["temperature"] == 0.3 and c.options["top_k"] == 2 and c.options["num_predict"] == 5
    assert c.options["top_p"] == 0.9 and c.options["repeat_last_n"] == 64  # Ollama's own


def test_ollama_empty_messages_or_prompt_loads_the_model() -> None:
    for body, chat in (({"messages": []}, True), ({"prompt": ""}, False)):
        answer = OLLAMA.parse({"model": "m", **body}, GEMMA3, chat)
        assert isinstance(answer, LoadOnly) and answer.answer["done_reason"] == "load"


def test_raw_generate_continues_the_text_as_sent() -> None:
    c = parsed(OLLAMA, {"prompt": "Once upon", "raw": True}, chat=False)
    assert c.prompt == "<bos>Once upon" and c.reading is None


@pytest.mark.parametrize(("dialect", "body", "model", "words"), [
    (OPENAI, {"messages": [{"role": "wizard", "content": "x"}]}, GEMMA3, "messages[0].role"),
    (OPENAI, {"messages": "hello"}, GEMMA3, "messages: expected array"),
    (OPENAI, {"messages": []}, GEMMA3, "at least one message"),
    (OPENAI, {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {
        "url": "https://example.com/cat.png"}}]}]}, GEMMA3, "remote URLs are not fetched"),
    (OPENAI, {"messages": [{"role": "system", "content": "x"}]}, GEMMA3, "no user or assistant message"),
    (OPENAI, {"messages": [{"role": "user", "content": "x"}], "tool_choice": "required"}, GEMMA4, "tool_choice"),
    (OPENAI, {"messages": [{"role": "user", "content": "x"}], "n": 2}, GEMMA3, "n: only one choice"),
    (OPENAI, {"messages": [{"role": "user", "content": "x"}], "presence_penalty": 0.5}, GEMMA3, "presence_penalty"),
    (OPENAI, {"messages": [{"role": "user", "content": "x"}], "temperature": "hot"}, GEMMA3,
     "temperature: expected number, got string"),
    (OPENAI, {"messages": [{"role": "user", "content": "x"}], "reasoning_effort": "maximal"}, GEMMA4,
     "reasoning_effort"),
    (OPENAI, {"messages": [{"role": "user", "content": "x"}], "reasoning_effort": "high"}, GEMMA3,
     "does not support thinking"),
    (OPENAI, {"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "xml"}}, GEMMA3,
     "response_format.type"),
    (OLLAMA, {"messages": [{"role": "user", "content": "x"}], "think": "max"}, GEMMA4, "think: 'max'"),
    (OLLAMA, {"messages": [{"role": "user", "content": "x"}], "options": {"mirostat": 2}}, GEMMA3,
     "options.mirostat"),
    (OLLAMA, {"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function", "function": {
        "name": "f"}}]}, GEMMA3, "does not support tools"),
    (OLLAMA, {"messages": [{"role": "assistant", "content": "x", "images": [png_base64()]}]}, GEMMA3,
     "assistant messages carry no images"),
    (OLLAMA, {"messages": [{"role": "user", "content": "x", "images": ["not base64!"]}]}, GEMMA3,
     "messages[0].images[0]"),
])
def test_bad_requests_are_refused_naming_the_field(dialect: OllamaDialect | OpenAIDialect, body: dict[str, Any],
                                                   model: Model, words: str) -> None:
    assert words in refused(dialect, body, model)


def test_generate_refusals() -> None:
    assert "raw mode" in refused(OLLAMA, {"prompt": "x", "raw": True, "system": "s"}, chat=False)
    assert "/api/generate takes no tools" in refused(OLLAMA, {"prompt": "x", "tools": [{}]}, chat=False)
    assert "suffix" in refused(OLLAMA, {"prompt": "x", "suffix": "y"}, chat=False)
    assert "prompt: expected a string" in refused(OPENAI, {"prompt": ["a", "b"]}, chat=False)


def test_sampling_params_bound_the_answer_by_the_context_and_the_servers_cap() -> None:
    c = parsed(OLLAMA, {"messages": [{"role": "user", "content": "Hi"}], "options": {"num_predict": 500}})
    assert sampling_params(c, Limits(max_tokens=100), n_prompt=10, num_ctx=2048).max_tokens == 100
    assert sampling_params(c, Limits(max_tokens=4096), n_prompt=2000, num_ctx=2048).max_tokens == 48
    with pytest.raises(ApiError, match="does not fit the context window of 2048"):
        sampling_params(c, Limits(max_tokens=100), n_prompt=2048, num_ctx=2048)
    hot = parsed(OLLAMA, {"messages": [{"role": "user", "content": "Hi"}], "options": {"top_p": 0}})
    with pytest.raises(ApiError, match=r"top_p: 0.0 is out of range \(0, 1\]"):
        sampling_params(hot, Limits(max_tokens=100), n_prompt=10, num_ctx=2048)


# ---------------------------------------------------------------------------- answers


def test_openai_whole_answer_with_usage_and_finish_reason() -> None:
    c = parsed(OPENAI, {"messages": [{"role": "user", "content": "Hi"}]})
    answer = OPENAI.whole(c, "Hello there.", END)
    assert answer["object"] == "chat.completion" and answer["id"].startswith("chatcmpl-")
    assert answer["choices"] == [{"index": 0, "message": {"role": "assistant", "content": "Hello there."},
                                  "logprobs": None, "finish_reason": "stop"}]
    assert answer["usage"] == {"prompt_tokens": 12, "completion_tokens": 3, "total_tokens": 15}
    cut = OPENAI.whole(c, "Hel", Finished("length", 12, 3, 0, 0))
    assert cut["choices"][0]["finish_reason"] == "length"


def test_openai_text_completion_shape() -> None:
    c = parsed(OPENAI, {"prompt": "Once"}, chat=False)
    answer = OPENAI.whole(c, " upon a time", END)
    assert answer["object"] == "text_completion"
    assert answer["choices"] == [{"text": " upon a time", "index": 0, "logprobs": None, "finish_reason": "stop"}]


def test_a_generated_tool_call_is_answered_as_a_call_with_json_arguments() -> None:
    c = parsed(OPENAI, {"messages": [{"role": "user", "content": "Weather in Paris?"}], "tools": [
        {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]}, GEMMA4)
    text = call_text({"name": "get_weather", "arguments": {"city": "Paris"}})
    answer = OPENAI.whole(c, text, END)
    message = answer["choices"][0]["message"]
    assert answer["choices"][0]["finish_reason"] == "tool_calls" and message["content"] is None
    (call,) = message["tool_calls"]
    assert call["type"] == "function" and call["function"]["name"] == "get_weather"
    assert json.loads(call["function"]["arguments"]) == {"city": "Paris"}
    ollama = OLLAMA.whole(parsed(OLLAMA, {"messages": [{"role": "user", "content": "Weather in Paris?"}]}, GEMMA4),
                          text, END)
    assert ollama["message"]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"}  # an object in Ollama


def test_thinking_is_answered_apart_from_the_content() -> None:
    text = f"{THOUGHT_OPEN}Two and two.{THOUGHT_CLOSE}Four."
    c = parsed(OLLAMA, {"messages": [{"role": "user", "content": "2+2?"}], "think": True}, GEMMA4)
    message = OLLAMA.whole(c, text, END)["message"]
    assert message["thinking"] == "Two and two." and message["content"] == "Four."
    o = parsed(OPENAI, {"messages": [{"role": "user", "content": "2+2?"}], "reasoning_effort": "low"}, GEMMA4)
    choice = OPENAI.whole(o, text, END)["choices"][0]["message"]
    assert choice["reasoning_content"] == "Two and two." and choice["content"] == "Four."


def test_ollama_whole_answer_carries_the_counts_and_timings() -> None:
    c = parsed(OLLAMA, {"prompt": "Hi"}, chat=False)
    answer = OLLAMA.whole(c, "Hello.", END)
    assert answer["response"] == "Hello." and answer["done"] and answer["done_reason"] == "stop"
    assert (answer["prompt_eval_count"], answer["eval_count"], answer["eval_duration"]) == (12, 3, 2_000)
    assert answer["total_duration"] > 0 and answer["created_at"].endswith("Z")


def test_openai_stream_role_chunk_deltas_finish_usage_and_done() -> None:
    c = parsed(OPENAI, {"messages": [{"role": "user", "content": "Hi"}], "stream": True,
                        "stream_options": {"include_usage": True}})
    chunks = sse_objects(streamed(OPENAI, c, [Delta("Hel"), Delta("lo"), END]))
    assert [ch["object"] for ch in chunks] == ["chat.completion.chunk"] * 5
    assert len({ch["id"] for ch in chunks}) == 1  # one answer's chunks share its id
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert [ch["choices"][0]["delta"].get("content") for ch in chunks[1:3]] == ["Hel", "lo"]
    assert chunks[3]["choices"][0] == {"index": 0, "delta": {}, "finish_reason": "stop"}
    assert chunks[4]["choices"] == [] and chunks[4]["usage"]["total_tokens"] == 15


def test_a_streamed_failure_is_the_streams_last_message_in_each_apis_shape() -> None:
    c = parsed(OPENAI, {"messages": [{"role": "user", "content": "Hi"}], "stream": True})
    chunks = sse_objects(streamed(OPENAI, c, [Delta("Hel"), Failed("engine stopped")]))
    assert chunks[-1] == {"error": {"message": "engine stopped", "type": "api_error", "param": None, "code": None}}
    o = parsed(OLLAMA, {"messages": [{"role": "user", "content": "Hi"}]})
    lines = b"".join(streamed(OLLAMA, o, [Delta("Hel"), Failed("engine stopped")])).decode().splitlines()
    assert json.loads(lines[-1]) == {"error": "engine stopped"}


def test_ollama_stream_holds_back_a_possible_marker_and_ends_with_the_counts() -> None:
    c = parsed(OLLAMA, {"messages": [{"role": "user", "content": "2+2?"}], "think": True}, GEMMA4)
    pieces = [THOUGHT_OPEN[:4], THOUGHT_OPEN[4:] + "Two", " and two.", THOUGHT_CLOSE + "Four", "."]
    lines = [json.loads(line) for line in
             b"".join(streamed(OLLAMA, c, [*map(Delta, pieces), END])).decode().splitlines()]
    assert all("<|" not in json.dumps(line["message"]) for line in lines)  # no marker leaks, even split
    assert "".join(line["message"].get("thinking", "") for line in lines) == "Two and two."
    assert "".join(line["message"]["content"] for line in lines) == "Four."
    assert [line["done"] for line in lines][-1] and not any(line["done"] for line in lines[:-1])
    assert lines[-1]["eval_count"] == 3 and lines[-1]["done_reason"] == "stop"
