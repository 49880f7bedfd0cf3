"""The tool-call protocol: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``.

This is the Hermes/Qwen convention that transformers chat templates render when given
``tools=``. An episode ends with ``<answer>...</answer>``. Parsing never raises: a malformed
call comes back as a ``ParseError`` the environment turns into an observation.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel, ConfigDict

TOOL_CALL_RE = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
ANSWER_RE = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)


class ToolCall(BaseModel):
    """One parsed call: a tool name and its JSON arguments."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str
    """The tool's name as the model wrote it."""
    arguments: dict[str, Any] = {}
    """The call's arguments, a JSON object."""


@dataclass
class ParsedAction:
    """What one assistant message asked for."""

    calls: list[ToolCall] = field(default_factory=list)
    """Well-formed calls, in the order written."""
    errors: list[str] = field(default_factory=list)
    """One message per malformed call, phrased for the model to read."""
    answer: str | None = None
    """Text inside the first ``<answer>`` block, if any."""
    balanced: bool = True
    """False when ``<answer>``/``<tool_call>`` open and close tags do not pair up."""


def _tags_balanced(text: str) -> bool:
    return all(
        text.count(f"<{tag}>") == text.count(f"</{tag}>") for tag in ("answer", "tool_call")
    )


def _parse_call(body: str) -> ToolCall | str:
    try:
        obj = json.loads(body)
    except json.JSONDecodeError as exc:
        return f"tool call is not valid JSON ({exc.msg} at char {exc.pos})"
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return 'tool call must be a JSON object with a string "name"'
    args = obj.get("arguments", {})
    if isinstance(args, str):  # some models double-encode arguments
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            return '"arguments" must be a JSON object'
    if not isinstance(args, dict):
        return '"arguments" must be a JSON object'
    return ToolCall(name=obj["name"], arguments=args)


def parse_action(text: str) -> ParsedAction:
    """Parse an assistant message into tool calls, errors and an optional answer."""
    parsed = ParsedAction(balanced=_tags_balanced(text))
    for match in TOOL_CALL_RE.finditer(text):
        result = _parse_call(match.group(1).strip())
        if isinstance(result, ToolCall):
            parsed.calls.append(result)
        else:
            parsed.errors.append(result)
    if "<tool_call>" in text and not TOOL_CALL_RE.search(text):
        parsed.errors.append("unterminated <tool_call>: close it with </tool_call>")
    answer = ANSWER_RE.search(text)
    if answer:
        parsed.answer = answer.group(1).strip()
    return parsed


def format_answer(answer: str) -> str:
    """The action that ends an episode with ``answer``."""
    return f"<answer>{answer}</answer>"


def format_call(call: ToolCall) -> str:
    """Render a call the way the model is expected to write it."""
    payload = json.dumps({"name": call.name, "arguments": call.arguments}, ensure_ascii=False)
    return f"<tool_call>{payload}</tool_call>"
