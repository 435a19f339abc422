"""Anthropic's Messages API (`/v1/messages`, `/v1/messages/count_tokens`) through `gemmaforge serve` on real HTTP,
driven by the official `anthropic` client: a tiny real Gemma 3 answers text whole and streamed alike; scripted
answers (tests/scripted_engine.py) stand in for a Gemma 4 that thinks and calls tools, with the real tokenizers,
so the prompt each request renders is checked exactly. Refusals come back as the client's exception classes."""

from __future__ import annotations

import base64
import io
import json
from pathlib import Path
from typing import Any

import httpx
import pytest
from PIL import Image

from gemmaforge.chat.gemma4 import call_text
from gemmaforge.chat.tools import normalize_tool
from gemmaforge.families import FAMILIES
from gemmaforge.inference.jobs import Delta, Job
from gemmaforge.models import default_home
from gemmaforge.serve.registry import Registry
from gemmaforge.serve.server import ServeOptions, background_server, load_registry
from tests.helpers import reference_answer
from tests.scripted_engine import serve_scripted

pytestmark = pytest.mark.integration
anthropic = pytest.importorskip("anthropic")

GEMMA3, GEMMA4 = FAMILIES["gemma3"], FAMILIES["gemma4"]
HI = [{"role": "user", "content": "What is a flat white?"}]
ASK = [{"role": "user", "content": "A flat white to go, please."}]
ORDER = {"name": "order_coffee", "description": "Order a coffee for pickup",
         "input_schema": {"type": "object", "required": ["drink"], "properties": {
             "drink": {"type": "string", "description": "What to brew"},
             "shots": {"type": "integer", "description": "Espresso shots"}}}}
CALL = {"name": "order_coffee", "arguments": {"drink": "flat white", "shots": 2}}
THOUGHT = "They asked for a flat white; two shots is standard."
THINK = {"type": "enabled", "budget_tokens": 1024}
GREEDY = {"temperature": 0}  # sent as extra_body: this client release no longer lists the sampling fields


@pytest.fixture(scope="module")
def tiny(tiny_gemma3_dir: Path):
    """A real tiny Gemma 3 (random weights, real tokenizer) served as `base`."""
    registry = load_registry([f"base={tiny_gemma3_dir}"], ServeOptions(dtype="fp32"), default_home())
    with background_server(registry, ServeOptions()) as url:
        yield anthropic.Anthropic(base_url=url, api_key="unused", max_retries=0), registry
    registry.close()


@pytest.fixture(scope="module")
def scripted(gemma4_tokenizer, gemma3_tokenizer, tmp_path_factory: pytest.TempPathFactory):
    """Scripted Gemma 4 (`g4`: thinks, calls tools) and Gemma 3 (`g3`: neither) answers, and a second server on
    the same models that asks for an API key."""
    registry = Registry(default_home())
    source = tmp_path_factory.mktemp("scripted")
    engines = {"g4": serve_scripted(registry, "g4", gemma4_tokenizer, GEMMA4, source),
               "g3": serve_scripted(registry, "g3", gemma3_tokenizer, GEMMA3, source)}
    with background_server(registry, ServeOptions()) as url, \
            background_server(registry, ServeOptions(api_key="s3cret")) as keyed:
        yield anthropic.Anthropic(base_url=url, api_key="unused", max_retries=0), engines, url, keyed
    registry.close()


def internal(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """`messages` after the system message that carries the offered tool, as the templates take them."""
    tool = normalize_tool({"name": ORDER["name"], "description": ORDER["description"],
                           "parameters": ORDER["input_schema"]}, "t")
    return [{"role": "system", "content": "", "tools": [tool]}, *messages]


def blocks(content: list[Any]) -> list[dict[str, Any]]:
    """Content blocks as data (the stream's accumulator adds parsed_output to its text blocks)."""
    return [{k: v for k, v in block.model_dump().items() if k != "parsed_output"} for block in content]


def events_of(stream: Any) -> list[str]:
    """A raw event stream's types (deltas by their own type, block starts with the block's), runs of one kind
    counted once."""
    kinds: list[str] = []
    for event in stream:
        kind = event.type
        if kind == "content_block_delta":
            kind = event.delta.type
        elif kind == "content_block_start":
            kind = f"start {event.content_block.type} {event.index}"
        elif kind == "content_block_stop":
            kind = f"stop {event.index}"
        if not kinds or kinds[-1] != kind:
            kinds.append(kind)
    return kinds


# ---------------------------------------------------------------------------- a real tiny model


def test_text_whole_and_streamed_is_the_greedy_answer(tiny) -> None:
    """A whole answer is Anthropic's message with transformers' own greedy answer as its one text block, and the
    streamed answer (text_stream, and the accumulated final message) is the same text, counts and stop reason; the
    stream's message_start already counts the prompt's tokens, as Anthropic's does."""
    client, registry = tiny
    whole = client.messages.create(model="base", max_tokens=12, messages=HI, extra_body=GREEDY)
    assert whole.type == "message" and whole.role == "assistant" and whole.id.startswith("msg_")
    assert whole.model == "base" and [block.type for block in whole.content] == ["text"]
    assert whole.content[0].text == reference_answer(registry, "base:latest", HI, 12)
    assert whole.stop_reason in ("end_turn", "max_tokens") and whole.stop_sequence is None
    assert whole.usage.input_tokens > 5 and 0 < whole.usage.output_tokens <= 12
    with client.messages.stream(model="base", max_tokens=12, messages=HI, extra_body=GREEDY) as stream:
        streamed = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert streamed == whole.content[0].text and blocks(final.content) == blocks(whole.content)
    assert (final.stop_reason, final.usage.input_tokens, final.usage.output_tokens) == (
        whole.stop_reason, whole.usage.input_tokens, whole.usage.output_tokens)
    events = list(client.messages.create(model="base", max_tokens=12, messages=HI, extra_body=GREEDY, stream=True))
    assert events[0].type == "message_start" and events[0].message.usage.input_tokens == whole.usage.input_tokens


def test_max_tokens_cuts_the_answer(tiny) -> None:
    """max_tokens bounds the answer: three tokens, stop_reason max_tokens."""
    cut = tiny[0].messages.create(model="base", max_tokens=3, messages=HI, extra_body=GREEDY)
    assert cut.stop_reason == "max_tokens" and cut.usage.output_tokens == 3 and cut.stop_sequence is None


def test_an_image_for_a_text_only_model_is_a_400(tiny) -> None:
    """A base64 image reaches the model, which has no vision: a 400 in Anthropic's shape that says why (from
    /v1/messages and from count_tokens alike)."""
    picture = io.BytesIO()
    Image.new("RGB", (40, 30), (200, 30, 30)).save(picture, format="PNG")
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                         "data": base64.b64encode(picture.getvalue()).decode()}}
    messages = [{"role": "user", "content": [image, {"type": "text", "text": "Which colour?"}]}]
    with pytest.raises(anthropic.BadRequestError, match="images: base:latest: .*no vision tower") as refused:
        tiny[0].messages.create(model="base", max_tokens=8, messages=messages)
    assert refused.value.body["type"] == "error" and refused.value.body["error"]["type"] == "invalid_request_error"
    with pytest.raises(anthropic.BadRequestError, match="no vision tower"):
        tiny[0].messages.count_tokens(model="base", messages=messages)


# ---------------------------------------------------------------------------- scripted answers, exact prompts


def test_system_reaches_the_prompt_and_count_tokens_counts_it(scripted) -> None:
    """The top-level system (a string, or text blocks joined) is the system text of the rendered prompt;
    count_tokens gives the prompt's token count, the input_tokens of the answer."""
    client, engines = scripted[:2]
    engines["g3"].scripts += ["A flat white.", "A flat white."]
    blocks = [{"type": "text", "text": "You are a barista. "}, {"type": "text", "text": "Be brief."}]
    first = client.messages.create(model="g3", max_tokens=8, system="You are a barista. Be brief.", messages=HI)
    prompt = engines["g3"].prompts[-1]
    assert prompt == GEMMA3.chat.render([{"role": "system", "content": "You are a barista. Be brief."}, *HI],
                                        True).text
    second = client.messages.create(model="g3", max_tokens=8, system=blocks, messages=HI)
    assert engines["g3"].prompts[-1] == prompt and first.content[0].text == second.content[0].text == "A flat white."
    counted = client.messages.count_tokens(model="g3", system=blocks, messages=HI)
    assert counted.input_tokens == first.usage.input_tokens == len(engines["g3"].encode(prompt))


def test_tools_come_back_as_tool_use_and_results_reach_the_prompt(scripted) -> None:
    """Gemma 4 thinks and calls the offered tool: a thinking block (signed), a tool_use block (toolu_ id, input as
    an object) and stop_reason tool_use; sent back with a tool_result, the history renders as the official
    template renders it, the result folded into the model's turn; an is_error result says so."""
    client, engines = scripted[:2]
    engine = engines["g4"]
    engine.scripts += [f"<|channel>thought\n{THOUGHT}\n<channel|>{call_text(CALL)}<|tool_response>",
                       "The order went through.<channel|>Ordered: a flat white, two shots.", "Sorry, no oat milk."]
    first = client.messages.create(model="g4", max_tokens=64, messages=ASK, tools=[ORDER], thinking=THINK)
    assert engine.prompts[-1] == GEMMA4.chat.render(internal(ASK), True, think=True).text
    thinking, call = first.content
    assert first.stop_reason == "tool_use" and thinking.type == "thinking" and thinking.thinking == THOUGHT
    assert thinking.signature and call.type == "tool_use" and call.id.startswith("toolu_")
    assert (call.name, call.input) == (CALL["name"], CALL["arguments"])

    result = {"type": "tool_result", "tool_use_id": call.id, "content": "order #12 ready at 9:05"}
    history = [*ASK, first.to_param(), {"role": "user", "content": [result]}]
    second = client.messages.create(model="g4", max_tokens=64, messages=history, tools=[ORDER], thinking=THINK)
    expected = internal([*ASK, {"role": "assistant", "content": "", "thinking": THOUGHT,
                                "tool_calls": [{**CALL, "id": call.id}]},
                         {"role": "tool", "name": "order_coffee", "tool_call_id": call.id,
                          "content": "order #12 ready at 9:05"}])
    assert engine.prompts[-1] == GEMMA4.chat.render(expected, True, think=True).text
    assert engine.prompts[-1].endswith('response:order_coffee{value:<|"|>order #12 ready at 9:05<|"|>}'
                                       "<tool_response|><|channel>thought\n")
    assert [(b.type, getattr(b, "thinking", None) or getattr(b, "text", None)) for b in second.content] == [
        ("thinking", "The order went through."), ("text", "Ordered: a flat white, two shots.")]
    assert second.stop_reason == "end_turn"

    failed = {**result, "content": [{"type": "text", "text": "out of oat milk"}], "is_error": True}
    client.messages.create(model="g4", max_tokens=64, messages=[*ASK, first.to_param(),
                                                                {"role": "user", "content": [failed]}])
    assert '{value:<|"|>Error: out of oat milk<|"|>}' in engine.prompts[-1]


def test_a_streamed_answer_has_anthropics_events_in_order(scripted) -> None:
    """Streamed, the thinking, text and tool call are blocks 0, 1, 2 in Anthropic's event order (thinking_delta
    then signature_delta, the call's input as one input_json_delta, message_delta then message_stop), and the
    client's accumulator builds from them the message a whole answer gives."""
    client, engines = scripted[:2]
    script = f"<|channel>thought\n{THOUGHT}\n<channel|>Ordering now.{call_text(CALL)}<|tool_response>"
    engines["g4"].scripts += [script] * 3
    asked = {"model": "g4", "max_tokens": 64, "messages": ASK, "tools": [ORDER], "thinking": THINK}
    assert events_of(client.messages.create(**asked, stream=True)) == [
        "message_start", "start thinking 0", "thinking_delta", "signature_delta", "stop 0",
        "start text 1", "text_delta", "stop 1", "start tool_use 2", "input_json_delta", "stop 2",
        "message_delta", "message_stop"]
    with client.messages.stream(**asked) as stream:
        final = stream.get_final_message()
    whole = client.messages.create(**asked)
    assert [block.type for block in final.content] == ["thinking", "text", "tool_use"]
    assert blocks(final.content[:2]) == blocks(whole.content[:2]) and final.content[1].text == "Ordering now."
    assert final.content[2].input == whole.content[2].input == CALL["arguments"]
    assert final.stop_reason == whole.stop_reason == "tool_use"
    assert final.usage.input_tokens == whole.usage.input_tokens > 0


def test_stop_sequences_end_the_answer_and_are_named(scripted) -> None:
    """A stop sequence ends the answer before it, with stop_reason stop_sequence and the sequence that matched,
    whole and streamed; an answer that runs to the end of its turn is end_turn."""
    client, engines = scripted[:2]
    engines["g3"].scripts += ["One flat white. Anything else? No.", "One flat white. Anything else? No.",
                              "One flat white."]
    asked = {"model": "g3", "max_tokens": 32, "messages": HI, "stop_sequences": ["Nothing", "else?"]}
    whole = client.messages.create(**asked)
    assert whole.content[0].text == "One flat white. Anything "  # all that came before the sequence
    assert (whole.stop_reason, whole.stop_sequence) == ("stop_sequence", "else?")
    with client.messages.stream(**asked) as stream:
        final = stream.get_final_message()
    assert blocks(final.content) == blocks(whole.content)
    assert (final.stop_reason, final.stop_sequence) == ("stop_sequence", "else?")
    assert client.messages.create(**asked).stop_reason == "end_turn"


def test_an_engine_failure_mid_stream_is_an_error_event(scripted, monkeypatch: pytest.MonkeyPatch) -> None:
    """A generation that fails after the stream started ends it with Anthropic's error event, which the client
    raises with the message."""
    client, engines = scripted[:2]

    def fail(job: Job) -> None:
        job.emit(Delta("One flat"))
        job.fail("generation failed: the engine broke")

    monkeypatch.setattr(engines["g3"], "submit", fail)
    with pytest.raises(anthropic.APIStatusError, match="the engine broke") as failed:
        with client.messages.stream(model="g3", max_tokens=8, messages=HI) as stream:
            stream.get_final_message()
    assert failed.value.body["error"]["type"] == "api_error"


def test_thinking_on_a_model_that_does_not_think_is_a_400(scripted) -> None:
    """Gemma 3 has no thought channel: thinking enabled is refused naming the field; disabled is a plain answer."""
    client, engines = scripted[:2]
    with pytest.raises(anthropic.BadRequestError, match="thinking: g3:latest does not support thinking"):
        client.messages.create(model="g3", max_tokens=8, messages=HI, thinking=THINK)
    engines["g3"].scripts.append("A flat white.")
    plain = client.messages.create(model="g3", max_tokens=8, messages=HI, thinking={"type": "disabled"})
    assert [block.type for block in plain.content] == ["text"]


@pytest.mark.parametrize("body, error, pattern", [
    ({"messages": HI}, "BadRequestError", "max_tokens: required"),
    ({"messages": HI, "max_tokens": "many"}, "BadRequestError", "max_tokens: expected number, got string"),
    ({"messages": HI, "max_tokens": 0}, "BadRequestError", "max_tokens: must be at least 1"),
    ({"messages": [{"role": "user", "content": 42}], "max_tokens": 8}, "BadRequestError",
     r"messages\[0\]\.content: expected a string or an array of content blocks"),
    ({"messages": [{"role": "user", "content": [{"type": "document", "source": {}}]}], "max_tokens": 8},
     "BadRequestError", r"messages\[0\]\.content\[0\]\.type: 'document' blocks are not supported"),
    ({"messages": [{"role": "system", "content": "Be brief."}, *HI], "max_tokens": 8}, "BadRequestError",
     r"messages\[0\]\.role: 'system' is not supported.*top-level system"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {
        "type": "url", "url": "https://example.com/a.png"}}]}], "max_tokens": 8}, "BadRequestError",
     r"messages\[0\]\.content\[0\]\.source: remote URLs are not fetched"),
    ({"messages": HI, "max_tokens": 8, "tools": [ORDER], "tool_choice": {"type": "any"}}, "BadRequestError",
     "tool_choice: only .* cannot force a call"),
    ({"messages": HI, "max_tokens": 8, "tools": [{"type": "web_search_20250305", "name": "web_search"}]},
     "BadRequestError", r"tools\[0\]\.type: 'web_search_20250305' is a server tool"),
    ({"messages": HI, "max_tokens": 8, "system": [{"type": "image"}]}, "BadRequestError",
     r"system\[0\]\.type: 'image' blocks are not supported"),
    ({"messages": HI, "max_tokens": 8, "model": "nope"}, "NotFoundError", "model 'nope' not found"),
])
def test_refusals_are_the_clients_exceptions_naming_the_field(scripted, body: dict, error: str,
                                                              pattern: str) -> None:
    """Each malformed request is the anthropic client's exception for its status, in Anthropic's error shape,
    its message naming the field."""
    client = scripted[0]
    with pytest.raises(getattr(anthropic, error), match=pattern) as refused:
        client.post("/v1/messages", body={"model": "g4", **body}, cast_to=anthropic.types.Message)
    kind = "not_found_error" if error == "NotFoundError" else "invalid_request_error"
    body = refused.value.body
    assert set(body) == {"type", "error"} and body["type"] == "error" and body["error"]["type"] == kind


def test_malformed_json_and_the_api_key_answer_in_anthropics_shape(scripted) -> None:
    """Errors raised before any dialect reads the body (malformed JSON, the API key guard) have Anthropic's shape
    on /v1/messages paths; the key is taken as Authorization: Bearer or as x-api-key."""
    url, keyed = scripted[2:]
    broken = httpx.post(url + "/v1/messages", content=b"{not json", headers={"content-type": "application/json"})
    assert broken.status_code == 400 and broken.json()["type"] == "error"
    assert broken.json()["error"]["type"] == "invalid_request_error"
    assert broken.json()["error"]["message"].startswith("invalid JSON")
    with pytest.raises(anthropic.AuthenticationError, match="missing or wrong API key") as refused:
        anthropic.Anthropic(base_url=keyed, api_key="wrong", max_retries=0).messages.count_tokens(
            model="g3", messages=HI)
    assert refused.value.body["error"]["type"] == "authentication_error"
    body = json.dumps({"model": "g3", "messages": HI}).encode()
    for headers in ({"x-api-key": "s3cret"}, {"authorization": "Bearer s3cret"}):
        counted = httpx.post(keyed + "/v1/messages/count_tokens", content=body, headers=headers)
        assert counted.status_code == 200 and counted.json()["input_tokens"] > 0
