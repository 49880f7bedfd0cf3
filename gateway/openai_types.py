"""OpenAI chat-completions wire format: the request the gateway accepts and the responses it sends.

Requests are strict: a field this server does not implement is a 400 naming it, never a silent
ignore. Every field OpenAI documents is implemented, accepted with a stated meaning that changes
nothing served or trained (``service_tier``, ``prompt_cache_key``, ``safety_identifier``,
``metadata`` ...: ``NO_EFFECT``), or refused with the reason (``REFUSED``); docs/live.md has the
table. Assistant messages a client echoes back from our own responses may carry the null fields
the SDK keeps (``refusal``, ``function_call``, ``audio``, ``annotations``). Parameters that need
constrained decoding (``tool_choice`` required or named, ``strict`` tools, JSON
``response_format``) parse here; the service checks the engine can (``gateway.constraints``).

Responses serialise the way OpenAI's do (nulls where OpenAI sends nulls, absent where it omits
the field), so the official ``openai`` SDK and raw-JSON clients both read them.
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_serializer, model_validator

from gateway.errors import InvalidRequest, from_validation
from rollout.engines.base import SEED_RANGE

# OpenAI parameters this endpoint knows but refuses, and why: named in the 400 as unsupported
# rather than unknown, so a client learns the server read the name and what to do instead.
REFUSED = {
    "audio": "audio output needs an audio model; this server serves a text policy",
    "functions": "the deprecated functions API is not served; send tools instead",
    "function_call": "the deprecated functions API is not served; send tool_choice instead",
    "web_search_options": "this server runs no web search; give the model a search tool instead",
    "moderation": "this server runs no moderation model; moderate before or after calling it",
}
NO_EFFECT = ("service_tier", "prompt_cache_key", "prompt_cache_retention", "prompt_cache_options",
             "safety_identifier", "metadata", "verbosity", "prediction", "user")
"""Accepted fields that change nothing served or trained (each one's meaning is in its field's
docstring). ``user`` also keys the session when no ``X-Session-Id`` header does."""
MAX_N = 16
MAX_TOP_LOGPROBS = 20
REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh", "max")


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


# -- request --------------------------------------------------------------------------------
class PromptCacheBreakpoint(_Strict):
    ttl: Literal["30m"] | None = None


class TextPart(_Strict):
    """A text content part (the only part type a text model can take)."""

    type: Literal["text"]
    text: str
    prompt_cache_breakpoint: PromptCacheBreakpoint | None = None
    """No effect: the engines' prefix cache needs no breakpoints."""


class PromptCacheOptions(_Strict):
    """OpenAI's prompt-cache options, accepted with no effect."""

    mode: Literal["implicit", "explicit"] | None = None
    ttl: Literal["30m"] | None = None


class FunctionCall(_Strict):
    name: str
    arguments: str
    """The call's arguments as a JSON string (OpenAI's convention)."""


class ToolCall(_Strict):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class Message(_Strict):
    """One request message. Per-role rules are checked after parsing so an error names the
    message's own field (``messages.2.tool_call_id``)."""

    role: Literal["developer", "system", "user", "assistant", "tool"]
    """``developer`` is rendered as ``system`` (OpenAI's newer name for it)."""
    content: str | list[TextPart] | None = None
    name: str | None = None
    """The participant's name: kept in the recorded message and passed to the chat template,
    which shows it where its format has a place for one (the built-in formats have none)."""
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None
    """An assistant message's reasoning, as our responses (and vLLM's) carry it."""
    # Echoed back by SDK clients that append our response message as-is; only null is accepted.
    refusal: None = None
    function_call: None = None
    audio: None = None
    annotations: list[Any] | None = Field(None, max_length=0)
    provider_specific_fields: dict[str, Any] | None = None
    """litellm keeps this on the assistant messages it returns and sends it back with them;
    ignored (it says nothing to the model)."""

    @model_validator(mode="after")
    def _per_role(self) -> "Message":
        if self.tool_calls is not None and self.role != "assistant":
            raise ValueError(f"tool_calls is only allowed on assistant messages, not {self.role}")
        if self.role == "tool" and self.tool_call_id is None:
            raise ValueError("a tool message needs tool_call_id (the id of the call it answers)")
        if self.reasoning_content is not None and self.role != "assistant":
            raise ValueError(f"reasoning_content is only allowed on assistant messages, not {self.role}")
        if self.role != "tool" and self.tool_call_id is not None:
            raise ValueError(f"tool_call_id is only allowed on tool messages, not {self.role}")
        if self.role != "assistant" and self.content is None:
            raise ValueError(f"a {self.role} message needs content")
        return self

    def text(self) -> str:
        """Content as one string (text parts joined)."""
        if isinstance(self.content, list):
            return "".join(p.text for p in self.content)
        return self.content or ""


class FunctionDef(_Strict):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None
    """True: a call of this tool follows ``parameters`` (constrained decoding, ``gateway.constraints``)."""


class Tool(_Strict):
    type: Literal["function"]
    function: FunctionDef


class StreamOptions(_Strict):
    include_usage: bool = False
    include_obfuscation: bool | None = None
    """No effect: chunks carry no obfuscation padding (it guards OpenAI's side channels)."""


class Prediction(_Strict):
    """OpenAI's predicted output (``prediction``), accepted with no effect."""

    type: Literal["content"]
    content: str | list[TextPart]


class NamedFunction(_Strict):
    name: str


class NamedToolChoice(_Strict):
    """``tool_choice`` naming one function: the reply is one call of it."""

    type: Literal["function"]
    function: NamedFunction


class JsonSchemaSpec(_Strict):
    name: str
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    """The JSON schema the reply follows (absent: any JSON object)."""
    strict: bool | None = None
    """Always enforced here: the reply is sampled under the schema."""


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaSpec | None = None

    @model_validator(mode="after")
    def _schema_with_type(self) -> "ResponseFormat":
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise InvalidRequest("response_format.json_schema", "response_format json_schema needs its "
                                 "json_schema ({'name': ..., 'schema': {...}}), and only that type takes one")
        return self


class ChatCompletionRequest(_Strict):
    """``POST /v1/chat/completions`` body. Parse with :func:`parse_chat_request`."""

    messages: list[Message] = Field(min_length=1)
    model: str | None = None
    """Must be the served model's id (``live.model_name``; absent: that one); any other is a 404
    ``model_not_found``, as OpenAI answers."""
    tools: list[Tool] | None = None
    tool_choice: Literal["auto", "none", "required"] | NamedToolChoice | None = None
    """``required`` and a named function are constrained decoding (engines with it: vLLM)."""
    n: int = Field(1, ge=1, le=MAX_N)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    stop: str | list[str] | None = Field(None, max_length=4)
    """Up to 4 strings; the reply ends where one is first written and leaves it out."""
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    """The most likely alternatives per token, under the distribution the token was sampled from."""
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    seed: int | None = Field(None, ge=0, lt=SEED_RANGE)
    """Reproducible sampling: the same request with the same seed samples the same tokens on
    the same weights version (choice ``i`` of ``n`` is seeded ``seed + i``)."""
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    """Subtracted from the logit of every token already in the reply (the engine's sampler). A
    turn sampled with it is recorded with that distribution's log-probs and marked
    (``LiveOrigin.constrained``): kept out of the loss unless ``train_constrained``."""
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    """Subtracted once per earlier occurrence in the reply; marked as ``presence_penalty`` is."""
    logit_bias: dict[str, float] | None = None
    """Token id (as a string, OpenAI's JSON) -> bias in [-100, 100] added to its logit; marked as
    ``presence_penalty`` is."""
    parallel_tool_calls: bool | None = None
    """False: the reply ends once its first call is complete (the rest is never sampled;
    ``LiveOrigin.ended_early`` records it). True or absent: any number of calls."""
    reasoning_effort: Literal[REASONING_EFFORTS] | None = None  # type: ignore[valid-type]
    """A reasoning format (``qwen3``): ``none`` and ``minimal`` turn thinking off (the empty
    think block Qwen3's template writes for ``enable_thinking: false`` opens the reply), any
    other value leaves it on. A format without reasoning: no effect."""
    modalities: list[Literal["text"]] | None = None
    """Only ``["text"]`` (what a text policy writes anyway)."""
    service_tier: Literal["auto", "default", "flex", "scale", "priority", "fast"] | None = None
    """No effect: every request is served the same way, in arrival order."""
    prompt_cache_key: str | None = None
    """No effect: the engines' prefix cache serves every request that shares a prefix."""
    prompt_cache_retention: Literal["in-memory", "in_memory", "24h"] | None = None
    """No effect: cached prefixes stay while the engine's memory and ``stale_kv_versions`` allow."""
    prompt_cache_options: PromptCacheOptions | None = None
    """No effect, as ``prompt_cache_retention``."""
    safety_identifier: str | None = None
    """No effect (OpenAI's abuse tracking); not recorded."""
    verbosity: Literal["low", "medium", "high"] | None = None
    """No effect: the served policy's replies are what it learned to write; rewriting the prompt
    to steer length would record turns the policy was not asked."""
    prediction: Prediction | None = None
    """No effect: OpenAI's predicted outputs only speed a reply up, and this server has no such
    speculative path; the reply is the same either way."""
    response_format: ResponseFormat | None = None
    """``text`` (what a reply is anyway), or the JSON modes ``json_object`` / ``json_schema``,
    which are constrained decoding (engines with it: vLLM)."""
    store: Literal[False] | None = None
    """Only false: nothing is kept for OpenAI's stored-completions API (the run records every
    session its own way, docs/live.md)."""
    metadata: dict[str, str] | None = None
    """Tags OpenAI keeps with a stored completion; accepted and ignored, as they change nothing
    served or recorded."""

    @model_validator(mode="after")
    def _consistent(self) -> "ChatCompletionRequest":
        # Raised as InvalidRequest (not ValueError) so pydantic passes it on with its param.
        if self.max_tokens is not None and self.max_completion_tokens is not None \
                and self.max_tokens != self.max_completion_tokens:
            raise InvalidRequest("max_tokens", "max_tokens and max_completion_tokens disagree; "
                                 "send one of them")
        if self.stream_options is not None and not self.stream:
            raise InvalidRequest("stream_options", "stream_options needs stream: true")
        empty = [i for i, text in enumerate(self.stop_list()) if not text]
        if empty:
            raise InvalidRequest("stop" if isinstance(self.stop, str) else f"stop.{empty[0]}",
                                 "a stop string must not be empty")
        if self.top_logprobs and not self.logprobs:
            raise InvalidRequest("top_logprobs", "top_logprobs needs logprobs: true")
        for key, bias in (self.logit_bias or {}).items():
            if not key.isdigit():
                raise InvalidRequest(f"logit_bias.{key}", "logit_bias keys are token ids (as strings)")
            if not -100 <= bias <= 100:
                raise InvalidRequest(f"logit_bias.{key}", "a logit bias must be between -100 and 100")
        return self

    def bias_pairs(self, vocab_size: int) -> tuple[tuple[int, float], ...]:
        """``logit_bias`` as (token id, bias) pairs; a 400 naming an id the tokenizer lacks."""
        pairs = tuple((int(k), float(v)) for k, v in (self.logit_bias or {}).items())
        for tid, _ in pairs:
            if tid >= vocab_size:
                raise InvalidRequest(f"logit_bias.{tid}", f"token id {tid} is not in the served "
                                     f"tokenizer's vocabulary of {vocab_size}")
        return pairs

    def max_new_tokens(self, default: int) -> int:
        """The completion token limit (``max_completion_tokens``, else ``max_tokens``)."""
        return self.max_completion_tokens or self.max_tokens or default

    def stop_list(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    def stop_token_ids(self, tokenizer: Any) -> tuple[int, ...]:
        """The ``stop`` strings that are exactly one token of the served tokenizer, as engine
        stop tokens: the engine ends on them at once. Every stop string, one token or more, is
        also watched for in the decoded text (``gateway.responses.StopWatch``)."""
        out = []
        for text in self.stop_list():
            ids = tokenizer(text, add_special_tokens=False)["input_ids"]
            if len(ids) == 1:
                out.append(ids[0])
        return tuple(out)

    def tool_dicts(self) -> list[dict[str, Any]]:
        """Tools as the chat template takes them (none when ``tool_choice`` is ``none``: the
        model is not offered tools it may not call)."""
        if not self.tools or self.tool_choice == "none":
            return []
        return [t.model_dump(exclude_none=True) for t in self.tools]



def parse_chat_request(body: Any) -> ChatCompletionRequest:
    """Validate a request body; raises InvalidRequest naming the first bad parameter."""
    if not isinstance(body, dict):
        raise InvalidRequest(None, "the request body must be a JSON object")
    for key in body:
        if key in REFUSED:
            raise InvalidRequest(key, f"'{key}' is not supported by this server: {REFUSED[key]}")
        if key not in ChatCompletionRequest.model_fields:
            raise InvalidRequest(key, f"unknown parameter '{key}'")
    try:
        return ChatCompletionRequest.model_validate(body)
    except ValidationError as exc:
        raise _named(exc) from None


def _named(exc: ValidationError) -> InvalidRequest:
    """Clearer messages for the unsupported choices; the field path either way."""
    err = from_validation(exc, _FIELD_NAMES)
    hints = {
        "tool_choice": "tool_choice must be 'auto', 'none', 'required' or "
                       "{'type': 'function', 'function': {'name': ...}}",
        "stop": "stop takes a string or a list of at most 4 strings",
        "top_logprobs": f"top_logprobs must be an integer from 0 to {MAX_TOP_LOGPROBS}",
        "presence_penalty": "presence_penalty must be a number from -2 to 2",
        "frequency_penalty": "frequency_penalty must be a number from -2 to 2",
        "reasoning_effort": f"reasoning_effort must be one of {', '.join(REASONING_EFFORTS)}",
        "modalities": "modalities may only be ['text'] (this server serves a text policy)",
        "store": "store must be false (completions are not stored for retrieval)",
    }
    if err.param is not None and err.param.startswith("tool_choice"):
        return InvalidRequest("tool_choice", hints["tool_choice"])
    return InvalidRequest(err.param, hints[err.param]) if err.param in hints else err


_FIELD_NAMES = frozenset(
    name for model in (ChatCompletionRequest, Message, TextPart, ToolCall, FunctionCall, Tool,
                       FunctionDef, StreamOptions, NamedToolChoice, NamedFunction, ResponseFormat, JsonSchemaSpec,
                       Prediction, PromptCacheOptions, PromptCacheBreakpoint)
    for name in model.model_fields
) | {"schema"}


# -- responses ------------------------------------------------------------------------------
class _Wire(BaseModel):
    """Serialises like OpenAI: fields in ``_omit_if_none`` are left out when None, all others
    are always present (None as null)."""

    _omit_if_none: ClassVar[frozenset[str]] = frozenset()

    @model_serializer(mode="wrap")
    def _drop_absent(self, handler: Any) -> dict[str, Any]:
        data = handler(self)
        return {k: v for k, v in data.items() if not (k in self._omit_if_none and v is None)}

    def wire(self) -> dict[str, Any]:
        """The JSON body."""
        return self.model_dump(mode="json")


class TopLogprob(_Wire):
    token: str
    logprob: float
    bytes: list[int] | None


class TokenLogprob(_Wire):
    token: str
    logprob: float
    bytes: list[int] | None
    """UTF-8 bytes of ``token``; null where one token holds part of a character."""
    top_logprobs: list[TopLogprob] = []


class ChoiceLogprobs(_Wire):
    content: list[TokenLogprob] | None
    refusal: None = None


class OutFunction(_Wire):
    name: str
    arguments: str


class OutToolCall(_Wire):
    id: str
    type: Literal["function"] = "function"
    function: OutFunction


class AssistantMessage(_Wire):
    _omit_if_none = frozenset({"tool_calls", "reasoning_content"})
    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[OutToolCall] | None = None
    reasoning_content: str | None = None
    """The reasoning the chat format split off (``qwen3``'s ``<think>``), under vLLM's name."""


OpenAIFinish = Literal["stop", "length", "tool_calls"]


class Choice(_Wire):
    index: int
    message: AssistantMessage
    finish_reason: OpenAIFinish
    logprobs: ChoiceLogprobs | None = None


class Usage(_Wire):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class ChatCompletion(_Wire):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[Choice]
    usage: Usage
    system_fingerprint: str | None = None
    """``turnrl-v<version>``: the weights version that began the first choice."""


class DeltaFunction(_Wire):
    _omit_if_none = frozenset({"name", "arguments"})
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(_Wire):
    _omit_if_none = frozenset({"id", "type", "function"})
    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunction | None = None


class Delta(_Wire):
    _omit_if_none = frozenset({"role", "content", "tool_calls", "reasoning_content"})
    role: Literal["assistant"] | None = None
    content: str | None = None
    """Absent when None, but on the first delta (the one with ``role``), which carries it as
    OpenAI does: ``""`` before text, null before a tool call."""
    tool_calls: list[DeltaToolCall] | None = None
    reasoning_content: str | None = None

    @model_serializer(mode="wrap")
    def _first_keeps_content(self, handler: Any) -> dict[str, Any]:
        data = handler(self)
        keep = {"content"} if self.role is not None else set()
        return {k: v for k, v in data.items() if not (k in self._omit_if_none - keep and v is None)}


class ChunkChoice(_Wire):
    index: int
    delta: Delta
    finish_reason: OpenAIFinish | None = None
    logprobs: ChoiceLogprobs | None = None


class ChatCompletionChunk(_Wire):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChunkChoice]
    usage: Usage | None = None
    """Set on the final chunk (empty ``choices``) when ``stream_options.include_usage``; every
    other chunk of such a stream carries it as null (``usage_field``), OpenAI's documented shape."""
    system_fingerprint: str | None = None
    usage_field: bool = Field(False, exclude=True)
    """The stream asked for usage: ``usage`` is sent even when null."""

    @model_serializer(mode="wrap")
    def _usage_when_asked(self, handler: Any) -> dict[str, Any]:
        data = handler(self)
        if data.get("usage") is None and not self.usage_field:
            data.pop("usage", None)
        return data


class ModelCard(_Wire):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "turnrl"
    version: int
    """The weights version the run's engines serve now (a TurnRL field)."""


class ModelList(_Wire):
    object: Literal["list"] = "list"
    data: list[ModelCard]
