"""Incremental parsing of a streamed assistant message into OpenAI-shaped deltas.

``StreamParser.feed`` takes the whole text decoded so far and returns what is new: content,
reasoning, and per call (by index) its start (the name) and argument fragments. The deltas are
the growth of the format's own ``scan`` (``RescanParser``, the specification: it re-scans the
whole text on every token), so the deltas of a finished stream add up to exactly
``final_split`` of the finished text -- what a non-streamed response returns.

``StreamParser`` sends exactly ``RescanParser``'s deltas while reading each token's text once:
the reasoning split, the visible ends of content and reasoning and the format's call scanner
(``ChatFormat.call_scanner``, ``envs.formats.incremental``) all go on from where the last feed
stopped. Its state is ``RescanParser``'s counters plus the scanners', so where following the
text is not worth it -- the finishing feed (read once), a text that is not the last one
extended (a decoder that rewrote its end), a half-written ``<|python_tag|>`` -- it hands that
feed, and the rest of the stream, to the re-scan (``tests/test_stream_incremental.py`` checks
the two agree on every feed).

Whitespace at either end of content and reasoning is held back (and dropped at the end):
text between a call block and the next is often only a newline, and a client should not get
it as content. With tools disabled the content is the text as written (nothing is a call).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from envs.formats.base import CallDraft, ChatFormat, Split
from envs.formats.incremental import Feed, first_non_space, partial_suffix_at


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


class RescanParser:
    """One choice's stream, re-scanning the whole text on every feed (the specification)."""

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
            self._call_delta(out, i, draft, text, final)
        return out

    def _call_delta(self, out: StreamDelta, i: int, draft: CallDraft, text: str, final: bool) -> None:
        if i == len(self._args):
            self._args.append(0)
            out.calls.append(CallDelta(i, name=draft.name))
        if draft.streamable or draft.closed or final:
            if draft.span is not None:  # the arguments so far lie in ``text`` (never copied whole)
                fragment = text[draft.span[0] + self._args[i]:draft.span[1]]
                self._args[i] = draft.span[1] - draft.span[0]
            else:
                fragment = draft.arguments[self._args[i]:]
                self._args[i] = len(draft.arguments)
            if fragment:
                if out.calls and out.calls[-1].index == i:
                    out.calls[-1].arguments += fragment
                else:
                    out.calls.append(CallDelta(i, arguments=fragment))

    def _text_delta(self, content: str, reasoning: str) -> StreamDelta:
        out = StreamDelta(content=content[self._content:], reasoning=reasoning[self._reasoning:])
        self._content = max(self._content, len(content))
        self._reasoning = max(self._reasoning, len(reasoning))
        return out


class Visible:
    """The visible (stripped) form of a growing text, fed in pieces: what each piece adds."""

    def __init__(self) -> None:
        self.started = False  # a non-space character was seen
        self.held = ""  # trailing whitespace, sent once more text follows it
        self.length = 0  # characters of the visible text so far

    def add(self, piece: str, sent: int) -> tuple[str, int]:
        """The visible text's characters beyond ``sent`` that ``piece`` adds, and the new ``sent``."""
        if not self.started:
            piece = piece.lstrip()
            if not piece:
                return "", sent
            self.started = True
        grown = self.held + piece
        shown = grown.rstrip()
        self.held = grown[len(shown):]
        before, self.length = self.length, self.length + len(shown)
        return shown[max(0, sent - before):], max(sent, self.length)


class _Plain:
    """Tools disabled: everything after the reasoning is content."""

    def __init__(self, start: int) -> None:
        self.pos = start

    def feed(self, text: str) -> Feed:
        out, self.pos = Feed(content=text[self.pos:]), len(text)
        return out


class StreamParser(RescanParser):
    """One choice's stream, reading each token's text once (``RescanParser``'s deltas)."""

    def __init__(self, fmt: ChatFormat, tools_enabled: bool = True) -> None:
        super().__init__(fmt, tools_enabled)
        self._text = ""
        self._rescan = tools_enabled and fmt.call_scanner(0) is None
        self._state = "start" if fmt.think else "rest"  # start | think | plain | rest
        self._think_at = self._searched = 0
        self._raw = True  # tools disabled and no reasoning: content goes out as written
        self._shown_reasoning = Visible()
        self._rest(0)

    def _rest(self, start: int) -> None:
        """Content and calls are read from ``start`` (again, when a late ``</think>`` moves it)."""
        self._rest_at, self._shown_content = start, Visible()
        self._calls = self.fmt.call_scanner(start) if self.tools_enabled else _Plain(start)

    def feed(self, text: str, final: bool = False) -> StreamDelta:
        if final or self._rescan or not text.startswith(self._text):
            self._rescan = self._rescan or not final
            return super().feed(text, final)
        sent = (self._content, self._reasoning, list(self._args))
        self._text, out = text, StreamDelta()
        if self.fmt.think and not self._split_reasoning(text, out):
            return out
        found = self._calls.feed(text)
        if found is None:  # the scanner cannot follow this text: re-scan from here on
            self._content, self._reasoning, self._args = sent
            self._rescan = True
            return super().feed(text, final)
        if self._raw and not self.tools_enabled:
            rest = text[self._rest_at + self._content:]
            out.content, self._content = rest, self._content + len(rest)
        else:
            out.content, self._content = self._shown_content.add(found.content, self._content)
        for i, draft in found.calls:
            self._call_delta(out, i, draft, text, False)
        return out

    def _split_reasoning(self, text: str, out: StreamDelta) -> bool:
        """``split_reasoning`` of the unfinished text, from where the last feed left it: the
        reasoning's growth into ``out``; True once it is over (content and calls follow)."""
        open_, close = self.fmt.think
        if self._state == "start":
            first = first_non_space(text, 0, len(text))
            if text.startswith(open_, first):
                self._state, self._think_at = "think", first + len(open_)
                self._searched = self._shown_at = self._think_at
            elif open_.startswith(text[first:first + len(open_)]):
                return False  # nothing or a cut <think> so far
            else:
                self._state = "plain"
        if self._state == "think":
            cut = text.find(close, max(self._think_at, self._searched - len(close) + 1))
            self._searched = len(text)
            end = cut if cut >= 0 else len(text) - partial_suffix_at(text, self._think_at, close)
            self._add_reasoning(text[self._shown_at:end], out)
            self._shown_at = end
            if cut < 0:
                return False
            self._state, self._raw = "rest", end == self._think_at
            self._rest(cut + len(close))
        elif self._state == "plain":
            # No <think> opened the text: a </think> means the prompt opened it, and everything
            # before it is reasoning (what was sent as content stays sent, as in the re-scan).
            cut = text.find(close, max(0, self._searched - len(close) + 1))
            self._searched = len(text)
            if cut >= 0:
                self._state, self._raw = "rest", cut == 0
                self._add_reasoning(text[:cut], out)
                self._rest(cut + len(close))
        return True

    def _add_reasoning(self, piece: str, out: StreamDelta) -> None:
        delta, self._reasoning = self._shown_reasoning.add(piece, self._reasoning)
        out.reasoning += delta
