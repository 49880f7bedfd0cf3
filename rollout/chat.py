"""Chat rendering in token space: prompts, and the tokens appended after each action.

The model's action ends with its end-of-turn token (the tokenizer's eos). Everything the
rollout adds after it -- the template's trailer after end-of-turn, the tool messages and the
next assistant header -- is computed once as text by the tokenizer's own chat template and
tokenized on its own, so actions are never re-tokenized and earlier turns never re-rendered.

That delta is the text the template puts after the end of an assistant turn when ``messages``
follow it, read from one full render (``observation_text``). It does not need the template to
be append-only: Qwen3's drops an earlier turn's ``<think>`` once a new message follows, others
re-render history; the kept token ids stay what the engine saw and sampled, and only the new
messages' text is added (so a later prompt can differ from what a fresh render of the whole
conversation would give: that is what token-exact training on sampled tokens means).

The policy's chat format (``envs.formats``) fills what a template lacks: for a template that
renders no ``tools`` (SmolLM2's) the format's tools prompt goes into the system message, and
for one that renders no ``tool_calls`` the format writes the calls into the assistant content.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from envs.formats import DEFAULT_FORMAT, ChatFormat, ToolCall, demo_text, get_format

_BASE = [{"role": "user", "content": "x"}]
_SENTINEL = "turnrl-end-of-assistant-turn-7d1e"
_PROBE = "turnrl_probe_tool_4f1c"


@dataclass(frozen=True)
class TemplateSupport:
    """What a chat template renders of its own (probed once per template text)."""

    tools: bool
    """It shows ``tools=`` schemas."""
    tool_calls: bool
    """It writes an assistant message's ``tool_calls``."""


_SUPPORT: dict[str, TemplateSupport] = {}


def template_support(tokenizer: Any) -> TemplateSupport:
    """Whether the template renders tools and tool calls: each rendered with and without a
    probe; a probe that leaves no trace is not rendered (a template that raises on the probe
    is taken to render it: it looked)."""
    key = tokenizer.chat_template or ""
    if key not in _SUPPORT:
        probe = {"type": "function", "function": {"name": _PROBE, "description": "probe",
                                                  "parameters": {"type": "object", "properties": {}}}}
        call = {"role": "assistant", "content": "", "tool_calls": [
            {"id": "call_probe0", "type": "function", "function": {"name": _PROBE, "arguments": {}}}]}
        _SUPPORT[key] = TemplateSupport(tools=_shows(tokenizer, _BASE, [probe]),
                                        tool_calls=_shows(tokenizer, [*_BASE, call], None))
    return _SUPPORT[key]


def _shows(tokenizer: Any, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> bool:
    try:
        return _PROBE in tokenizer.apply_chat_template(messages, tools=tools, tokenize=False)
    except Exception:  # noqa: BLE001 - a template's own raise_exception: it inspected the input
        return True


def prepare(tokenizer: Any, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
            chat_format: str | ChatFormat = DEFAULT_FORMAT) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """Messages and tools as this template can render them, the format filling its gaps."""
    fmt, support = get_format(chat_format), template_support(tokenizer)
    if not support.tool_calls:
        messages = [_calls_as_content(m, fmt) if m.get("tool_calls") else m for m in messages]
    if tools and not support.tools:
        text = fmt.tools_prompt(tools)
        if messages and messages[0]["role"] == "system":
            messages = [{**messages[0], "content": f"{messages[0]['content']}\n\n{text}"}, *messages[1:]]
        else:
            messages = [{"role": "system", "content": text}, *messages]
        tools = None
    return messages, tools or None


def _calls_as_content(msg: dict[str, Any], fmt: ChatFormat) -> dict[str, Any]:
    calls = []
    for c in msg["tool_calls"]:
        f = c.get("function", c)
        args = f.get("arguments") or {}
        if isinstance(args, str):  # a client's malformed arguments: shown as an empty object
            try:
                args = json.loads(args)
            except json.JSONDecodeError:
                args = {}
        calls.append(ToolCall(name=f["name"], arguments=args if isinstance(args, dict) else {}))
    out = {k: v for k, v in msg.items() if k not in ("tool_calls", "reasoning_content")}
    out["content"] = fmt.render(msg.get("content") or None, calls)
    return out


def prompt_text(tokenizer: Any, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
                chat_format: str | ChatFormat = DEFAULT_FORMAT) -> str:
    """The rendered opening messages plus the assistant header."""
    messages, tools = prepare(tokenizer, messages, tools, chat_format)
    return tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=False)


def prompt_ids(tokenizer: Any, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
               chat_format: str | ChatFormat = DEFAULT_FORMAT) -> list[int]:
    """Token ids of the opening messages plus the assistant header."""
    return tokenizer(prompt_text(tokenizer, messages, tools, chat_format), add_special_tokens=False)["input_ids"]


def observation_text(tokenizer: Any, messages: list[dict[str, Any]],
                     chat_format: str | ChatFormat = DEFAULT_FORMAT) -> str:
    """Template text that follows an assistant turn's end-of-turn token when ``messages``
    (tool results, a user reply) follow it, through the next assistant header: the part of a
    full render after that turn. Raises ValueError when the template shows no end-of-turn
    after an assistant message (then no delta exists: the caller renders in full)."""
    messages, _ = prepare(tokenizer, messages, None, chat_format)
    base = [*_BASE, {"role": "assistant", "content": _SENTINEL}]
    full = tokenizer.apply_chat_template(base + messages, add_generation_prompt=True, tokenize=False)
    alone = tokenizer.apply_chat_template(base, tokenize=False)
    # The assistant turn must end the same way whether or not messages follow (its end is
    # in the kept tokens); what comes before it may change (that is the point).
    ending, cut = _turn_end(full, tokenizer.eos_token), _turn_end(alone, tokenizer.eos_token)
    if ending is None or cut is None or full[ending[0]:ending[1]] != alone[cut[0]:cut[1]]:
        raise ValueError("the chat template ends an assistant turn differently when more messages follow "
                         "it (or with no end-of-turn token): no delta can be appended to the sampled tokens")
    return full[ending[1]:]


def check_template(tokenizer: Any, chat_format: str | ChatFormat = DEFAULT_FORMAT) -> None:
    """Refuse, before any episode runs, a template that multi-turn episodes cannot continue
    after an action (``observation_text`` raises for it): episodes would otherwise fail one by
    one mid-run. The live endpoint renders such conversations in full instead (a new segment
    per request, gateway/sessions.py); a rollout's trajectory is one token sequence and cannot."""
    probe = [{"role": "tool", "name": "search", "content": "result"}, {"role": "user", "content": "go on"}]
    try:
        observation_text(tokenizer, probe[:1], chat_format)
        observation_text(tokenizer, probe[1:], chat_format)
    except ValueError as exc:
        name = getattr(tokenizer, "name_or_path", "") or "the policy's tokenizer"
        raise ValueError(f"chat template of {name}: {exc}. Multi-turn episodes append the environment's "
                         "messages to the sampled tokens, which needs an assistant turn to end the same way "
                         "whatever follows it; use a policy whose template does (or set its chat_template "
                         "in tokenizer_config.json)") from exc


def _turn_end(text: str, eos: str) -> tuple[int, int] | None:
    """(start, end) of the text from the sentinel's end through the next end-of-turn token."""
    at = text.rfind(_SENTINEL)
    cut = text.find(eos, at) if at >= 0 else -1
    return None if cut < 0 else (at + len(_SENTINEL), cut + len(eos))


def observation_ids(tokenizer: Any, messages: list[dict[str, Any]], action_ended: bool,
                    chat_format: str | ChatFormat = DEFAULT_FORMAT) -> list[int]:
    """Tokens appended after an action. ``action_ended``: the action already ends with eos;
    otherwise (cut by the token limit) the eos is supplied here, outside the loss."""
    ids = [] if action_ended else [tokenizer.eos_token_id]
    text = observation_text(tokenizer, messages, chat_format)
    return ids + tokenizer(text, add_special_tokens=False)["input_ids"]


def decode_action(tokenizer: Any, token_ids: list[int], chat_format: str | ChatFormat = DEFAULT_FORMAT) -> str:
    """Text of generated ids: special tokens (end-of-turn) dropped, except the ones the chat
    format's syntax uses (``[TOOL_CALLS]``, ``<|python_tag|>``)."""
    drop = _dropped(tokenizer, get_format(chat_format))
    if drop is None:
        return tokenizer.decode(list(token_ids), skip_special_tokens=True)
    return tokenizer.decode([t for t in token_ids if t not in drop], skip_special_tokens=False)


def _dropped(tokenizer: Any, fmt: ChatFormat) -> set[int] | None:
    """The special ids an action's text leaves out; None: all of them (the format keeps none)."""
    if not fmt.markers:
        return None
    return set(tokenizer.all_special_ids) - {tokenizer.convert_tokens_to_ids(m) for m in fmt.markers}


class StreamDecoder:
    """``decode_action``'s text of a growing completion, its newest tokens decoded alone.

    Decoding the whole completion at every token costs O(n) a token: 0.8 ms a token at 3.3k
    tokens and 2.9 ms at 13k (the gateway's streams, measured by the chat-format work). This
    steps tokenizers' own ``DecodeStream`` (which holds a split multi-byte character back until
    its last byte). Its text is checked against a full decode whenever the token count doubles
    (linear in all); from the first disagreement, or for a tokenizer without a Rust backend,
    every call decodes in full. A character still incomplete is left out, as it is of
    ``text`` until the rest arrives."""

    def __init__(self, tokenizer: Any, chat_format: str | ChatFormat = DEFAULT_FORMAT) -> None:
        from tokenizers.decoders import DecodeStream

        self.tokenizer, self.format = tokenizer, get_format(chat_format)
        self.ids: list[int] = []
        self.text = ""
        self._drop = _dropped(tokenizer, self.format)
        self._backend = getattr(tokenizer, "_tokenizer", None)
        self._stream = DecodeStream(skip_special_tokens=self._drop is None) if self._backend is not None else None
        self._check_at = 1

    def push(self, token_ids: list[int]) -> str:
        """Add tokens; the text so far (complete characters only)."""
        self.ids += token_ids
        if self._stream is None:
            self.text = decode_action(self.tokenizer, self.ids, self.format).rstrip("\ufffd")
            return self.text
        for t in token_ids:
            if self._drop is None or t not in self._drop:
                self.text += self._stream.step(self._backend, t) or ""
        if len(self.ids) >= self._check_at:
            self._check_at = 2 * len(self.ids)
            full = decode_action(self.tokenizer, self.ids, self.format).rstrip("\ufffd")
            if full != self.text:
                self._stream, self.text = None, full
        return self.text


def action_ids(tokenizer: Any, content: str, chat_format: str | ChatFormat = DEFAULT_FORMAT) -> list[int]:
    """Tokens of a demonstration's assistant message, ending with end-of-turn (for SFT).
    Demonstrations are written in the default (Hermes) syntax; another format rewrites them."""
    return text_ids(tokenizer, demo_text(content, chat_format))


def text_ids(tokenizer: Any, text: str) -> list[int]:
    """Tokens of an assistant message already in the policy's format, ending with end-of-turn."""
    return tokenizer(text, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
