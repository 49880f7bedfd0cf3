"""What every chat format shares: the parsed shapes, the scan of a (possibly unfinished)
assistant message, and the reading of one JSON call body.

A format's ``scan`` reads the text decoded so far into reasoning, content and call drafts.
It is a pure function of the text, so the streaming parser (``envs.formats.stream``) and the
whole-message split agree by construction: the stream sends the growth of the same scan, and
what a scan of an unfinished text reports is always a prefix of what the finished text gives
(text that could still change -- a half-written tag, an open block without a name -- is held
back). A call block counts as a call once its name is read; its ``arguments`` are the JSON
text the model wrote, as OpenAI's ``arguments`` string carries it (it may be invalid JSON,
which OpenAI's own API allows). A malformed call is an error for the environment to show the
model, never an exception.
"""

from __future__ import annotations

import json
import re
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel, ConfigDict

ANSWER_RE = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_DECODER = json.JSONDecoder()
_NAME_RE = re.compile(r'"name"\s*:\s*("(?:[^"\\]|\\.)*")')


class ToolCall(BaseModel):
    """One parsed call: a tool name and its JSON arguments."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str
    """The tool's name as the model wrote it."""
    arguments: dict[str, Any] = {}
    """The call's arguments, a JSON object."""


@dataclass
class ParsedAction:
    """What one assistant message asked for (what environments read)."""

    calls: list[ToolCall] = field(default_factory=list)
    """Well-formed calls, in the order written."""
    errors: list[str] = field(default_factory=list)
    """One message per malformed call, phrased for the model to read."""
    answer: str | None = None
    """Text inside the first ``<answer>`` block of the content, if any."""
    balanced: bool = True
    """False when ``<answer>`` or the format's call tags do not pair up."""
    reasoning: str | None = None
    """The message's reasoning (``<think>``), split off; None when there is none."""


@dataclass
class CallDraft:
    """One call block as far as it is written."""

    name: str | None = None
    """The tool name, once its string is complete; None before (or never: not a call)."""
    arguments: str = ""
    """The arguments' JSON text so far (final once ``closed``): OpenAI's ``arguments``."""
    streamable: bool = False
    """The arguments are a JSON object being written: their text only grows, so fragments can
    go out before the block closes. Otherwise (a JSON string, missing) they go out at close."""
    closed: bool = False
    """The block is complete (its closing tag or bracket was written)."""
    call: ToolCall | None = None
    """The parsed call, set when the finished block is well formed."""
    error: str | None = None
    """Why the finished block is malformed (set only once it is finished)."""
    span: tuple[int, int] | None = None
    """Set by an incremental scanner instead of ``arguments`` while they are being written:
    where they lie in the scanned text (``envs.formats.incremental``)."""


@dataclass
class Scan:
    """An assistant text read by a format."""

    reasoning: str = ""
    """Reasoning text decided so far (raw, unstripped)."""
    content: str = ""
    """Content decided so far: text outside call blocks, plus blocks that turned out not to be
    calls (raw, unstripped)."""
    calls: list[CallDraft] = field(default_factory=list)
    """Named call blocks in order."""
    errors: list[str] = field(default_factory=list)
    """Errors of finished blocks (calls' and non-calls') in order."""


@dataclass
class Split:
    """A finished assistant message as the client and the environment see it."""

    content: str | None
    """Content, stripped; None when nothing is left (OpenAI's null)."""
    reasoning: str | None
    """Reasoning, stripped; None when there is none."""
    calls: list[CallDraft]
    """Every named call (well formed or not), in order."""
    errors: list[str]
    """Why each malformed block is malformed."""

    def valid_calls(self) -> list[ToolCall]:
        return [d.call for d in self.calls if d.call is not None]


def partial_suffix(text: str, tag: str) -> int:
    """Length of the longest proper suffix of ``text`` that begins ``tag``."""
    return next((n for n in range(min(len(tag) - 1, len(text)), 0, -1) if text.endswith(tag[:n])), 0)


def read_json_call(body: str, done: bool, arg_keys: tuple[str, ...]) -> CallDraft:
    """A call body ``{"name": ..., "<arg key>": {...}}`` as far as written. ``done``: the body
    is finished (validate it and set ``call`` or ``error``)."""
    return read_json_head(body, done, arg_keys)[0]


def read_json_head(body: str, done: bool, arg_keys: tuple[str, ...]) -> tuple[CallDraft, int | None]:
    """``read_json_call``, and where the arguments value starts in ``body`` while it is begun
    but does not decode yet (else None): then the name and that start stay as they are until
    the value is complete (the streaming shortcut, ``envs.formats.incremental``)."""
    draft, value_at = CallDraft(), None
    arg = re.search(r'"(?:' + "|".join(arg_keys) + r')"\s*:\s*', body)
    name_region = body
    if arg:
        start = arg.end()
        draft.streamable = body[start:start + 1] == "{"
        try:
            _, end = _DECODER.raw_decode(body, start)
            draft.arguments = body[start:end]
            # The name may follow the arguments; never look for it inside them.
            name_region = body[:arg.start()] + body[end:]
        except ValueError:
            draft.arguments = body[start:]
            name_region = body[:arg.start()]
            value_at = start if start < len(body) else None
    name = _NAME_RE.search(name_region)
    if name:
        try:
            draft.name = json.loads(name.group(1))
        except json.JSONDecodeError:
            draft.name = None
    if done:
        _validate(draft, body, arg_keys)
        draft.arguments = draft.arguments or "{}"  # none written: nothing of them was streamed
    return draft, value_at


def _validate(draft: CallDraft, body: str, arg_keys: tuple[str, ...]) -> None:
    try:
        obj = json.loads(body)
    except json.JSONDecodeError as exc:
        draft.error = f"tool call is not valid JSON ({exc.msg} at char {exc.pos})"
        return
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        draft.error = 'tool call must be a JSON object with a string "name"'
        return
    if draft.name is None:  # a name read while streaming stays (it was sent)
        draft.name = obj["name"]
    key = next((k for k in arg_keys if k in obj), None)
    args = obj.get(key, {}) if key else {}
    if isinstance(args, str):  # some models double-encode arguments
        try:
            args, draft.arguments = json.loads(args), args
        except json.JSONDecodeError:
            draft.error = f'"{arg_keys[0]}" must be a JSON object'
            return
    if not isinstance(args, dict):
        draft.error = f'"{arg_keys[0]}" must be a JSON object'
        return
    if not key:
        draft.arguments = "{}"
    draft.call = ToolCall(name=draft.name, arguments=args)


class ChatFormat(ABC):
    """How a model family writes tool calls (and reasoning), and how tools are shown to it."""

    name: str = ""
    markers: frozenset[str] = frozenset()
    """Special-token texts the format's syntax uses; decoding keeps them (it drops others)."""
    think: tuple[str, str] | None = None
    """Reasoning tags, when the family writes reasoning before its reply."""
    call_tags: tuple[str, str] | None = None
    """Open/close tags of one call block, counted for ``ParsedAction.balanced``."""

    # -- reading ------------------------------------------------------------------------------
    def scan(self, text: str, final: bool = True) -> Scan:
        """Read ``text``; ``final`` False: more may follow (hold back what could change)."""
        reasoning, rest, decided = self.split_reasoning(text, final)
        if not decided:
            return Scan(reasoning=reasoning)
        scan = self.scan_calls(rest, final)
        scan.reasoning = reasoning
        return scan

    @abstractmethod
    def scan_calls(self, text: str, final: bool) -> Scan:
        """Content and call drafts of the text after the reasoning."""

    def split_reasoning(self, text: str, final: bool) -> tuple[str, str, bool]:
        """(reasoning, rest, whether the reasoning is over). Reasoning is a leading
        ``<think>...</think>``, or text before a ``</think>`` when the prompt opened it."""
        if self.think is None:
            return "", text, True
        open_, close = self.think
        stripped = text.lstrip()
        if stripped.startswith(open_) or (not final and open_.startswith(stripped)):
            body = stripped[len(open_):] if stripped.startswith(open_) else ""
        elif close in text:
            body = text
        else:
            return "", text, True
        cut = body.find(close)
        if cut >= 0:
            return body[:cut], body[cut + len(close):], True
        if final:
            return body, "", True
        return body[:len(body) - partial_suffix(body, close)], "", False

    def split(self, text: str) -> Split:
        """A finished message: content, reasoning, calls, errors."""
        scan = self.scan(text, final=True)
        return Split(content=scan.content.strip() or None, reasoning=scan.reasoning.strip() or None,
                     calls=scan.calls, errors=scan.errors)

    def parse(self, text: str) -> ParsedAction:
        """What an environment reads from one action: valid calls, errors, the answer."""
        split = self.split(text)
        content = split.content or ""
        parsed = ParsedAction(calls=split.valid_calls(), errors=list(split.errors),
                              reasoning=split.reasoning, balanced=self._balanced(text))
        answer = ANSWER_RE.search(content)
        if answer:
            parsed.answer = answer.group(1).strip()
        return parsed

    def _balanced(self, text: str) -> bool:
        pairs = [("<answer>", "</answer>"), *([self.call_tags] if self.call_tags else [])]
        return all(text.count(a) == text.count(b) for a, b in pairs)

    def call_scanner(self, start: int) -> Any:
        """An incremental ``scan_calls`` of a growing unfinished text from ``start`` (its
        ``feed(text)`` returns an ``envs.formats.incremental.Feed``), or None: the stream
        re-scans the whole text on each token instead."""
        return None

    # -- writing ------------------------------------------------------------------------------
    @abstractmethod
    def render(self, content: str | None, calls: list[ToolCall], reasoning: str | None = None) -> str:
        """An assistant message as the model would write it (demonstrations, history for
        templates that do not render ``tool_calls``)."""

    @abstractmethod
    def call_syntax(self) -> str:
        """How to write calls, in words and an example, for the tools prompt."""

    def tools_prompt(self, tools: list[dict[str, Any]]) -> str:
        """System-prompt text that shows ``tools`` and the call syntax, for chat templates that
        render no tools themselves."""
        schemas = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
        return (f"You can use tools. Their JSON schemas, one per line, are inside <tools></tools>:\n"
                f"<tools>\n{schemas}\n</tools>\n\n{self.call_syntax()}")


def dumps(obj: Any) -> str:
    """JSON as the formats write it (what ``json.dumps`` gives, non-ASCII kept)."""
    return json.dumps(obj, ensure_ascii=False)
