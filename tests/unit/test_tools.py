"""Tools, tool calls and thinking: rendered as the official Gemma 4 template renders them (Google's canonical
template, gemmaforge/chat_templates/gemma4.jinja, run by transformers' own jinja), as LLaMA-Factory's Gemma
templates render them for Gemma 1-3, supervised where the model writes, and read back from generated text."""

from __future__ import annotations

import copy
import json
from typing import Any

import pytest

from gemmaforge.chat.conversation import IGNORE_INDEX, check_roles
from gemmaforge.chat.gemma import default_calls, parse_default_calls
from gemmaforge.chat.gemma4 import call_text, parse_call
from gemmaforge.chat.reading import Pieces, read_whole
from gemmaforge.chat.tools import normalize_call, normalize_tool
from gemmaforge.errors import UserError
from gemmaforge.families import FAMILIES

GEMMA3, GEMMA4 = FAMILIES["gemma3"], FAMILIES["gemma4"]

WEATHER = normalize_tool({"type": "function", "function": {
    "name": "get_weather", "description": "Current weather of a city",
    "parameters": {"type": "object", "required": ["city"], "properties": {
        "city": {"type": "string", "description": "City name"},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
        "days": {"type": "array", "items": {"type": "integer"}, "description": "Forecast days"},
        "where": {"type": "object", "description": "Exact place", "properties": {
            "lat": {"type": "number"}, "lon": {"type": "number"}}, "required": ["lat"]},
        "note": {"type": ["string", "null"], "nullable": True}}}}}, "t")
BREW = normalize_tool({"name": "brew", "description": "Start the espresso machine",
                       "parameters": {"type": "object", "properties": {"shots": {"type": "integer"}}}}, "t")
CALL = {"name": "get_weather", "arguments": {"city": "杭州", "unit": "celsius", "days": [1, 2],
                                             "where": {"lat": 30.25, "lon": 120.2}, "note": None, "ok": True}}

CONVERSATIONS: dict[str, list[dict[str, Any]]] = {
    "one call": [
        {"role": "system", "content": "You are a barista.", "tools": [WEATHER, BREW]},
        {"role": "user", "content": "Iced or hot today in Hangzhou?"},
        {"role": "assistant", "content": "", "tool_calls": [CALL]},
        {"role": "tool", "content": '{"temp": 31, "sky": "sunny"}'},
        {"role": "assistant", "content": "31 °C and sunny: an iced latte."},
    ],
    "tools without a system prompt": [
        {"role": "system", "content": "", "tools": [BREW]},
        {"role": "user", "content": "Two shots please"},
        {"role": "assistant", "content": "", "tool_calls": [{"name": "brew", "arguments": {"shots": 2}}]},
        {"role": "tool", "content": "started"},
        {"role": "assistant", "content": "Your double is brewing."},
        {"role": "user", "content": "Thanks!"},
        {"role": "assistant", "content": "Enjoy."},
    ],
    "parallel calls with ids": [
        {"role": "system", "content": "", "tools": [WEATHER, BREW]},
        {"role": "user", "content": "Weather, and brew one"},
        {"role": "assistant", "content": "On it.", "tool_calls": [
            {"id": "c1", "name": "get_weather", "arguments": {"city": "Paris"}},
            {"id": "c2", "name": "brew", "arguments": {"shots": 1}}]},
        {"role": "tool", "tool_call_id": "c2", "content": "brewing"},
        {"role": "tool", "tool_call_id": "c1", "content": "rain"},
        {"role": "assistant", "content": "Rain in Paris; your shot is brewing."},
    ],
    "thinking": [
        {"role": "user", "content": "Is a cortado stronger than a latte?"},
        {"role": "assistant", "content": "Yes, less milk.", "thinking": "Cortado: 1:1 milk. Latte: much more."},
        {"role": "user", "content": "And a flat white?"},
        {"role": "assistant", "content": "Between the two.", "thinking": "Flat white: microfoam, double shot."},
    ],
    "schemas as clients write them": [  # a pydantic dict field, a boolean schema, a null description, a response
        {"role": "system", "content": "", "tools": [normalize_tool({"type": "function", "function": {
            "name": "log", "description": None, "response": {"description": "Saved", "type": "object"},
            "parameters": {"type": "object", "properties": {
                "counts": {"type": "object", "title": "Counts", "additionalProperties": {"type": "integer"}},
                "anything": True, "tags": {"type": "array", "items": {"type": ["string", None]}}}}}}, "t")]},
        {"role": "user", "content": "Log it"},
        {"role": "assistant", "content": "Logged."},
    ],
    "a call that waits for its result": [
        {"role": "system", "content": "", "tools": [BREW]},
        {"role": "user", "content": "Brew"},
        {"role": "assistant", "content": "", "tool_calls": [{"name": "brew", "arguments": {}}],
         "thinking": "The user wants coffee."},
    ],
}


def hf_messages(messages: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """Our messages in the shape chat templates take: tools apart, OpenAI's tool_calls, reasoning_content."""
    tools = messages[0].get("tools") if messages[0]["role"] == "system" else None
    out = []
    for m in messages:
        m = copy.deepcopy(m)
        m.pop("tools", None)
        if "tool_calls" in m:
            m["tool_calls"] = [{**({"id": c["id"]} if "id" in c else {}), "type": "function",
                                "function": {"name": c["name"], "arguments": c["arguments"]}} for c in m["tool_calls"]]
        if "thinking" in m:
            m["reasoning_content"] = m.pop("thinking")
        if m["role"] == "system" and not m["content"] and tools:
            continue  # the tools alone open the system turn
        out.append(m)
    return out, tools


@pytest.fixture(scope="module")
def tokenizer(gemma3_tokenizer):
    return gemma3_tokenizer


def official(tokenizer, family, messages, generation_prompt: bool, think: bool = False) -> str:
    hf, tools = hf_messages(messages)
    return tokenizer.apply_chat_template(hf, tools=tools, chat_template=family.chat.jinja(), tokenize=False,
                                         add_generation_prompt=generation_prompt, enable_thinking=think)


@pytest.mark.parametrize("name", list(CONVERSATIONS))
@pytest.mark.parametrize("think", [False, True])
def test_gemma4_renders_tools_and_thinking_as_the_official_template(tokenizer, name: str, think: bool) -> None:
    messages = CONVERSATIONS[name]
    for cut in range(2, len(messages) + 1):  # every prefix: with a generation prompt where one is asked for
        head = messages[:cut]
        ours = GEMMA4.chat.render(head, add_generation_prompt=True, think=think).text
        assert ours == official(tokenizer, GEMMA4, head, True, think), (name, cut)
        assert GEMMA4.chat.request_prompt(head, think=think) == ours  # what Ollama's gemma4 renderer sends
    assert GEMMA4.chat.render(messages).text == official(tokenizer, GEMMA4, messages, False)


def test_the_gemma4_template_is_the_canonical_one() -> None:
    text = GEMMA4.chat.jinja()
    assert "Google Gemma 4 Canonical Chat Template" in text and "Published: 2026-07-09" in text
    assert len(text) == 18568  # byte-exact copy (the copy in Ollama's renderer tests, gemma4_e2b)


def test_gemma4_golden_tool_rendering() -> None:
    text = GEMMA4.chat.render(CONVERSATIONS["one call"]).text
    q = '<|"|>'
    assert text.startswith(
        "<bos><|turn>system\nYou are a barista.<|tool>declaration:get_weather{description:" + q
        + "Current weather of a city" + q + ",parameters:{properties:{city:{description:" + q + "City name" + q
        + ",type:" + q + "STRING" + q + "},days:{description:" + q + "Forecast days" + q + ",items:{type:" + q
        + "INTEGER" + q + "},type:" + q + "ARRAY" + q + "},note:{nullable:true,type:" + q + "['STRING', 'NULL']"
        + q + "},unit:{enum:[" + q + "celsius" + q + "," + q + "fahrenheit" + q + "],type:" + q + "STRING" + q
        + "},where:{description:" + q + "Exact place" + q + ",properties:{lat:{type:" + q + "NUMBER" + q
        + "},lon:{type:" + q + "NUMBER" + q + "}},required:[" + q + "lat" + q + "],type:" + q + "OBJECT" + q
        + "}},required:[" + q + "city" + q + "],type:" + q + "OBJECT" + q + "}}<tool|>")
    assert text.endswith(
        "<|turn>user\nIced or hot today in Hangzhou?<turn|>\n<|turn>model\n<|tool_call>call:get_weather{city:" + q
        + "杭州" + q + ",days:[1,2],note:null,ok:true,unit:" + q + "celsius" + q + ",where:{lat:30.25,lon:120.2}}"
        "<tool_call|><|tool_response>response:get_weather{value:" + q + '{"temp": 31, "sky": "sunny"}' + q
        + "}<tool_response|>31 °C and sunny: an iced latte.<turn|>\n")


def supervised(tokenizer, messages, family, **options) -> str:
    ids, labels = family.chat.encode(messages, tokenizer, cutoff_len=4096, **options)
    return tokenizer.decode([i for i, label in zip(ids, labels, strict=True) if label != IGNORE_INDEX])


@pytest.mark.slow
def test_loss_covers_what_the_model_writes_never_the_tool_results(tokenizer, gemma4_tokenizer) -> None:
    g4 = supervised(gemma4_tokenizer, CONVERSATIONS["one call"], GEMMA4)
    assert g4 == (call_text(CALL) + "<|tool_response>" + "31 °C and sunny: an iced latte.<turn|>")
    waiting = supervised(gemma4_tokenizer, CONVERSATIONS["a call that waits for its result"], GEMMA4)
    assert waiting == ("<|channel>thought\nThe user wants coffee.\n<channel|><|tool_call>call:brew{}<tool_call|>"
                       "<|tool_response>")
    g3 = supervised(tokenizer, CONVERSATIONS["tools without a system prompt"], GEMMA3)
    assert g3 == ('Action: brew\nAction Input: {"shots": 2}<end_of_turn>Your double is brewing.<end_of_turn>'
                  "Enjoy.<end_of_turn>")
    last = supervised(gemma4_tokenizer, CONVERSATIONS["one call"], GEMMA4, mask_history=True)
    assert last == "31 °C and sunny: an iced latte.<turn|>"


# LLaMA-Factory's gemma/gemma2/gemma3 templates (src/llamafactory/data/template.py): format_user
# "<start_of_turn>user\n{{content}}<end_of_turn>\n<start_of_turn>model\n", format_assistant
# "{{content}}<end_of_turn>\n", format_system "{{content}}\n\n" (system + tool text, fused into the first user
# turn), format_observation "<start_of_turn>tool\n{{content}}<end_of_turn>\n<start_of_turn>model\n", the function
# formatter on the assistant slots with the "default" tool format; the expected text below is written out from
# those slots and DefaultToolUtils, for glaive_toolcall_en_demo's first record.
LLAMAFACTORY_TOOL_PROMPT = (
    "You have access to the following tools:\n> Tool Name: search_recipes\nTool Description: Search for recipes "
    "based on ingredients\nTool Args:\n  - ingredients (array, required): The ingredients to search for, where "
    "each item should be string\n\nUse the following format if using a tool:\n```\nAction: tool name (one of "
    "[search_recipes])\nAction Input: the input to the tool, in a JSON format representing the kwargs (e.g. "
    '```{"input": "hello world", "num_beams": 5}```)\n```\n')


def glaive_first(record: dict[str, Any]) -> list[dict[str, Any]]:
    from gemmaforge.data.formats import default_schema, schema_with, to_messages

    return to_messages(record, schema_with(default_schema("sharegpt"), {"tools": "tools"}, None, "t"), "t")


def test_gemma3_renders_llamafactory_tool_data_as_llamafactory_does(tokenizer, llamafactory_data) -> None:
    record = json.loads((llamafactory_data / "glaive_toolcall_en_demo.json").read_text(encoding="utf-8"))[0]
    turns = record["conversations"]
    expected = (
        "<bos><start_of_turn>user\n" + LLAMAFACTORY_TOOL_PROMPT + "\n\n" + turns[0]["value"] + "<end_of_turn>\n"
        "<start_of_turn>model\n" + turns[1]["value"] + "<end_of_turn>\n"
        "<start_of_turn>user\n" + turns[2]["value"] + "<end_of_turn>\n<start_of_turn>model\n"
        'Action: search_recipes\nAction Input: {"ingredients": ["chicken", "bell peppers", "rice"]}<end_of_turn>\n'
        "<start_of_turn>tool\n" + turns[4]["value"] + "<end_of_turn>\n<start_of_turn>model\n" + turns[5]["value"]
        + "<end_of_turn>\n<start_of_turn>user\n" + turns[6]["value"] + "<end_of_turn>\n<start_of_turn>model\n"
        + turns[7]["value"] + "<end_of_turn>\n")
    messages = glaive_first(record)
    assert GEMMA3.chat.render(messages).text == expected
    assert official(tokenizer, GEMMA3, messages, False) == expected  # the exported jinja renders it too
    for cut in range(2, len(messages)):
        head = messages[:cut]
        assert official(tokenizer, GEMMA3, head, True) == GEMMA3.chat.render(head, True).text


@pytest.mark.parametrize("name", ["one call", "tools without a system prompt", "parallel calls with ids"])
def test_gemma3_jinja_equals_the_training_text_for_tool_conversations(tokenizer, name: str) -> None:
    messages = CONVERSATIONS[name]
    assert official(tokenizer, GEMMA3, messages, False) == GEMMA3.chat.render(messages).text


def test_serve_prompt_for_gemma3_tools_is_the_training_prompt() -> None:
    messages = CONVERSATIONS["one call"]
    for cut in (2, 4):  # after the question, after the tool's result: the model turn opens as in training
        training = GEMMA3.chat.render(messages[:cut + 1]).text
        prompt = GEMMA3.chat.request_prompt(messages[:cut])
        assert training.startswith(prompt) and prompt.endswith("<start_of_turn>model\n")


def test_thinking_is_gemma4s_and_roles_around_tools_are_checked() -> None:
    with pytest.raises(UserError, match="d.jsonl line 2: a thinking .* Gemma 1-3 chat format has no thinking"):
        GEMMA3.chat.check_features(CONVERSATIONS["thinking"], "d.jsonl line 2")
    GEMMA4.chat.check_features(CONVERSATIONS["thinking"], "d.jsonl line 2")
    for messages, pattern in (
        ([{"role": "user", "content": "a"}, {"role": "tool", "content": "b"}],
         "turn 2 has role 'tool', expected 'assistant'"),
        ([{"role": "tool", "content": "a"}],
         "turn 1 has role 'tool', expected 'user' .tool results follow an assistant"),
        ([{"role": "user", "content": "a"}, {"role": "assistant", "content": "", "tool_calls": [CALL]},
          {"role": "user", "content": "c"}], "turn 3 has role 'user', expected 'tool'"),
    ):
        with pytest.raises(UserError, match=pattern):
            check_roles(messages, "d.jsonl line 1")
    with pytest.raises(UserError, match="the last turn is from the tool"):
        check_roles(CONVERSATIONS["one call"][:4], "d", require_answer=True)
    # LLaMA-Factory alternates user/observation with assistant/function_call: a result after a plain answer loads
    check_roles([{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
                 {"role": "tool", "content": "c"}, {"role": "assistant", "content": "d"}], "d", require_answer=True)


# ---------------------------------------------------------------------------- reading answers back


@pytest.mark.parametrize("call", [CALL, {"name": "brew", "arguments": {}},
                                  {"name": "say", "arguments": {"text": 'a "quoted", {braced}: text\nline',
                                                                "list": [{"k": "v"}, -1.5e-3, False]}}])
def test_calls_read_back_as_written(call: dict[str, Any]) -> None:
    text = call_text(call)
    assert parse_call(text.removeprefix("<|tool_call>").removesuffix("<tool_call|>")) == call
    assert parse_default_calls("Let me check.\n" + default_calls([call, call])) == ("Let me check.", [call, call])


def test_what_is_not_a_call_stays_text() -> None:
    assert parse_call("call:x{broken") is None and parse_call("hello") is None
    assert parse_default_calls("Action: x\nAction Input: not json") == ("Action: x\nAction Input: not json", [])
    assert parse_default_calls("plain answer") == ("plain answer", [])


def read(family, text: str, tools: bool, step: int) -> Pieces:
    reader, total = family.chat.reader(tools, prompt=""), Pieces()
    for piece in [text[i:i + step] for i in range(0, len(text), step)] or [""]:
        total += reader.feed(piece)
    return total + reader.finish()


@pytest.mark.parametrize("step", [1, 3, 1000])
def test_answers_split_into_thinking_content_and_calls_however_they_stream(step: int) -> None:
    g4 = ("<|channel>thought\nThey want it cold.\n<channel|>Checking the weather.\n"
          + call_text(CALL) + "<|tool_response>")
    assert read(GEMMA4, g4, True, step) == Pieces("Checking the weather.", "They want it cold.", [CALL])
    assert read(GEMMA4, "Just <b>text</b> < | with brackets", False, step) == Pieces(
        "Just <b>text</b> < | with brackets")
    g3 = "Sure.\n" + default_calls([CALL])
    assert read(GEMMA3, g3, True, step) == Pieces("Sure.\n", "", [CALL])
    assert read(GEMMA3, g3, False, step) == Pieces(g3)  # no tools offered: the text as written
    assert read(GEMMA3, "Action: nothing to call", True, step) == Pieces("Action: nothing to call")


def test_a_call_that_does_not_parse_is_shown_not_lost() -> None:
    assert read(GEMMA4, '<|tool_call>call:oops{a:<|"|>x<|"|>,b<tool_call|>', True, 2) == Pieces('call:oops{a:"x",b')


def test_thinking_opened_by_the_prompt_and_a_channel_name_split_across_pieces() -> None:
    prompt = GEMMA4.chat.request_prompt([*CONVERSATIONS["one call"][:-1]], think=True)
    assert prompt.endswith("<|channel>thought\n")  # thinking on, after a tool's result: the prompt opens a thought
    after_result = GEMMA4.chat.reader(True, prompt)
    assert read_whole(after_result, "The tool says sunny.<channel|>It is sunny.") == Pieces(
        "It is sunny.", "The tool says sunny.")
    reader, total = GEMMA4.chat.reader(False, prompt=""), Pieces()
    for piece in ("<|channel>thought\nI re", "thought", "\n", "so<channel|>Hi"):
        total += reader.feed(piece)
    assert total + reader.finish() == Pieces("Hi", "I rethought\nso")


def test_named_results_without_ids_keep_their_names() -> None:
    """The official ollama client sends parallel results with tool_name and no ids: each keeps its name, as in
    Ollama's Gemma 4 renderer."""
    messages = [{"role": "system", "content": "", "tools": [WEATHER, BREW]}, {"role": "user", "content": "both"},
                {"role": "assistant", "content": "", "tool_calls": [{"name": "get_weather", "arguments": {}},
                                                                     {"name": "brew", "arguments": {}}]},
                {"role": "tool", "name": "get_weather", "content": "sun"},
                {"role": "tool", "name": "brew", "content": "ok"}]
    prompt = GEMMA4.chat.request_prompt(messages)
    assert 'response:get_weather{value:<|"|>sun<|"|>}' in prompt and 'response:brew{value:<|"|>ok<|"|>}' in prompt


@pytest.mark.parametrize("value, pattern", [
    ({"type": "function"}, "expected a tool definition"),
    ({"name": ""}, "name is missing"),
    ({"name": "x", "parameters": "no"}, "parameters: must be a JSON schema object"),
    ({"name": "x", "parameters": {"properties": ["a"]}}, r"parameters.properties: expected an object"),
    ({"name": "x", "parameters": {"required": 5}}, r"parameters.required: expected a list"),
    ({"name": "x", "parameters": {"properties": {"a": {"enum": "b"}}}}, r"parameters.properties.a.enum: expected"),
    ({"name": "x", "parameters": {"properties": {"a": {"items": {"type": 5}}}}},
     r"parameters.properties.a.items.type: expected a type name"),
])
def test_bad_tools_are_named(value: Any, pattern: str) -> None:
    with pytest.raises(ValueError, match=f"tools\\[0\\]: .*{pattern}"):
        normalize_tool(value, "tools[0]")


def test_calls_take_every_shape_clients_send() -> None:
    assert normalize_call({"function": {"name": "f", "arguments": '{"a": 1}'}, "id": "c"}, "w") == {
        "name": "f", "arguments": {"a": 1}, "id": "c"}
    ollama_shape = {"function": {"name": "f", "arguments": {"a": 1}}}
    assert normalize_call(ollama_shape, "w") == {"name": "f", "arguments": {"a": 1}}
    with pytest.raises(ValueError, match="w: arguments are not JSON"):
        normalize_call({"name": "f", "arguments": "{"}, "w")
    with pytest.raises(ValueError, match="w: arguments must be a JSON object"):
        normalize_call({"name": "f", "arguments": [1]}, "w")


def test_the_gemma4_modelfile_names_ollamas_renderer_and_parser() -> None:
    from gemmaforge.config import RunConfig
    from gemmaforge.export.ollama import render_modelfile

    config = RunConfig(output_dir="r", data={"path": "d.jsonl"})
    g4 = render_modelfile("../gguf/model-q8_0.gguf", GEMMA4, config)
    assert "\nRENDERER gemma4-small\nPARSER gemma4\n" in g4 and "TEMPLATE" not in g4
    assert 'PARAMETER stop "<turn|>"\nPARAMETER stop "<|tool_response>"' in g4
    g3 = render_modelfile("../gguf/model-q8_0.gguf", GEMMA3, config)
    assert '\nTEMPLATE """' in g3 and "RENDERER" not in g3 and "tool" not in g3
    trained = render_modelfile("../gguf/model-q8_0.gguf", GEMMA3, config, trained_with_tools=True)
    assert "# Trained on tool calls in LLaMA-Factory's format, which an Ollama TEMPLATE cannot render" in trained


def test_the_transformers_engine_decodes_the_markers_and_skips_other_special_tokens(gemma4_tokenizer) -> None:
    from gemmaforge.inference.jobs import decode_with_markers, marker_ids

    text = '<|channel>thought\nIced.\n<channel|>Sure.<|tool_call>call:brew{drink:<|"|>latte<|"|>}<tool_call|>'
    ids = gemma4_tokenizer(text, add_special_tokens=False).input_ids
    markers = marker_ids(gemma4_tokenizer, GEMMA4)
    assert sorted(markers.values()) == sorted(GEMMA4.chat.markers) and all(i in ids for i in markers)
    pad = gemma4_tokenizer.pad_token_id
    decoded = decode_with_markers([*ids, pad], markers,
                                  lambda run: gemma4_tokenizer.decode(run, skip_special_tokens=True))
    assert decoded == text  # the markers kept, <pad> skipped


def test_thinking_in_data_loads_from_its_fields_or_gemma4s_markup(gemma4_tokenizer) -> None:
    from gemmaforge.data.formats import default_schema, to_messages

    schema = default_schema("openai")
    fields = {"messages": [{"role": "user", "content": "Cortado?"},
                           {"role": "assistant", "content": "Equal parts.", "reasoning_content": "1:1 milk."}]}
    markup = {"messages": [{"role": "user", "content": "Cortado?"},
                           {"role": "assistant", "content": "<|channel>thought\n1:1 milk.\n<channel|>Equal parts."}]}
    expected = [{"role": "user", "content": "Cortado?"},
                {"role": "assistant", "content": "Equal parts.", "thinking": "1:1 milk."}]
    assert to_messages(fields, schema, "d") == to_messages(markup, schema, "d") == expected
    assert supervised(gemma4_tokenizer, expected, GEMMA4) == (
        "<|channel>thought\n1:1 milk.\n<channel|>Equal parts.<turn|>")
    plain = {"messages": [{"role": "user", "content": "Q"}, {"role": "assistant", "content": "<think>x</think>A"}]}
    assert to_messages(plain, schema, "d")[1] == {"role": "assistant", "content": "<think>x</think>A"}  # text


def test_prepare_keeps_tool_conversations_whole(tmp_path, gemma3_tokenizer) -> None:
    """Over cutoff_len, an answer with thinking or calls is dropped (only a plain answer's text is cut); two
    conversations that differ only in the tools offered are not duplicates."""
    from gemmaforge.config import DataConfig
    from gemmaforge.data.prepare import prepare_data, read_prepared

    ask = {"role": "user", "content": "Brew"}
    rows = [
        {"messages": [ask, {"role": "assistant", "content": "ok", "thinking": "long " * 400}]},
        {"messages": [ask, {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": {
            "name": "brew", "arguments": {"note": "long " * 400}}}]}], "tools": [BREW]},
        {"messages": [ask, {"role": "assistant", "content": "Brewing."}], "tools": [BREW]},
        {"messages": [ask, {"role": "assistant", "content": "Brewing."}], "tools": [WEATHER]},
        {"messages": [ask, {"role": "assistant", "content": "Brewing."}], "tools": [WEATHER]},
    ]
    source = tmp_path / "tools.jsonl"
    source.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    config = DataConfig(path=str(source), val_size=0, clean={"overlong": "truncate"})
    stats = prepare_data(config, 0, tmp_path / "out", gemma3_tokenizer, GEMMA4, 256)
    assert stats["dropped"] == {"too_long": 2, "duplicate": 1} and stats["kept"] == 2
    kept = read_prepared(tmp_path / "out" / "train.jsonl")
    assert sorted(c[0]["tools"][0]["function"]["name"] for c in kept) == ["brew", "get_weather"]


def test_a_run_serves_tools_when_its_prepared_data_offered_them(tmp_path) -> None:
    """What serve and export read (RunDir.trained_with_tools) from the stats.json that data prepare writes."""
    from gemmaforge.runs import RunDir

    run = RunDir(tmp_path)
    assert not run.trained_with_tools()  # no prepared data yet
    run.data_dir.mkdir()
    (run.data_dir / "stats.json").write_text(json.dumps({"tool_conversations": 0}), encoding="utf-8")
    assert not run.trained_with_tools()
    (run.data_dir / "stats.json").write_text(json.dumps({"tool_conversations": 169}), encoding="utf-8")
    assert run.trained_with_tools()
