"""Checking tool-call arguments against OpenAI JSON-schema tool definitions.

Shared by every environment that offers tools, so a wrong argument reads the same everywhere.
Only the schema subset tool definitions use is checked: required keys, unexpected keys,
top-level JSON types, ``enum`` and the item type of arrays. Checking never raises: problems come
back as sentences for the model to read.
"""

from __future__ import annotations

from typing import Any

_JSON_TYPES: dict[str, tuple[type, ...]] = {
    "string": (str,),
    "integer": (int,),
    "number": (int, float),
    "boolean": (bool,),
    "array": (list,),
    "object": (dict,),
    "null": (type(None),),
}


EMPTY_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}
"""The JSON schema of a tool that takes no arguments."""


def function_tool(name: str, description: str | None, parameters: dict[str, Any] | None) -> dict[str, Any]:
    """An OpenAI function tool definition (what the chat template shows the policy); no
    description is an empty one, no schema a tool without arguments."""
    return {"type": "function", "function": {"name": name, "description": description or "",
                                             "parameters": dict(parameters or EMPTY_PARAMETERS)}}


def tool_name(tool: dict[str, Any]) -> str:
    """The name of an OpenAI tool definition, wrapped (``{"function": ...}``) or bare."""
    return tool.get("function", tool)["name"]


def tool_parameters(tool: dict[str, Any]) -> dict[str, Any]:
    """The JSON schema of a tool's parameters (an empty object schema when absent)."""
    return tool.get("function", tool).get("parameters") or EMPTY_PARAMETERS


def _type_ok(value: Any, json_type: str | list[str]) -> bool:
    types = [json_type] if isinstance(json_type, str) else json_type
    for name in types:
        allowed = _JSON_TYPES.get(name)
        if allowed is None:  # unknown type names are not ours to police
            return True
        # bool is an int subclass in Python, but JSON keeps them apart
        if isinstance(value, bool) and name in ("integer", "number"):
            continue
        if isinstance(value, allowed):
            return True
    return False


def _check_value(key: str, value: Any, schema: dict[str, Any]) -> str | None:
    json_type = schema.get("type")
    if json_type is not None and not _type_ok(value, json_type):
        return f'argument "{key}" must be of type {json_type}, got {type(value).__name__}'
    if "enum" in schema and value not in schema["enum"]:
        return f'argument "{key}" must be one of {schema["enum"]}, got {value!r}'
    items = schema.get("items")
    if isinstance(value, list) and isinstance(items, dict) and "type" in items:
        for i, item in enumerate(value):
            if not _type_ok(item, items["type"]):
                return f'argument "{key}"[{i}] must be of type {items["type"]}'
    return None


def check_arguments(tool: dict[str, Any], arguments: dict[str, Any]) -> list[str]:
    """Problems with ``arguments`` for ``tool``, one sentence each; empty when they fit."""
    schema = tool_parameters(tool)
    properties: dict[str, Any] = schema.get("properties", {})
    problems = [
        f'missing required argument "{key}"'
        for key in schema.get("required", [])
        if key not in arguments
    ]
    strict = schema.get("additionalProperties", False) is False
    for key, value in arguments.items():
        if key not in properties:
            if strict:
                problems.append(
                    f'unexpected argument "{key}"; expected {sorted(properties) or "none"}'
                )
            continue
        problem = _check_value(key, value, properties[key])
        if problem:
            problems.append(problem)
    return problems


def tool_message(name: str | None, content: str) -> dict[str, Any]:
    """A chat message carrying one tool result (or one tool error) back to the model."""
    message: dict[str, Any] = {"role": "tool", "content": content}
    if name is not None:
        message["name"] = name
    return message
