"""Incremental parsing of a streamed assistant message into OpenAI-shaped deltas.

``StreamParser.feed`` takes the whole text decoded so far and returns what is new: content,
reasoning, and per call (by index) its start (the name) and argument fragments. It sends the
growth of the format's own ``scan``, so the deltas of a finished stream add up to exactly
``final_split`` of the finished text -- what a non-streamed response returns.

Whitespace at either end of content and reasoning is held back (and dropped at the end):
text between a call block and the next is often only a newline, and a client should not get
it as content. With tools disabled the content is the text as written (nothing is a call).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from envs.formats.base import ChatFormat, Split


@dataclass
class CallDelta:
    """Part of one call: its start (``name`` set, first time only) and/or an argument fragment."""

    index: int
    name: str | None = None
    arguments: str = ""


@dataclass
class StreamDelta:
    content: str = ""
    reasoning: str = ""
    calls: list[CallDelta] = field(default_factory=list)

    def empty(self) -> bool:
        return not (self.content or self.reasoning or self.calls)


def final_split(fmt: ChatFormat, text: str, tools_enabled: bool) -> Split:
    """The finished message. With ``tools_enabled`` False nothing is parsed as a call."""
    if tools_enabled:
        return fmt.split(text)
    reasoning, rest, _ = fmt.split_reasoning(text, final=True)
    content = rest.strip() if reasoning else rest
    return Split(content=content or None, reasoning=reasoning.strip() or None, calls=[], errors=[])


def _visible(text: str, final: bool) -> str:
    text = text.lstrip()
    return text.strip() if final else text.rstrip()


class StreamParser:
    """One choice's stream."""

    def __init__(self, fmt: ChatFormat, tools_enabled: bool = True) -> None:
        self.fmt, self.tools_enabled = fmt, tools_enabled
        self._content = 0  # characters of visible content sent
        self._reasoning = 0
        self._args: list[int] = []  # per started call: characters of arguments sent

    def feed(self, text: str, final: bool = False) -> StreamDelta:
        """What ``text`` (everything decoded so far) adds to what was sent."""
        if not self.tools_enabled:
            reasoning, rest, decided = self.fmt.split_reasoning(text, final)
            if final:
                split = final_split(self.fmt, text, False)
                content, reasoning = split.content or "", split.reasoning or ""
            else:
                content = (_visible(rest, False) if reasoning else rest) if decided else ""
                reasoning = _visible(reasoning, False)
            return self._text_delta(content, reasoning)
        scan = self.fmt.scan(text, final)
        out = self._text_delta(_visible(scan.content, final), _visible(scan.reasoning, final))
        for i, draft in enumerate(scan.calls):
            if i == len(self._args):
                self._args.append(0)
                out.calls.append(CallDelta(i, name=draft.name))
            if draft.streamable or draft.closed or final:
                fragment = draft.arguments[self._args[i]:]
                self._args[i] = len(draft.arguments)
                if fragment:
                    if out.calls and out.calls[-1].index == i:
                        out.calls[-1].arguments += fragment
                    else:
                        out.calls.append(CallDelta(i, arguments=fragment))
        return out

    def _text_delta(self, content: str, reasoning: str) -> StreamDelta:
        out = StreamDelta(content=content[self._content:], reasoning=reasoning[self._reasoning:])
        self._content = max(self._content, len(content))
        self._reasoning = max(self._reasoning, len(reasoning))
        return out
