"""Tools and tool calls in the shapes clients and datasets send them, checked and brought to one shape that every
chat format renders from: a tool is OpenAI's {"type": "function", "function": {"name", "description",
"parameters"}}; a call is {"name": str, "arguments": dict} (with its "id" when it had one)."""

from __future__ import annotations

import json
from typing import Any

Tool = dict[str, Any]
ToolCall = dict[str, Any]


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
