"""OpenAI's Responses API (POST /v1/responses) through `gemmaforge serve` on real HTTP with the official `openai`
client: text in and out on a real tiny model (whole, streamed, cut by max_output_tokens, held to a JSON schema),
and Gemma 4's thinking and function calls on a scripted engine (tests/scripted_engine.py: the answers are written
by the test, the tokenizer and the answer reading are the real ones), with the prompt each request rendered; the
response objects and events are checked against the client's own types, and refusals name the field."""

from __future__ import annotations

import base64
import io
import json
from typing import Any, Literal

import httpx
import pydantic
import pytest
from PIL import Image

from gemmaforge.chat.gemma4 import call_text
from gemmaforge.chat.tools import normalize_tool
from gemmaforge.families import FAMILIES
from gemmaforge.inference.jobs import Delta
from gemmaforge.models import default_home
from gemmaforge.serve.server import ServeOptions, background_server, load_registry
from tests.scripted_engine import serve_scripted

pytestmark = pytest.mark.integration
openai = pytest.importorskip("openai")
from openai.types.responses import Response, ResponseStreamEvent  # noqa: E402

GEMMA4 = FAMILIES["gemma4"]
ORDER = {"type": "function", "name": "order_coffee", "description": "Order a coffee for pickup",
         "parameters": {"type": "object", "required": ["drink"], "properties": {
             "drink": {"type": "string", "description": "What to brew"},
             "shots": {"type": "integer", "description": "Espresso shots"}}}}
CALL = {"name": "order_coffee", "arguments": {"drink": "flat white", "shots": 2}}
THOUGHT = "They asked for a flat white; two shots is standard."
ASK = "A flat white to go, please."
QUESTION = "Tell me about coffee"
EVENTS = pydantic.TypeAdapter(ResponseStreamEvent)


class Order(pydantic.BaseModel):
    drink: Literal["latte", "flat white", "espresso"]
    iced: bool


@pytest.fixture(scope="module")
def served(tiny_gemma3_dir, gemma4_tokenizer, tmp_path_factory: pytest.TempPathFactory):
    """One server: the real tiny Gemma 3 as `base` (fp32: greedy answers are the same streamed or whole) and a
    scripted Gemma 4 as `g4`."""
    registry = load_registry([f"base={tiny_gemma3_dir}"], ServeOptions(dtype="fp32"), default_home())
    g4 = serve_scripted(registry, "g4", gemma4_tokenizer, GEMMA4, tmp_path_factory.mktemp("scripted"))
    with background_server(registry, ServeOptions()) as url:
        yield url, g4
    registry.close()


@pytest.fixture(scope="module")
def oai(served) -> openai.OpenAI:
    return openai.OpenAI(base_url=served[0] + "/v1", api_key="unused", max_retries=0)


def raw_events(url: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    """A streamed answer's events as sent, each checked: its `event:` line names its data's type, its data is one
    of the client's event types (validated, not merely constructed), the sequence numbers count up from 0."""
    with httpx.stream("POST", url + "/v1/responses", json={**body, "stream": True}, timeout=60) as response:
        assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
        text = response.read().decode()
    events = []
    for block in text.strip().split("\n\n"):
        lines = dict(line.split(": ", 1) for line in block.split("\n"))
        data = json.loads(lines["data"])
        assert lines["event"] == data["type"] and data["sequence_number"] == len(events)
        EVENTS.validate_python(data)
        events.append(data)
    return events


def kinds(events: list[Any]) -> list[str]:
    """Event types in order, a run of one type counted once (deltas)."""
    types = [e["type"] if isinstance(e, dict) else e.type for e in events]
    return [t for i, t in enumerate(types) if i == 0 or t != types[i - 1]]


def system_with_tools(messages: list[dict]) -> list[dict]:
    return [{"role": "system", "content": "", "tools": [normalize_tool(ORDER, "t")]}, *messages]


def test_text_whole_and_streamed_on_a_real_model(oai, served) -> None:
    """A string input on the real tiny model: the whole response is a valid `Response` (the client's type,
    validated) with one message; streamed at temperature 0 its deltas add up to the whole greedy answer and its
    events come in the API's order, ending as the whole one ends; cut by max_output_tokens it is incomplete."""
    body = {"model": "base", "input": QUESTION, "temperature": 0, "max_output_tokens": 3}
    raw = httpx.post(served[0] + "/v1/responses", json=body, timeout=60).json()
    whole = Response.model_validate(raw)
    assert whole.id.startswith("resp_") and whole.object == "response" and whole.model == "base"
    assert whole.status == "incomplete" and whole.incomplete_details.reason == "max_output_tokens"
    (message,) = whole.output
    assert message.type == "message" and message.role == "assistant" and message.status == "incomplete"
    assert message.content[0].annotations == [] and whole.output_text == message.content[0].text != ""
    assert whole.usage.output_tokens == 3 and whole.usage.input_tokens > 5
    assert whole.usage.total_tokens == whole.usage.input_tokens + 3 and whole.temperature == 0

    events = raw_events(served[0], body)
    assert kinds(events) == ["response.created", "response.in_progress", "response.output_item.added",
                             "response.content_part.added", "response.output_text.delta", "response.output_text.done",
                             "response.content_part.done", "response.output_item.done", "response.incomplete"]
    assert "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta") == whole.output_text
    final = events[-1]["response"]
    assert final["output"][0]["content"][0]["text"] == whole.output_text and final["usage"]["output_tokens"] == 3
    assert final["incomplete_details"] == {"reason": "max_output_tokens"}

    longer = oai.responses.create(model="base", input=QUESTION, temperature=0, max_output_tokens=12)
    streamed = list(oai.responses.create(model="base", input=QUESTION, temperature=0, max_output_tokens=12,
                                         stream=True))
    assert longer.output_text.startswith(whole.output_text) and len(longer.output_text) > len(whole.output_text)
    text = "".join(e.delta for e in streamed if e.type == "response.output_text.delta")
    assert text == longer.output_text and streamed[-1].response.output_text == text


def test_log_probabilities_whole_and_streamed(oai, served) -> None:
    """include ["message.output_text.logprobs"] with top_logprobs: the output_text part lists each answer token's
    log-probability (its texts make the text) with the likeliest tokens, the greedy one first; streamed, each delta
    carries its own tokens' and the done event all of them, the same as the whole answer's. Without the include,
    none."""
    body = {"model": "base", "input": QUESTION, "temperature": 0, "max_output_tokens": 6,
            "include": ["message.output_text.logprobs"], "top_logprobs": 2}
    whole = Response.model_validate(httpx.post(served[0] + "/v1/responses", json=body, timeout=60).json())
    part = whole.output[0].content[0]
    assert len(part.logprobs) == 6 and "".join(x.token for x in part.logprobs) == part.text
    assert all(len(x.top_logprobs) == 2 and x.top_logprobs[0].token == x.token for x in part.logprobs)
    events = raw_events(served[0], body)
    deltas = [x for e in events if e["type"] == "response.output_text.delta" for x in e["logprobs"]]
    done = next(e for e in events if e["type"] == "response.output_text.done")
    assert [x["logprob"] for x in deltas] == [x["logprob"] for x in done["logprobs"]] \
        == pytest.approx([x.logprob for x in part.logprobs], abs=1e-6)
    plain = oai.responses.create(model="base", input=QUESTION, temperature=0, max_output_tokens=6)
    assert plain.output[0].content[0].logprobs == [] and plain.output_text == part.text


def test_instructions_and_developer_messages_are_the_system_prompt(oai, served) -> None:
    """`instructions` reach the prompt as its system turn, as a developer message in a list input does (input_text
    parts joined); the scripted answer comes back as the message's output_text, status completed."""
    engine = served[1]
    engine.scripts += ["Coffee's on.", "Coffee's on."]
    answer = oai.responses.create(model="g4", instructions="You are a barista.", input=ASK)
    expected = GEMMA4.chat.render([{"role": "system", "content": "You are a barista."},
                                   {"role": "user", "content": ASK}], True).text
    assert engine.prompts[-1] == expected
    assert answer.output_text == "Coffee's on." and answer.status == "completed" and answer.incomplete_details is None
    assert answer.instructions == "You are a barista." and answer.output[0].status == "completed"
    items = [{"role": "developer", "content": "You are a barista."},
             {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "A flat white"},
                                                             {"type": "input_text", "text": " to go, please."}]}]
    oai.responses.create(model="g4", input=items)
    assert engine.prompts[-1] == expected


def test_reasoning_on_gemma4_whole_and_streamed(oai, served) -> None:
    """reasoning.effort opens Gemma 4's thinking: the thought comes back as a reasoning item whose summary is the
    thought, before the message; streamed, its summary events come first and the client's stream accumulator
    (`responses.stream(...).get_final_response()`) rebuilds the same output."""
    engine = served[1]
    script = f"<|channel>thought\n{THOUGHT}\n<channel|>Coming right up."
    engine.scripts += [script, script]
    reasoning = {"effort": "low", "summary": "auto"}
    whole = oai.responses.create(model="g4", input=ASK, reasoning=reasoning)
    assert engine.prompts[-1] == GEMMA4.chat.render([{"role": "user", "content": ASK}], True, think=True).text
    thought, message = whole.output
    assert thought.type == "reasoning" and thought.id.startswith("rs_") and thought.summary[0].text == THOUGHT
    assert message.type == "message" and whole.output_text == "Coming right up."
    assert whole.reasoning.effort == "low" and whole.reasoning.summary == "auto"

    with oai.responses.stream(model="g4", input=ASK, reasoning=reasoning) as stream:
        events = list(stream)
        final = stream.get_final_response()
    assert kinds(events) == [
        "response.created", "response.in_progress", "response.output_item.added",
        "response.reasoning_summary_part.added", "response.reasoning_summary_text.delta",
        "response.reasoning_summary_text.done", "response.reasoning_summary_part.done", "response.output_item.done",
        "response.output_item.added", "response.content_part.added", "response.output_text.delta",
        "response.output_text.done", "response.content_part.done", "response.output_item.done", "response.completed"]
    assert "".join(e.delta for e in events if e.type == "response.reasoning_summary_text.delta") == THOUGHT
    assert [o.type for o in final.output] == ["reasoning", "message"] and final.output[0].summary[0].text == THOUGHT
    assert final.output_text == "Coming right up." and final.status == "completed"
    assert [e.sequence_number for e in events] == list(range(len(events)))


def test_function_calls_and_their_outputs_in_a_follow_up_turn(oai, served) -> None:
    """Flat function tools reach the prompt as Gemma 4 declares them; a call comes back as a function_call item
    (arguments as JSON text, a call_id), streamed as function_call_arguments events; passing the output items back
    with a function_call_output renders the thought, the call and the tool's result into the next prompt."""
    engine = served[1]
    script = f"<|channel>thought\n{THOUGHT}\n<channel|>{call_text(CALL)}<|tool_response>"
    engine.scripts += [script, script]
    first = oai.responses.create(model="g4", input=ASK, tools=[ORDER], reasoning={"effort": "low"})
    assert engine.prompts[-1] == GEMMA4.chat.render(system_with_tools([{"role": "user", "content": ASK}]), True,
                                                    think=True).text
    thought, call = first.output
    assert thought.type == "reasoning" and call.type == "function_call" and call.status == "completed"
    assert call.name == "order_coffee" and json.loads(call.arguments) == CALL["arguments"]
    assert call.call_id.startswith("call_") and call.id.startswith("fc_") and first.tools[0].name == "order_coffee"

    events = raw_events(served[0], {"model": "g4", "input": ASK, "tools": [ORDER], "reasoning": {"effort": "low"}})
    assert kinds(events)[-6:] == ["response.output_item.done", "response.output_item.added",
                                  "response.function_call_arguments.delta", "response.function_call_arguments.done",
                                  "response.output_item.done", "response.completed"]
    done = events[-2]["item"]
    assert done["type"] == "function_call" and json.loads(done["arguments"]) == CALL["arguments"]

    engine.scripts.append("The order went through.<channel|>Ordered: a flat white, two shots.")
    history = [{"role": "user", "content": ASK}, *first.output,
               {"type": "function_call_output", "call_id": call.call_id, "output": "ready at 9:05"}]
    second = oai.responses.create(model="g4", input=history, tools=[ORDER], reasoning={"effort": "low"})
    expected = system_with_tools([
        {"role": "user", "content": ASK},
        {"role": "assistant", "content": "", "thinking": THOUGHT, "tool_calls": [{**CALL, "id": call.call_id}]},
        {"role": "tool", "name": "order_coffee", "tool_call_id": call.call_id, "content": "ready at 9:05"}])
    prompt = GEMMA4.chat.render(expected, True, think=True).text
    assert engine.prompts[-1] == prompt
    assert prompt.endswith('<|tool_response>response:order_coffee{value:<|"|>ready at 9:05<|"|>}<tool_response|>'
                           "<|channel>thought\n") and THOUGHT in prompt
    assert [o.type for o in second.output] == ["reasoning", "message"]
    assert second.output[0].summary[0].text == "The order went through."
    assert second.output_text == "Ordered: a flat white, two shots."


def test_tool_choice_none_offers_no_tools(oai, served) -> None:
    """tool_choice "none": the tools are echoed but not offered, so the prompt declares none."""
    engine = served[1]
    engine.scripts.append("Sure.")
    answer = oai.responses.create(model="g4", input=ASK, tools=[ORDER], tool_choice="none")
    assert engine.prompts[-1] == GEMMA4.chat.render([{"role": "user", "content": ASK}], True).text
    assert answer.output_text == "Sure." and answer.tool_choice == "none" and len(answer.tools) == 1


def test_json_schema_text_format_holds_the_real_model_to_the_schema(oai) -> None:
    """text.format json_schema (the client's `responses.parse` with a pydantic model) holds the real tiny model's
    greedy answer to the schema: it parses as the model; json_object makes it open a JSON object."""
    parsed = oai.responses.parse(model="base", input=QUESTION, text_format=Order, temperature=0,
                                 max_output_tokens=48)
    assert parsed.status == "completed" and isinstance(parsed.output_parsed, Order)
    assert json.loads(parsed.output_text) == parsed.output_parsed.model_dump()
    assert parsed.text.format.type == "json_schema"
    json_object = oai.responses.create(model="base", input=QUESTION, text={"format": {"type": "json_object"}},
                                       temperature=0, max_output_tokens=8)
    plain = oai.responses.create(model="base", input=QUESTION, temperature=0, max_output_tokens=8)
    assert json_object.output_text.startswith("{") and not plain.output_text.startswith("{")


def test_an_engine_failure_mid_stream_ends_in_error_and_response_failed(oai, served,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """An engine that fails after sending text: the stream ends with an `error` event and response.failed, whose
    response holds the error and the text sent so far in an incomplete message."""
    engine = served[1]

    def fail_after_text(job: Any, script: str) -> None:
        for token in engine.encode(script):  # each token's text on its own, then the failure
            job.emit(Delta(engine._decode([token])))
        job.fail("the device fell over")

    monkeypatch.setattr(engine, "_run", fail_after_text)
    engine.scripts.append("Coming right")
    events = list(oai.responses.create(model="g4", input=ASK, stream=True))
    assert kinds(events)[-3:] == ["response.output_text.delta", "error", "response.failed"]
    assert events[-2].code == "server_error" and events[-2].message == "the device fell over"
    failed = events[-1].response
    assert failed.status == "failed" and failed.error.code == "server_error"
    assert failed.output[0].status == "incomplete" and failed.output[0].content[0].text == "Coming right"


def png_data_uri() -> str:
    out = io.BytesIO()
    Image.new("RGB", (8, 8), (200, 30, 30)).save(out, format="PNG")
    return "data:image/png;base64," + base64.b64encode(out.getvalue()).decode()


def test_an_image_for_a_model_without_vision_is_refused_in_openais_shape(oai) -> None:
    """An input_image (a data URI) for the text-only tiny model: a 400 in OpenAI's error shape that says why."""
    image = {"type": "input_image", "image_url": png_data_uri(), "detail": "auto"}
    with pytest.raises(openai.BadRequestError) as e:
        oai.responses.create(model="base", input=[{"role": "user", "content": [
            {"type": "input_text", "text": "Which colour?"}, image]}])
    assert e.value.status_code == 400 and e.value.body["type"] == "invalid_request_error"
    assert "images: base:latest" in e.value.body["message"] and "no vision tower" in e.value.body["message"]


def test_previous_response_id_is_refused(oai) -> None:
    """Nothing is stored: naming an earlier response is a 400 that says so."""
    with pytest.raises(openai.BadRequestError, match="previous_response_id: responses are not stored"):
        oai.responses.create(model="g4", input=ASK, previous_response_id="resp_123")


USER = {"role": "user", "content": "hi"}


@pytest.mark.parametrize(("body", "message"), [
    ({"input": 5}, "input: expected string or array, got number"),
    ({"input": 5, "stream": True}, "input: expected string or array, got number"),  # before the stream starts
    ({"input": ""}, "input: required, a non-empty string or array of input items"),
    ({"input": []}, "input: required, a non-empty string or array of input items"),
    ({}, "input: required"),
    ({"input": ["hi"]}, "input[0]: expected an input item"),
    ({"input": [{"type": "web_search_call", "id": "ws_1"}]}, "input[0].type: 'web_search_call' is not supported"),
    ({"input": [{"content": "hi"}]}, "input[0].type: required; expected message, function_call"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input[0]: item references are not supported"),
    ({"input": [{"role": "robot", "content": "hi"}]}, "input[0].role: 'robot' is not supported"),
    ({"input": [{"role": "user", "content": 7}]}, "input[0].content: expected a string or an array of content parts"),
    ({"input": [{"role": "user", "content": [{"type": "input_audio"}]}]},
     "input[0].content[0]: expected an input_text, input_image or output_text part"),
    ({"input": [{"role": "user", "content": [{"type": "input_text", "text": 3}]}]},
     "input[0].content[0].text: expected string, got number"),
    ({"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]},
     "input[0].content[0]: file inputs are not supported"),
    ({"input": [USER, {"role": "user", "content": [{"type": "input_image", "image_url": "https://x.org/a.png"}]}]},
     "input[1].content[0].image_url: remote URLs are not fetched by this server"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "data:image/png;base64,aGk="}]}]},
     "input[0].content[0].image_url: not a picture PIL can read"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "cat.png"}]}]},
     "input[0].content[0].image_url: expected a data URI"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "file_id": "file_1"}]}]},
     "input[0].content[0].image_url: file_id: files are not stored by this server"),
    ({"input": [USER, {"role": "assistant", "content": [{"type": "input_image", "image_url": png_data_uri()}]}]},
     "input[1].content: assistant messages carry no images"),
    ({"input": [USER, {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{"}]},
     "input[1]: arguments are not JSON"),
    ({"input": [USER, {"type": "function_call", "call_id": "c", "arguments": "{}"}]}, "input[1].name: required"),
    ({"input": [USER, {"type": "function_call_output", "call_id": "c"}]},
     "input[1].output: expected a string or an array of content parts"),
    ({"input": [USER, {"type": "reasoning", "summary": ["thought"]}]}, "input[1].summary: expected an array of"),
    ({"input": [{"role": "developer", "content": "Be brief."}]}, "input: there is no user or assistant message"),
    ({"input": "hi", "instructions": ["be brief"]}, "instructions: expected string, got array"),
    ({"input": "hi", "tools": [{"type": "web_search"}]}, "tools[0].type: 'web_search' tools are not supported"),
    ({"input": "hi", "tools": [{"type": "function", "parameters": {}}]}, "tools[0]: the function's name is missing"),
    ({"input": "hi", "tools": [ORDER], "tool_choice": "required"}, "tool_choice: only \"auto\" and \"none\""),
    ({"input": "hi", "text": {"format": {"type": "xml"}}}, "text.format.type: 'xml' is not supported"),
    ({"input": "hi", "text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format.schema: required"),
    ({"input": "hi", "text": {"format": "json"}}, "text.format: expected object, got string"),
    ({"input": "hi", "reasoning": {"effort": "deep"}}, "reasoning.effort: 'deep' is not supported"),
    ({"input": "hi", "reasoning": {"summary": "long"}}, "reasoning.summary: 'long' is not supported"),
    ({"input": "hi", "max_output_tokens": 0}, "max_output_tokens: must be at least 1"),
    ({"input": "hi", "max_output_tokens": "many"}, "max_output_tokens: expected number, got string"),
    ({"input": "hi", "temperature": "hot"}, "temperature: expected number, got string"),
    ({"input": "hi", "stream": "yes"}, "stream: expected boolean, got string"),
    ({"input": "hi", "background": True}, "background: background responses are not supported"),
    ({"input": "hi", "conversation": "conv_1"}, "conversation: responses are not stored"),
    ({"input": "hi", "top_logprobs": 21, "include": ["message.output_text.logprobs"]},
     "top_logprobs: 21 is out of range [0, 20]"),
    ({"input": "hi", "include": ["message.output_text.logprobs"], "reasoning": {"effort": "low"}},
     "include: message.output_text.logprobs is not supported together with reasoning"),
    ({"input": "hi", "truncation": "middle"}, "truncation: 'middle' is not supported"),
    ({"model": "base", "input": "hi", "reasoning": {"effort": "low"}}, "base:latest does not support thinking"),
    ({"model": "base", "input": "hi", "tools": [ORDER]}, "tools: base:latest does not support tools"),
])
def test_bad_requests_are_refused_naming_the_field(served, body: dict, message: str) -> None:
    """Each malformed or unsupported request: a 400 in OpenAI's error shape whose message names the field."""
    response = httpx.post(served[0] + "/v1/responses", json={"model": "g4", **body}, timeout=60)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and set(error) == {"message", "type", "param", "code"}
    assert message in error["message"], error["message"]
