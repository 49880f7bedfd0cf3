"""Between OpenAI's message shapes and the model's Hermes-style text.

Model -> client: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks the policy
wrote become OpenAI ``tool_calls`` (arguments as a JSON string) and leave the content; a block
that does not parse (bad JSON, no name) stays in the content, where the client sees what the
model wrote, and marks the action invalid. Call ids are ``call_<24 hex>``, a hash of the
completion id, choice and call index: the same completion always gets the same ids.

Client -> template: request messages become the dicts chat templates render (Qwen2.5's, Llama
3.1's and ours): assistant calls as ``{"type": "function", "function": {"name", "arguments":
dict}}`` -- templates ``tojson`` the arguments, so they must be parsed, not the JSON string --
and tool results as ``{"role": "tool", "content", "tool_call_id"}``.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import Any

from envs.toolcalls import TOOL_CALL_RE, ToolCall, parse_action
from gateway.errors import InvalidRequest
from gateway.openai_types import AssistantMessage, Message, OutFunction, OutToolCall


def tool_call_id(completion_id: str, choice: int, call: int) -> str:
    """Deterministic id of call ``call`` in choice ``choice`` of completion ``completion_id``."""
    digest = hashlib.sha256(f"{completion_id}/{choice}/{call}".encode()).hexdigest()
    return f"call_{digest[:24]}"


@dataclass
class AssistantReply:
    """One choice's model text split into what the client gets."""

    text: str
    """The whole decoded action, as the model wrote it."""
    content: str | None
    """The text minus well-formed call blocks; None when nothing else is left (OpenAI's null)."""
    calls: list[ToolCall] = field(default_factory=list)
    """Well-formed calls in order (arguments parsed)."""
    ids: list[str] = field(default_factory=list)
    """OpenAI id of each call."""
    errors: list[str] = field(default_factory=list)
    """Why each malformed block was left in the content."""

    def message(self) -> AssistantMessage:
        """The response's ``message``."""
        calls = [
            OutToolCall(id=i, function=OutFunction(name=c.name, arguments=json.dumps(c.arguments)))
            for i, c in zip(self.ids, self.calls)
        ]
        return AssistantMessage(content=self.content, tool_calls=calls or None)

    def template_message(self) -> dict[str, Any]:
        """The message as a client will send it back, in chat-template form."""
        return assistant_template_message(self.content, self.calls)


def split_action(text: str, completion_id: str, choice: int, tools_enabled: bool = True) -> AssistantReply:
    """Content and tool calls of one choice's text. With ``tools_enabled`` False (no tools, or
    ``tool_choice: none``) the text is all content: nothing is parsed as a call."""
    if not tools_enabled:
        return AssistantReply(text=text, content=text or None)
    kept, calls, errors, last, tail = [], [], [], 0, 0
    for block in TOOL_CALL_RE.finditer(text):
        parsed = parse_action(block.group(0))
        tail = block.end()
        if parsed.calls:
            kept.append(text[last:block.start()])
            last = block.end()
            calls += parsed.calls
        else:
            errors += parsed.errors
    kept.append(text[last:])
    if "<tool_call>" in text[tail:]:
        errors.append("unterminated <tool_call>: close it with </tool_call>")
    content = "".join(kept)
    ids = [tool_call_id(completion_id, choice, k) for k in range(len(calls))]
    return AssistantReply(text=text, content=content or None, calls=calls, ids=ids, errors=errors)


def assistant_template_message(content: str | None, calls: list[ToolCall]) -> dict[str, Any]:
    """An assistant message in chat-template form (empty content as "")."""
    msg: dict[str, Any] = {"role": "assistant", "content": content or ""}
    if calls:
        msg["tool_calls"] = [
            {"type": "function", "function": {"name": c.name, "arguments": dict(c.arguments)}}
            for c in calls
        ]
    return msg


def template_messages(messages: list[Message]) -> list[dict[str, Any]]:
    """Request messages as the chat template renders them. Arguments that are not a JSON object
    raise InvalidRequest naming the message's field."""
    out: list[dict[str, Any]] = []
    for i, msg in enumerate(messages):
        if msg.role == "assistant":
            calls = [_parsed_call(i, k, c.function.name, c.function.arguments)
                     for k, c in enumerate(msg.tool_calls or [])]
            out.append(assistant_template_message(msg.text(), calls))
        elif msg.role == "tool":
            out.append({"role": "tool", "content": msg.text(), "tool_call_id": msg.tool_call_id})
        else:
            out.append({"role": msg.role, "content": msg.text()})
    return out


def _parsed_call(i: int, k: int, name: str, arguments: str) -> ToolCall:
    param = f"messages.{i}.tool_calls.{k}.function.arguments"
    try:
        args = json.loads(arguments) if arguments.strip() else {}
    except json.JSONDecodeError as exc:
        raise InvalidRequest(param, f"not valid JSON ({exc.msg} at char {exc.pos})") from None
    if not isinstance(args, dict):
        raise InvalidRequest(param, "must be a JSON object encoded as a string")
    return ToolCall(name=name, arguments=args)


def same_message(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """Whether two template-form messages say the same thing: role, content (None == ""), and
    calls by name and parsed arguments (call ids never reach the template, so they are not
    compared)."""
    def key(m: dict[str, Any]) -> tuple[Any, ...]:
        calls = [(c["function"]["name"], c["function"]["arguments"]) for c in m.get("tool_calls") or []]
        return m["role"], m.get("content") or "", calls
    return key(a) == key(b)
