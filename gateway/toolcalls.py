"""Between OpenAI's message shapes and the model's text, in the policy's chat format.

Model -> client: the chat format (``envs.formats``) splits the text into reasoning (OpenAI's
``reasoning_content``, as vLLM sends it), content and calls. A call block whose name can be read
is a ``tool_calls`` entry whose ``arguments`` string is the JSON text the model wrote -- the
same whether streamed or not, and possibly invalid JSON, which OpenAI's API also allows; such a
call, and a block with no readable name (left in the content, where the client sees what the
model wrote), mark the action invalid. Call ids are ``call_<24 hex>``, a hash of the completion
id, choice and call index: the same completion always gets the same ids.

Client -> template: request messages become the dicts chat templates render (Qwen2.5's, Llama
3.1's and ours): assistant calls as ``{"type": "function", "function": {"name", "arguments":
dict}}`` -- templates ``tojson`` the arguments, so they must be parsed, not the JSON string;
arguments that are not a JSON object stay the string the client sent (the model may have
written them so) -- and tool results as ``{"role": "tool", "content", "tool_call_id"}``.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import Any

from envs.formats import DEFAULT_FORMAT, ChatFormat, ToolCall, final_split, get_format
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
    """The text minus reasoning and call blocks; None when nothing else is left (OpenAI's null)."""
    calls: list[ToolCall] = field(default_factory=list)
    """Well-formed calls in order (arguments parsed): what the turn records."""
    ids: list[str] = field(default_factory=list)
    """OpenAI id of each entry of ``wire``."""
    errors: list[str] = field(default_factory=list)
    """Why each malformed block is malformed."""
    reasoning: str | None = None
    """The reasoning the format split off (``reasoning_content``); None when there is none."""
    wire: list[tuple[str, str]] = field(default_factory=list)
    """Every named call as the client gets it: (name, arguments JSON text as written)."""

    def message(self) -> AssistantMessage:
        """The response's ``message``."""
        calls = [OutToolCall(id=i, function=OutFunction(name=n, arguments=a)) for i, (n, a) in zip(self.ids, self.wire)]
        return AssistantMessage(content=self.content, tool_calls=calls or None, reasoning_content=self.reasoning)

    def template_message(self) -> dict[str, Any]:
        """The message as a client will send it back, in chat-template form."""
        return assistant_template_message(self.content, [(n, template_arguments(a)) for n, a in self.wire])


def split_action(text: str, completion_id: str, choice: int, tools_enabled: bool = True,
                 chat_format: str | ChatFormat = DEFAULT_FORMAT) -> AssistantReply:
    """Content, reasoning and tool calls of one choice's text. With ``tools_enabled`` False
    (no tools, or ``tool_choice: none``) nothing is parsed as a call."""
    split = final_split(get_format(chat_format), text, tools_enabled)
    wire = [(d.name, d.arguments) for d in split.calls if d.name is not None]
    ids = [tool_call_id(completion_id, choice, k) for k in range(len(wire))]
    return AssistantReply(text=text, content=split.content, calls=split.valid_calls(), ids=ids,
                          errors=list(split.errors), reasoning=split.reasoning, wire=wire)


def template_arguments(arguments: str) -> dict[str, Any] | str:
    """A call's ``arguments`` string as templates render it: the parsed object, else the text."""
    try:
        args = json.loads(arguments) if arguments.strip() else {}
    except json.JSONDecodeError:
        return arguments
    return args if isinstance(args, dict) else arguments


def assistant_template_message(content: str | None, calls: list[tuple[str, dict[str, Any] | str]]) -> dict[str, Any]:
    """An assistant message in chat-template form (empty content as "")."""
    msg: dict[str, Any] = {"role": "assistant", "content": content or ""}
    if calls:
        msg["tool_calls"] = [{"type": "function", "function": {"name": n, "arguments": a}} for n, a in calls]
    return msg


def template_messages(messages: list[Message]) -> list[dict[str, Any]]:
    """Request messages as the chat template renders them (an assistant's
    ``reasoning_content``, when a client sends it back, goes along: Qwen3's template shows it;
    so does a message's ``name``, for templates that show one)."""
    out: list[dict[str, Any]] = []
    for msg in messages:
        if msg.role == "assistant":
            calls = [(c.function.name, template_arguments(c.function.arguments)) for c in msg.tool_calls or []]
            out.append(assistant_template_message(msg.text(), calls))
            if msg.reasoning_content:
                out[-1]["reasoning_content"] = msg.reasoning_content
        elif msg.role == "tool":
            out.append({"role": "tool", "content": msg.text(), "tool_call_id": msg.tool_call_id})
        else:  # OpenAI's ``developer`` is the system message under its newer name
            out.append({"role": "system" if msg.role == "developer" else msg.role, "content": msg.text()})
        if msg.name is not None:  # a template with a place for it shows it; ours have none
            out[-1]["name"] = msg.name
    return out


def same_message(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """Whether two template-form messages say the same thing: role, content (None == ""), and
    calls by name and parsed arguments (call ids never reach the template, so they are not
    compared)."""
    def key(m: dict[str, Any]) -> tuple[Any, ...]:
        calls = [(c["function"]["name"], c["function"]["arguments"]) for c in m.get("tool_calls") or []]
        return m["role"], m.get("content") or "", calls
    return key(a) == key(b)


def thinking_off_ids(tokenizer: Any, chat_format: str | ChatFormat, effort: str | None) -> list[int]:
    """What opens the reply for ``reasoning_effort``: in a reasoning format (``think`` tags),
    ``none`` and ``minimal`` write the empty think block Qwen3's template writes for
    ``enable_thinking: false``, so the model answers without reasoning; else nothing."""
    fmt = get_format(chat_format)
    if fmt.think is None or effort not in ("none", "minimal"):
        return []
    return tokenizer(f"{fmt.think[0]}\n\n{fmt.think[1]}\n\n", add_special_tokens=False)["input_ids"]
