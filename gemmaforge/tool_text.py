"""Tools, tool calls and tool results as text, in the two styles a Gemma chat format uses, each with its inverse
(a generated call read back into a ToolCall):

- Gemma 4's own (`<|tool>declaration:...<tool|>`, `<|tool_call>call:NAME{key:value}<tool_call|>`,
  `<|tool_response>response:NAME{...}<tool_response|>`, strings between `<|"|>`), ported from the official
  chat template's macros (format_function_declaration, format_parameters, format_argument,
  format_tool_response_block) so the text matches what that template renders byte for byte;
- Gemma 1-3 have no tools in their official templates: they take LLaMA-Factory's "default" tool format, the one
  its gemma/gemma2/gemma3 templates use (a "You have access to the following tools" prompt in the system text,
  calls as `Action: NAME` / `Action Input: {json}`), so its users' data trains and serves as it did there.

A tool is OpenAI's shape, {"type": "function", "function": {"name", "description", "parameters"}}; a call is
{"name": str, "arguments": dict}.
"""

from __future__ import annotations

import json
import re
from typing import Any

Tool = dict[str, Any]
ToolCall = dict[str, Any]

QUOTE = '<|"|>'  # Gemma 4's string delimiter
TOOL_CALL_OPEN, TOOL_CALL_CLOSE = "<|tool_call>", "<tool_call|>"
TOOL_RESPONSE_OPEN, TOOL_RESPONSE_CLOSE = "<|tool_response>", "<tool_response|>"
_STANDARD_KEYS = ("description", "type", "properties", "required", "nullable")


# ---------------------------------------------------------------------------- Gemma 4


def _sorted_items(mapping: dict[str, Any]) -> list[tuple[str, Any]]:
    """jinja's dictsort: by key, case-insensitively."""
    return sorted(mapping.items(), key=lambda item: str(item[0]).lower())


def _upper(mapping: dict[str, Any], key: str) -> str:
    """jinja's `mapping[key] | upper`: "" when the key is absent, a None as "NONE", a list as its Python text."""
    return str(mapping[key]).upper() if key in mapping else ""


def gemma4_value(value: Any, escape_keys: bool = True) -> str:
    """The template's format_argument."""
    if value is None:
        return "null"
    if isinstance(value, str):
        return QUOTE + value + QUOTE
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, dict):
        return "{" + ",".join(f"{QUOTE + str(k) + QUOTE if escape_keys else k}:{gemma4_value(v, escape_keys)}"
                              for k, v in _sorted_items(value)) + "}"
    if isinstance(value, list | tuple):
        return "[" + ",".join(gemma4_value(v, escape_keys) for v in value) + "]"
    return str(value)


def _quoted_list(items: Any) -> str:
    return ",".join(QUOTE + str(item) + QUOTE for item in items)


def _parameters(properties: dict[str, Any], filter_keys: bool = False) -> str:
    """The template's format_parameters (a value that is not an object renders as the template renders it: a
    property with an empty type)."""
    out = []
    for key, value in _sorted_items(properties):
        if filter_keys and key in _STANDARD_KEYS:
            continue
        value = value if isinstance(value, dict) else {}
        fields = []
        if value.get("description"):
            fields.append(f"description:{QUOTE}{value['description']}{QUOTE}")
        kind = _upper(value, "type")
        if kind == "STRING" and value.get("enum"):
            fields.append("enum:" + gemma4_value(value["enum"]))
        elif kind == "ARRAY" and isinstance(value.get("items"), dict) and value["items"]:
            fields.append("items:{" + _items(value["items"]) + "}")
        if value.get("nullable"):
            fields.append("nullable:true")
        if kind == "OBJECT":
            if isinstance(value.get("properties"), dict):
                fields.append("properties:{" + _parameters(value["properties"]) + "}")
            else:
                fields.append("properties:{" + _parameters(value, filter_keys=True) + "}")
            if value.get("required"):
                fields.append(f"required:[{_quoted_list(value['required'])}]")
        fields.append(f"type:{QUOTE}{kind}{QUOTE}")
        out.append(f"{key}:{{{','.join(fields)}}}")
    return ",".join(out)


def _items(items: dict[str, Any]) -> str:
    out = []
    for key, value in _sorted_items(items):
        if value is None:
            continue
        if key == "properties":
            out.append("properties:{" + (_parameters(value) if isinstance(value, dict) else "") + "}")
        elif key == "required":
            out.append(f"required:[{_quoted_list(value)}]")
        elif key == "type":
            kinds = value.upper() if isinstance(value, str) else [str(v).upper() for v in value]
            out.append("type:" + gemma4_value(kinds))
        else:
            out.append(f"{key}:{gemma4_value(value)}")
    return ",".join(out)


def gemma4_declaration(tool: Tool) -> str:
    """`<|tool>declaration:NAME{...}<tool|>` as the template's format_function_declaration writes it (its quirks
    kept: a parameters block without a type is not closed)."""
    function = tool["function"]
    description = str(function["description"]) if "description" in function else ""
    text = f"declaration:{function['name']}{{description:{QUOTE}{description}{QUOTE}"
    params = function.get("parameters")
    if params:
        text += ",parameters:{"
        if params.get("properties"):
            text += "properties:{" + _parameters(params["properties"]) + "},"
        if params.get("required"):
            text += f"required:[{_quoted_list(params['required'])}],"
        if params.get("type"):
            text += f"type:{QUOTE}{_upper(params, 'type')}{QUOTE}}}"
    if "response" in function and isinstance(function["response"], dict):
        response = function["response"]
        text += ",response:{"
        if response.get("description"):
            text += f"description:{QUOTE}{response['description']}{QUOTE},"
        if _upper(response, "type") == "OBJECT":
            text += f"type:{QUOTE}OBJECT{QUOTE}}}"
    return "<|tool>" + (text + "}").strip() + "<tool|>"


def gemma4_call(call: ToolCall) -> str:
    args = ",".join(f"{k}:{gemma4_value(v, escape_keys=False)}" for k, v in _sorted_items(call["arguments"]))
    return f"{TOOL_CALL_OPEN}call:{call['name']}{{{args}}}{TOOL_CALL_CLOSE}"


def gemma4_response(name: str, content: str) -> str:
    value = gemma4_value(content, escape_keys=False)
    return f"{TOOL_RESPONSE_OPEN}response:{name}{{value:{value}}}{TOOL_RESPONSE_CLOSE}"


_G4_STRING = re.compile(re.escape(QUOTE) + "(.*?)" + re.escape(QUOTE), re.DOTALL)
_G4_BARE_KEY = re.compile(r"([{,]\s*)([A-Za-z_][\w\-.]*)\s*:")
_G4_CALL = re.compile(r"call:([^{\s]+)\s*(\{.*\})\s*$", re.DOTALL)


def parse_gemma4_call(text: str) -> ToolCall | None:
    """`call:NAME{key:value,...}` (what stands between <|tool_call> and <tool_call|>) as a ToolCall; None when it
    is not one. Strings between <|"|> become JSON strings, bare keys are quoted, the rest is read as JSON."""
    match = _G4_CALL.match(text.strip())
    if not match:
        return None
    strings: list[str] = []

    def hold(m: re.Match[str]) -> str:
        strings.append(m.group(1))
        return f"\x00{len(strings) - 1}\x00"

    body = _G4_BARE_KEY.sub(lambda m: f'{m.group(1)}"{m.group(2)}":', _G4_STRING.sub(hold, match.group(2)))
    body = re.sub(r"\x00(\d+)\x00", lambda m: json.dumps(strings[int(m.group(1))], ensure_ascii=False), body)
    try:
        arguments = json.loads(body)
    except json.JSONDecodeError:
        return None
    return {"name": match.group(1), "arguments": arguments} if isinstance(arguments, dict) else None


# ---------------------------------------------------------------------------- LLaMA-Factory's default format

# LLaMA-Factory's DEFAULT_TOOL_PROMPT (src/llamafactory/data/tool_utils.py), character for character.
_DEFAULT_TOOL_PROMPT = (
    "You have access to the following tools:\n{tool_text}"
    "Use the following format if using a tool:\n"
    "```\n"
    "Action: tool name (one of [{tool_names}])\n"
    "Action Input: the input to the tool, in a JSON format representing the kwargs "
    """(e.g. ```{{"input": "hello world", "num_beams": 5}}```)\n"""
    "```\n"
)


def default_tool_prompt(tools: list[Tool]) -> str:
    """What LLaMA-Factory's DefaultToolUtils.tool_formatter appends to the system text."""
    tool_text, names = "", []
    for tool in tools:
        function = tool["function"]
        params = function.get("parameters") or {}
        lines = ""
        for name, param in (params.get("properties") or {}).items():
            param = param if isinstance(param, dict) else {}
            required = ", required" if name in (params.get("required") or []) else ""
            enum = ", should be one of [{}]".format(", ".join(map(str, param["enum"]))) if param.get("enum") else ""
            items = f", where each item should be {param['items'].get('type', '')}" if param.get("items") else ""
            lines += f"  - {name} ({param.get('type', '')}{required}): {param.get('description', '')}{enum}{items}\n"
        tool_text += (f"> Tool Name: {function['name']}\nTool Description: {function.get('description', '')}\n"
                      f"Tool Args:\n{lines}\n")
        names.append(function["name"])
    return _DEFAULT_TOOL_PROMPT.format(tool_text=tool_text, tool_names=", ".join(names))


def default_calls(calls: list[ToolCall]) -> str:
    """LLaMA-Factory's DefaultToolUtils.function_formatter (arguments as json.dumps with ensure_ascii=False)."""
    return "\n".join(f"Action: {c['name']}\nAction Input: {json.dumps(c['arguments'], ensure_ascii=False)}"
                     for c in calls)


_ACTION = re.compile(r"Action:\s*([a-zA-Z0-9_]+)\s*Action Input:\s*(.+?)(?=\s*Action:|\s*$)", re.DOTALL)


def parse_default_calls(text: str) -> tuple[str, list[ToolCall]]:
    """LLaMA-Factory's DefaultToolUtils.tool_extractor: (the text before the first call, the calls); no calls
    when any Action Input is not a JSON object (the whole text is then an answer, as there)."""
    matches = list(_ACTION.finditer(text))
    calls = []
    for match in matches:
        try:
            arguments = json.loads(match.group(2).strip().strip('"').strip("`"))
        except json.JSONDecodeError:
            return text, []
        if not isinstance(arguments, dict):
            return text, []
        calls.append({"name": match.group(1).strip(), "arguments": arguments})
    return (text[:matches[0].start()].strip(), calls) if calls else (text, [])


# ---------------------------------------------------------------------------- shapes


def normalize_tool(tool: Any, where: str) -> Tool:
    """A tool definition in OpenAI's shape, from that shape or the bare {"name", "description", "parameters"}
    that LLaMA-Factory's tools column holds; ValueError naming `where` otherwise."""
    if isinstance(tool, dict) and tool.get("type") == "function" and isinstance(tool.get("function"), dict):
        function = tool["function"]
    elif isinstance(tool, dict) and "name" in tool:
        function = tool
    else:
        raise ValueError(f"{where}: expected a tool definition {{\"type\": \"function\", \"function\": {{\"name\", "
                         "\"description\", \"parameters\"}}}} or {\"name\", \"description\", \"parameters\"}")
    if not isinstance(function.get("name"), str) or not function["name"]:
        raise ValueError(f"{where}: the function's name is missing or not a string")
    params = function.get("parameters")
    if params is not None:
        _check_schema(params, f"{where}: parameters")
    return {"type": "function", "function": dict(function)}


def _check_schema(schema: Any, where: str) -> None:
    """The parts of a JSON schema the tool renderings read, in the shapes they read them (what the official
    template would fail on is refused here, naming the place)."""
    if not isinstance(schema, dict):
        raise ValueError(f"{where}: must be a JSON schema object")
    kind = schema.get("type")
    if kind is not None and not (isinstance(kind, str) or isinstance(kind, list) and all(
            isinstance(k, str | None) for k in kind)):
        raise ValueError(f"{where}.type: expected a type name or a list of them")
    for key in ("required", "enum"):
        if schema.get(key) is not None and not isinstance(schema[key], list):
            raise ValueError(f"{where}.{key}: expected a list")
    if schema.get("properties") is not None:
        if not isinstance(schema["properties"], dict):
            raise ValueError(f"{where}.properties: expected an object mapping names to schemas")
        for name, value in schema["properties"].items():
            if isinstance(value, dict):
                _check_schema(value, f"{where}.properties.{name}")
    if isinstance(schema.get("items"), dict):
        _check_schema(schema["items"], f"{where}.items")


def normalize_call(call: Any, where: str) -> ToolCall:
    """A call from OpenAI's {"function": {"name", "arguments": "JSON text"}}, Ollama's {"function": {"name",
    "arguments": {...}}} or {"name", "arguments"}; ValueError naming `where` otherwise."""
    function = call.get("function", call) if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str) or not function["name"]:
        raise ValueError(f"{where}: expected a tool call with a function name")
    arguments = function.get("arguments")
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except json.JSONDecodeError as e:
            raise ValueError(f"{where}: arguments are not JSON ({e.msg})") from None
    if arguments is None:
        arguments = {}
    if not isinstance(arguments, dict):
        raise ValueError(f"{where}: arguments must be a JSON object")
    ident = call.get("id") if isinstance(call, dict) else None
    return {"name": function["name"], "arguments": arguments, **({"id": ident} if isinstance(ident, str) and ident
                                                                  else {})}
