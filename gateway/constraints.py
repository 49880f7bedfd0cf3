"""Constrained decoding for the OpenAI parameters that need it: ``tool_choice: "required"`` or a
named function, ``strict: true`` tools and ``response_format`` ``json_schema`` / ``json_object``.

Each request that uses one becomes an xgrammar structural tag (``SamplingParams.guide``) that an
engine with the ``guided`` feature (vLLM's structured outputs) samples under. Calls are
constrained to the policy's own chat format -- the text ``ChatFormat.render`` writes for one
call, with the tool's parameter schema where its arguments go -- so the model writes a call the
way it was trained to, the gateway parses it as any other (``tool_calls`` with ids), and a
client that sends the call back renders to the same text. Rules:

- ``tool_choice`` naming a function: exactly one call of that function.
- ``required``: exactly one call, of any offered tool (OpenAI's "one or more": one suffices).
- ``strict: true`` on a tool (``tool_choice`` ``auto``): free text, but a call, once begun, is
  of an offered tool, and a strict tool's arguments follow its schema.
- ``response_format`` ``json_schema`` / ``json_object``: the reply is JSON of the schema (any
  object); with tools offered (``auto``) it may be one call instead.

The engine samples exactly the tokens recorded; what changes is the distribution they were
drawn from (the grammar's mask renormalises it), and so the behaviour log-probs. The recorder
marks each such turn (``LiveOrigin.constrained``: turn index -> ``Guide.reason``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from envs.formats import ChatFormat, ToolCall, get_format
from gateway.errors import InvalidRequest
from gateway.openai_types import ChatCompletionRequest, NamedToolChoice, ResponseFormat, Tool

GUIDED = "guided"
"""The engine feature constrained decoding needs (``Engine.features``)."""
ANY_OBJECT: dict[str, Any] = {"type": "object"}


@dataclass(frozen=True)
class Guide:
    """A request's constraint: the structural tag and why it applies."""

    tag: str
    """The xgrammar structural tag, JSON (``SamplingParams.guide``)."""
    reason: str
    """What asked for it: ``tool_choice_required``, ``tool_choice_named``, ``strict_tools``,
    ``response_format_json_schema``, ``response_format_json_object``."""
    param: str
    """The request parameter that asked for it (named in the 400 of an engine without it)."""


def guide_for(req: ChatCompletionRequest, chat_format: str | ChatFormat) -> Guide | None:
    """The constraint ``req`` needs, or None when it needs none."""
    fmt = get_format(chat_format)
    tools = req.tools or []
    choice = req.tool_choice
    if isinstance(choice, NamedToolChoice):
        name = choice.function.name
        tool = next((t for t in tools if t.function.name == name), None)
        if tool is None:
            raise InvalidRequest("tool_choice.function.name", f"tool_choice names {name!r}, which is not in tools; "
                                 f"offered: {[t.function.name for t in tools]}")
        return _guide(_call_tag(fmt, tool, True), "tool_choice_named", "tool_choice")
    if choice == "required":
        if not tools:
            raise InvalidRequest("tool_choice", "tool_choice 'required' needs tools")
        return _guide(_one_of([_call_tag(fmt, t, True) for t in tools]), "tool_choice_required", "tool_choice")
    offered = tools if choice != "none" else []
    rf = _json_format(req.response_format)
    if rf is not None:
        reason = f"response_format_{req.response_format.type}"  # type: ignore[union-attr]
        return _guide(_one_of([rf, *(_call_tag(fmt, t, _strict(t)) for t in offered)]), reason, "response_format")
    strict = [i for i, t in enumerate(offered) if _strict(t)]
    if strict:
        tags = [_call_tag(fmt, t, _strict(t)) for t in offered]
        fmt_json = {"type": "triggered_tags", "triggers": [_trigger(fmt, [t["begin"] for t in tags])], "tags": tags}
        return _guide(fmt_json, "strict_tools", f"tools.{strict[0]}.function.strict")
    return None


def _guide(fmt_json: dict[str, Any], reason: str, param: str) -> Guide:
    return Guide(json.dumps({"type": "structural_tag", "format": fmt_json}), reason, param)


def _strict(tool: Tool) -> bool:
    return bool(tool.function.strict)


def _call_tag(fmt: ChatFormat, tool: Tool, schema: bool) -> dict[str, Any]:
    """One call of ``tool`` as the format writes it: the text before the arguments, the
    arguments (the tool's schema, or any object), the text after."""
    name = tool.function.name
    text = fmt.render(None, [ToolCall(name=name, arguments={})])
    if text.count("{}") != 1:  # the name itself holds "{}": no single place for the arguments
        raise InvalidRequest("tools", f"tool name {name!r} cannot be constrained in the {fmt.name} format")
    begin, end = text.split("{}")
    params = (tool.function.parameters or ANY_OBJECT) if schema else ANY_OBJECT
    return {"type": "tag", "begin": begin, "content": _json(params), "end": end}


def _one_of(elements: list[dict[str, Any]]) -> dict[str, Any]:
    return elements[0] if len(elements) == 1 else {"type": "or", "elements": elements}


def _json_format(response_format: ResponseFormat | None) -> dict[str, Any] | None:
    """The JSON the reply must be, from ``response_format``."""
    if response_format is None or response_format.type == "text":
        return None
    spec = response_format.json_schema
    schema = spec.schema_ if spec is not None and spec.schema_ is not None else ANY_OBJECT
    return _json(schema)


def _json(schema: dict[str, Any]) -> dict[str, Any]:
    """JSON following ``schema``, at most one whitespace character in a row: what the chat
    formats render, and a bound on the runs of spaces a weak model would fill its tokens with."""
    return {"type": "json_schema", "json_schema": schema, "max_whitespace_cnt": 1}


def _trigger(fmt: ChatFormat, begins: list[str]) -> str:
    """Where a call starts: the format's call tag, else the text every call begins with (a
    trigger must begin each tag it starts)."""
    if fmt.call_tags and all(b.startswith(fmt.call_tags[0]) for b in begins):
        return fmt.call_tags[0]
    first, last = min(begins), max(begins)
    n = next((i for i, (a, b) in enumerate(zip(first, last)) if a != b), min(len(first), len(last)))
    return first[:n]
