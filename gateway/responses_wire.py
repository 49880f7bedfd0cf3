"""OpenAI's Responses API wire format (``POST /v1/responses``): the request it accepts, how its
input items become chat messages, and the response objects and output items it sends.

The Responses API is served on the chat-completions path: a request's ``instructions``, the
conversation its ``previous_response_id`` chain holds, and its ``input`` items become one chat
request's ``messages`` (``to_chat_body``), so a Responses session is sampled, recorded token-exact
and trained exactly as a chat session is. Item mapping: ``message`` items keep their role
(``developer`` rendered as ``system``); a run of assistant output -- ``reasoning``, an assistant
``message``, ``function_call`` items -- is one assistant turn (reasoning as its
``reasoning_content``, calls as its ``tool_calls`` with the item's ``call_id``); a
``function_call_output`` is the ``tool`` message answering its ``call_id``.

Requests are strict as chat requests are: each field OpenAI documents is implemented, accepted
with a stated meaning that changes nothing served or trained (``NO_EFFECT``), or refused with a
400 naming it (``REFUSED``); docs/live.md has the table.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Discriminator, Field, Tag, ValidationError

from gateway.errors import InvalidRequest, from_validation
from gateway.openai_types import MAX_TOP_LOGPROBS, REASONING_EFFORTS, FunctionDef, PromptCacheOptions, _Strict

REFUSED = {
    "background": "background responses are not served; stream instead (stream: true)",
    "background_options": "background responses are not served; stream instead (stream: true)",
    "conversation": "the Conversations API is not served; chain responses with previous_response_id",
    "prompt": "prompt templates live on OpenAI's side; send instructions and input instead",
    "context_management": "server-side compaction is not served; the client keeps its context",
    "moderation": "this server runs no moderation model; moderate before or after calling it",
    "access_programs": "programs run on OpenAI's side; this server serves function tools only",
    "image": "image generation settings need an image model; this server serves a text policy",
}
NO_EFFECT = ("prompt_cache_key", "prompt_cache_retention", "prompt_cache_options", "safety_identifier",
             "service_tier", "max_tool_calls", "truncation")
"""Accepted fields that change nothing served or trained (each one's meaning in its docstring)."""
LOGPROBS_INCLUDE = "message.output_text.logprobs"


# -- input items ----------------------------------------------------------------------------
class InputText(_Strict):
    type: Literal["input_text"]
    text: str


class OutputText(_Strict):
    """Text of an assistant message a client sends back (annotations and log-probs ignored)."""

    type: Literal["output_text"]
    text: str
    annotations: list[Any] = Field(default_factory=list, max_length=0)
    logprobs: list[Any] | None = None


class Refusal(_Strict):
    type: Literal["refusal"]
    refusal: str


class MessageItem(_Strict):
    """A message: the easy form (``{"role", "content"}``) or a typed item an SDK echoes back."""

    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[InputText | OutputText | Refusal]
    id: str | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None
    phase: str | None = None
    """An output message's phase, as the SDK echoes it back; no meaning here."""

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text if not isinstance(p, Refusal) else p.refusal for p in self.content)


class FunctionCallItem(_Strict):
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str
    id: str | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None
    namespace: str | None = None


class FunctionCallOutputItem(_Strict):
    type: Literal["function_call_output"]
    call_id: str
    output: str | list[InputText]
    id: str | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None

    def text(self) -> str:
        return self.output if isinstance(self.output, str) else "".join(p.text for p in self.output)


class ReasoningText(_Strict):
    type: Literal["reasoning_text"]
    text: str


class SummaryText(_Strict):
    type: Literal["summary_text"]
    text: str


class ReasoningItem(_Strict):
    """Reasoning a client sends back (ours: its ``content`` holds the text the model wrote)."""

    type: Literal["reasoning"]
    id: str | None = None
    summary: list[SummaryText] = Field(default_factory=list)
    content: list[ReasoningText] | None = None
    encrypted_content: str | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None


def _item_kind(item: Any) -> str:
    return item.get("type", "message") if isinstance(item, dict) else getattr(item, "type", "message")


InputItem = Annotated[Annotated[MessageItem, Tag("message")] | Annotated[FunctionCallItem, Tag("function_call")]
                      | Annotated[FunctionCallOutputItem, Tag("function_call_output")]
                      | Annotated[ReasoningItem, Tag("reasoning")], Discriminator(_item_kind)]
"""One input item, told apart by its ``type`` (a message may leave it out)."""


# -- request --------------------------------------------------------------------------------
class FunctionTool(FunctionDef):
    """A function tool: chat's function definition, flat, with its ``type`` (``strict``, the
    OpenAI Agents SDK's default, is constrained decoding as in chat)."""

    type: Literal["function"]


class NamedFunction(_Strict):
    type: Literal["function"]
    name: str


class TextFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    description: str | None = None
    strict: bool | None = None


class TextConfig(_Strict):
    format: TextFormat | None = None
    """``text``, or the JSON modes, constrained decoding as chat's ``response_format``."""
    verbosity: Literal["low", "medium", "high"] | None = None
    """No effect, as chat's ``verbosity``."""


class Reasoning(_Strict):
    effort: Literal[REASONING_EFFORTS] | None = None  # type: ignore[valid-type]
    """As chat's ``reasoning_effort``."""
    summary: Literal["auto", "concise", "detailed"] | None = None
    """No effect: no summary is written; the reasoning item carries the reasoning itself."""
    generate_summary: Literal["auto", "concise", "detailed"] | None = None
    """The deprecated name of ``summary``; no effect."""


class StreamOptions(_Strict):
    include_obfuscation: bool | None = None
    """No effect: events carry no obfuscation padding."""


class ResponsesRequest(_Strict):
    """``POST /v1/responses`` body. Parse with :func:`parse_responses_request`."""

    input: list[InputItem]
    """Items, or a string: one user message (``parse_responses_request`` turns it into one)."""
    model: str | None = None
    instructions: str | None = None
    """A system message before the conversation; not carried to responses chained on this one
    (OpenAI's rule)."""
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["auto", "none", "required"] | NamedFunction | None = None
    parallel_tool_calls: bool | None = None
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    max_output_tokens: int | None = Field(None, ge=1)
    previous_response_id: str | None = None
    """Continue the conversation of a stored response (``store`` not false) whose session is still open."""
    stream: bool = False
    stream_options: StreamOptions | None = None
    store: bool | None = None
    """True or absent: the response is kept while its session is open, for ``previous_response_id``
    and ``GET /v1/responses/{id}``. False: not kept."""
    metadata: dict[str, str] | None = None
    """Echoed in the response; changes nothing served or recorded."""
    user: str | None = None
    """Keys the session when no ``X-Session-Id`` header (or chained response) does."""
    text: TextConfig | None = None
    reasoning: Reasoning | None = None
    include: list[str] | None = None
    """``message.output_text.logprobs``: each output text carries its tokens' log-probs. The
    others name outputs of tools this server does not run, or encrypted reasoning (reasoning is
    returned as text): no effect."""
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    prompt_cache_key: str | None = None
    """No effect: the engines' prefix cache serves every request that shares a prefix."""
    prompt_cache_retention: Literal["in-memory", "in_memory", "24h"] | None = None
    """No effect, as ``prompt_cache_key``."""
    prompt_cache_options: PromptCacheOptions | None = None
    """No effect, as ``prompt_cache_key``."""
    safety_identifier: str | None = None
    """No effect (OpenAI's abuse tracking); not recorded."""
    service_tier: Literal["auto", "default", "flex", "scale", "priority", "fast"] | None = None
    """No effect: every request is served alike, in arrival order."""
    max_tool_calls: int | None = Field(None, ge=1)
    """No effect: it bounds calls of OpenAI's built-in tools, of which this server runs none."""
    truncation: Literal["disabled", "auto"] | None = None
    """No effect: a conversation too long for the context is a 400 either way (dropping its
    start would have the policy answer a conversation the client did not send)."""

    def logprobs(self) -> bool:
        return LOGPROBS_INCLUDE in (self.include or [])


def parse_responses_request(body: Any) -> ResponsesRequest:
    """Validate a body; raises InvalidRequest naming the first bad parameter."""
    if not isinstance(body, dict):
        raise InvalidRequest(None, "the request body must be a JSON object")
    for key in body:
        if key in REFUSED and body[key] not in (None, False):
            raise InvalidRequest(key, f"'{key}' is not supported by this server: {REFUSED[key]}")
        if key not in ResponsesRequest.model_fields and key not in REFUSED:
            raise InvalidRequest(key, f"unknown parameter '{key}'")
    _check_item_types(body.get("input"))
    _check_tool_types(body.get("tools"))
    if isinstance(body.get("input"), str):
        body = {**body, "input": [{"role": "user", "content": body["input"]}]}
    try:
        return ResponsesRequest.model_validate({k: v for k, v in body.items() if k not in REFUSED})
    except ValidationError as exc:
        raise from_validation(exc, _FIELD_NAMES) from None


def _check_item_types(items: Any) -> None:
    """Items of kinds this server does not take: a 400 naming the item, not pydantic's union noise."""
    if not isinstance(items, list):
        return
    known = {"message", "function_call", "function_call_output", "reasoning"}
    for i, item in enumerate(items):
        kind = item.get("type", "message") if isinstance(item, dict) else None
        if kind is not None and kind not in known:
            raise InvalidRequest(f"input.{i}.type", f"{kind!r} items are not served here (only message, "
                                 "function_call, function_call_output and reasoning items: this server runs "
                                 "function tools only, and item references need OpenAI's item store)")


def _check_tool_types(tools: Any) -> None:
    if not isinstance(tools, list):
        return
    for i, tool in enumerate(tools):
        kind = tool.get("type") if isinstance(tool, dict) else None
        if kind is not None and kind != "function":
            raise InvalidRequest(f"tools.{i}.type", f"{kind!r} tools run on OpenAI's side; this server serves "
                                 "function tools only (give the model a function that does it)")


_FIELD_NAMES = frozenset(
    name for model in (ResponsesRequest, MessageItem, InputText, OutputText, Refusal, FunctionCallItem,
                       FunctionCallOutputItem, ReasoningItem, ReasoningText, SummaryText, FunctionTool, NamedFunction,
                       TextConfig, TextFormat, Reasoning, StreamOptions, PromptCacheOptions)
    for name in model.model_fields
) | {"schema"}


# -- to the chat path -----------------------------------------------------------------------
def items_to_messages(items: list[InputItem]) -> list[dict[str, Any]]:
    """Input items as chat messages (the module docstring's mapping)."""
    out: list[dict[str, Any]] = []
    turn: dict[str, Any] | None = None  # the assistant turn being gathered
    for item in items:
        if isinstance(item, FunctionCallOutputItem):
            turn = None
            out.append({"role": "tool", "tool_call_id": item.call_id, "content": item.text()})
        elif isinstance(item, MessageItem) and item.role != "assistant":
            turn = None
            out.append({"role": item.role, "content": item.text()})
        else:
            if turn is None or (isinstance(item, ReasoningItem) and (turn.get("content") or turn.get("tool_calls"))):
                turn = {"role": "assistant", "content": None}
                out.append(turn)
            _add_to_turn(turn, item)
    return out


def _add_to_turn(turn: dict[str, Any], item: InputItem) -> None:
    if isinstance(item, ReasoningItem):
        text = "".join(c.text for c in item.content or []) or "".join(s.text for s in item.summary)
        turn["reasoning_content"] = (turn.get("reasoning_content") or "") + text
    elif isinstance(item, FunctionCallItem):
        turn.setdefault("tool_calls", []).append(
            {"id": item.call_id, "type": "function", "function": {"name": item.name, "arguments": item.arguments}})
    else:
        assert isinstance(item, MessageItem)
        turn["content"] = (turn.get("content") or "") + item.text()


def to_chat_body(req: ResponsesRequest, history: list[dict[str, Any]]) -> dict[str, Any]:
    """The chat request this Responses request is served as; ``history`` is the chained
    conversation (chat messages, no instructions)."""
    system = [{"role": "system", "content": req.instructions}] if req.instructions is not None else []
    body: dict[str, Any] = {"model": req.model, "messages": [*system, *history, *items_to_messages(req.input)]}
    if req.tools:
        body["tools"] = [{"type": "function", "function": t.model_dump(exclude={"type"}, exclude_none=True)}
                         for t in req.tools]
    if req.tool_choice is not None:
        body["tool_choice"] = (req.tool_choice if isinstance(req.tool_choice, str) else
                               {"type": "function", "function": {"name": req.tool_choice.name}})
    fmt = req.text.format if req.text is not None else None
    if fmt is not None:
        body["response_format"] = _response_format(fmt)
    effort = req.reasoning.effort if req.reasoning is not None else None
    pairs = {"temperature": req.temperature, "top_p": req.top_p, "max_tokens": req.max_output_tokens,
             "parallel_tool_calls": req.parallel_tool_calls, "user": req.user, "reasoning_effort": effort,
             "stream": req.stream or None}
    body.update({k: v for k, v in pairs.items() if v is not None})
    if req.logprobs():
        body["logprobs"] = True
        body["top_logprobs"] = req.top_logprobs or 0
    return body


def _response_format(fmt: TextFormat) -> dict[str, Any]:
    if fmt.type != "json_schema":
        return {"type": fmt.type}
    spec = {"name": fmt.name or "output", "schema": fmt.schema_, "strict": fmt.strict, "description": fmt.description}
    return {"type": "json_schema", "json_schema": {k: v for k, v in spec.items() if v is not None}}


CHAT_TO_RESPONSES_PARAM = {"messages": "input", "max_tokens": "max_output_tokens", "response_format": "text.format",
                           "reasoning_effort": "reasoning.effort", "top_logprobs": "top_logprobs"}
"""A chat parameter named in an error of the served chat request -> the Responses field it came from."""


def responses_param(param: str | None) -> str | None:
    """The Responses field behind a chat parameter path (``tools.0.function.strict`` ->
    ``tools.0.strict``); messages are named ``input`` (their indices count the instructions and
    the chained history too)."""
    if param is None:
        return None
    head, _, rest = param.partition(".")
    if head == "tools":
        return param.replace(".function.", ".", 1)
    mapped = CHAT_TO_RESPONSES_PARAM.get(head, head)
    return f"{mapped}.{rest}" if rest and head != "messages" else mapped
