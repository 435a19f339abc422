"""Tools and thinking through `gemmaforge serve` on real HTTP with the official `ollama` and `openai` clients:
the prompt each request renders (the official Gemma 4 template; LLaMA-Factory's format for Gemma 1-3), and the
answer read back into thinking, content and tool calls, streamed and whole. The answers are scripted
(tests/scripted_engine.py): a tiny random model does not call tools; the tokenizers are the real ones."""

from __future__ import annotations

import json
import re

import httpx
import pytest

from gemmaforge.chat.gemma import default_calls
from gemmaforge.chat.gemma4 import call_text
from gemmaforge.chat.tools import normalize_tool
from gemmaforge.families import FAMILIES
from gemmaforge.models import default_home
from gemmaforge.serve.registry import Registry
from gemmaforge.serve.server import ServeOptions, background_server
from tests.scripted_engine import serve_scripted

pytestmark = pytest.mark.integration
ollama = pytest.importorskip("ollama")
openai = pytest.importorskip("openai")

GEMMA3, GEMMA4 = FAMILIES["gemma3"], FAMILIES["gemma4"]
ORDER = {"type": "function", "function": {
    "name": "order_coffee", "description": "Order a coffee for pickup",
    "parameters": {"type": "object", "required": ["drink"], "properties": {
        "drink": {"type": "string", "description": "What to brew"},
        "shots": {"type": "integer", "description": "Espresso shots"}}}}}
CALL = {"name": "order_coffee", "arguments": {"drink": "flat white", "shots": 2}}
THOUGHT = "They asked for a flat white; two shots is standard."
ASK = [{"role": "user", "content": "A flat white to go, please."}]


@pytest.fixture(scope="module")
def served(gemma4_tokenizer, gemma3_tokenizer, tmp_path_factory: pytest.TempPathFactory):
    registry = Registry(default_home())
    source = tmp_path_factory.mktemp("scripted")
    engines = {"g4": serve_scripted(registry, "g4", gemma4_tokenizer, GEMMA4, source),
               "g3": serve_scripted(registry, "g3", gemma3_tokenizer, GEMMA3, source, trained_with_tools=True),
               "plain": serve_scripted(registry, "plain", gemma3_tokenizer, GEMMA3, source)}
    with background_server(registry, ServeOptions()) as url:
        yield url, engines
    registry.close()


@pytest.fixture(scope="module")
def client(served) -> ollama.Client:
    return ollama.Client(host=served[0])


@pytest.fixture(scope="module")
def oai(served) -> openai.OpenAI:
    return openai.OpenAI(base_url=served[0] + "/v1", api_key="unused", max_retries=0)


def internal(messages: list[dict]) -> list[dict]:
    return [{"role": "system", "content": "", "tools": [normalize_tool(ORDER, "t")]}, *messages]


def test_ollama_gemma4_thinks_calls_a_tool_and_reads_its_result(client, served) -> None:
    engine = served[1]["g4"]
    engine.scripts += [f"<|channel>thought\n{THOUGHT}\n<channel|>{call_text(CALL)}<|tool_response>",
                       "The order went through.<channel|>Ordered: a flat white, two shots."]
    first = client.chat(model="g4", messages=ASK, tools=[ORDER], think=True)
    assert engine.prompts[-1] == GEMMA4.chat.render(internal(ASK), True, think=True).text
    assert first.message.thinking == THOUGHT and first.message.content == ""
    (call,) = first.message.tool_calls
    assert call.function.name == "order_coffee" and dict(call.function.arguments) == CALL["arguments"]

    history = [*ASK, {"role": "assistant", "content": "", "thinking": THOUGHT,
                      "tool_calls": [{"function": {"name": call.function.name, "arguments": call.function.arguments}}]},
               {"role": "tool", "tool_name": "order_coffee", "content": "order #12 ready at 9:05"}]
    second = client.chat(model="g4", messages=history, tools=[ORDER], think=True)
    expected = internal([*ASK, {"role": "assistant", "content": "", "thinking": THOUGHT, "tool_calls": [CALL]},
                         {"role": "tool", "name": "order_coffee", "content": "order #12 ready at 9:05"}])
    prompt = GEMMA4.chat.render(expected, True, think=True).text
    assert engine.prompts[-1] == prompt  # the model goes on inside its turn, after the tool's answer
    assert prompt.endswith('<|tool_response>response:order_coffee{value:<|"|>order #12 ready at 9:05<|"|>}'
                           "<tool_response|><|channel>thought\n")
    # the prompt opened the thought channel: the model thinks on, then answers
    assert second.message.thinking == "The order went through." and not second.message.tool_calls
    assert second.message.content == "Ordered: a flat white, two shots."


def test_ollama_streams_thinking_apart_from_the_answer(client, served) -> None:
    served[1]["g4"].scripts.append(f"<|channel>thought\n{THOUGHT}\n<channel|>Coming right up.")
    chunks = list(client.chat(model="g4", messages=ASK, think=True, stream=True))
    thinking = "".join(c.message.thinking or "" for c in chunks)
    content = "".join(c.message.content for c in chunks)
    assert thinking == THOUGHT and content == "Coming right up." and chunks[-1].done
    first_content = next(i for i, c in enumerate(chunks) if c.message.content)
    assert all(not c.message.content for c in chunks[:first_content])  # the thought came first, apart
    assert not any("<|" in (c.message.content + (c.message.thinking or "")) for c in chunks)


def test_openai_gemma4_reasoning_content_and_tool_calls(oai, served) -> None:
    engine = served[1]["g4"]
    engine.scripts.append(f"<|channel>thought\n{THOUGHT}\n<channel|>{call_text(CALL)}<|tool_response>")
    answer = oai.chat.completions.create(model="g4", messages=ASK, tools=[ORDER], reasoning_effort="low")
    choice = answer.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.model_extra["reasoning_content"] == THOUGHT
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name == "order_coffee" and json.loads(call.function.arguments) == CALL["arguments"]
    assert engine.prompts[-1] == GEMMA4.chat.render(internal(ASK), True, think=True).text

    engine.scripts.append(f"<|channel>thought\n{THOUGHT}\n<channel|>{call_text(CALL)}<|tool_response>")
    chunks = list(oai.chat.completions.create(model="g4", messages=ASK, tools=[ORDER], reasoning_effort="low",
                                              stream=True))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert "".join(d.model_extra.get("reasoning_content") or "" for d in deltas) == THOUGHT
    streamed = [tc for d in deltas for tc in d.tool_calls or ()]
    assert [(tc.index, tc.function.name, json.loads(tc.function.arguments)) for tc in streamed] == [
        (0, "order_coffee", CALL["arguments"])]
    assert chunks[-1].choices[0].finish_reason == "tool_calls"

    engine.scripts.append("Done: ready at 9:05.")
    function = {"name": "order_coffee", "arguments": call.function.arguments}
    result = [*ASK, {"role": "assistant", "content": None, "tool_calls": [
        {"id": call.id, "type": "function", "function": function}]},
        {"role": "tool", "tool_call_id": call.id, "content": "ready at 9:05"}]
    final = oai.chat.completions.create(model="g4", messages=result, tools=[ORDER])
    assert final.choices[0].message.content == "Done: ready at 9:05." and final.choices[0].finish_reason == "stop"
    assert engine.prompts[-1].endswith('<tool_call|><|tool_response>response:order_coffee{value:<|"|>ready at 9:05'
                                       '<|"|>}<tool_response|>')


def test_gemma3_calls_tools_in_llamafactorys_format(client, oai, served) -> None:
    engine = served[1]["g3"]
    engine.scripts.append(default_calls([CALL]))
    answer = client.chat(model="g3", messages=ASK, tools=[ORDER])
    assert engine.prompts[-1] == GEMMA3.chat.render(internal(ASK), True).text
    assert "You have access to the following tools:\n> Tool Name: order_coffee" in engine.prompts[-1]
    (call,) = answer.message.tool_calls
    assert call.function.name == "order_coffee" and dict(call.function.arguments) == CALL["arguments"]
    assert answer.message.content == ""
    engine.scripts.append("Your flat white is ready.")
    history = [*ASK, {"role": "assistant", "content": "", "tool_calls": [{"function": CALL}]},
               {"role": "tool", "content": "ready"}]
    assert client.chat(model="g3", messages=history, tools=[ORDER]).message.content == "Your flat white is ready."
    assert engine.prompts[-1].endswith("<start_of_turn>tool\nready<end_of_turn>\n<start_of_turn>model\n")
    engine.scripts.append("Action: a word, not a call")  # no tools offered: text as written
    assert oai.chat.completions.create(model="g3", messages=ASK).choices[0].message.content == (
        "Action: a word, not a call")


@pytest.mark.parametrize("request_body, pattern", [
    ({"model": "g3", "messages": ASK, "think": True}, "g3:latest does not support thinking .the gemma3 chat format"),
    ({"model": "plain", "messages": ASK, "tools": [ORDER]}, "plain:latest does not support tools .the official gemma3"),
    ({"model": "g4", "messages": ASK, "think": "deep"}, "think: 'deep' is not supported"),
    ({"model": "g4", "messages": ASK, "tools": [{"type": "function"}]}, r"tools\[0\]: expected a tool definition"),
    ({"model": "g4", "messages": [*ASK, {"role": "assistant", "content": "", "tool_calls": [
        {"function": {"name": "x", "arguments": "{"}}]}]}, r"messages\[1\]\.tool_calls\[0\]: arguments are not JSON"),
    ({"model": "g4", "prompt": "hi", "tools": [ORDER]}, "tools: /api/generate takes no tools"),
])
def test_ollama_refusals_name_the_field(served, request_body: dict, pattern: str) -> None:
    route = "/api/generate" if "prompt" in request_body else "/api/chat"
    response = httpx.post(served[0] + route, json=request_body)
    assert response.status_code == 400 and re.search(pattern, response.json()["error"]), response.text


def test_show_lists_what_each_model_can_do(client) -> None:
    assert client.show("g4").capabilities == ["completion", "tools", "thinking"]
    assert client.show("g3").capabilities == ["completion", "tools"]  # trained on tool calls
    assert client.show("plain").capabilities == ["completion"]


def test_openai_refusals_name_the_field(oai) -> None:
    with pytest.raises(openai.BadRequestError, match="tool_choice: only"):
        oai.chat.completions.create(model="g4", messages=ASK, tools=[ORDER], tool_choice="required")
    with pytest.raises(openai.BadRequestError, match="does not support thinking"):
        oai.chat.completions.create(model="g3", messages=ASK, reasoning_effort="high")
