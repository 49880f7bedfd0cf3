"""What the formats' incremental scanners share (the streaming parser's side of a format).

A format's ``scan`` is a pure function of the whole text; streaming it token by token re-reads
the text on every token. An incremental scanner (``ChatFormat.call_scanner``) is fed the same
growing text and reads only what is new: content decided since the last feed, and the calls
whose blocks changed, each as the pure scan reports it for that text. Its results are, by
construction, those of ``scan_calls`` on the unfinished text (``tests/test_stream_incremental.py``
checks it against the pure scan on random splits): where a shortcut would have to guess, it
calls the pure reader instead.

The one shortcut inside a call block: once a call's name is read and its arguments value has
begun (an object, list or string the model is still writing), the name and where the value
starts are fixed until the value is complete, and the arguments so far are the text from that
start. A bracket and string tracker sees when the value may be complete; only then is the pure
reader asked again. The block's head (before the value starts) and its tail (after the value
is complete) are read by the pure reader on each feed; both are a few tokens in a call a
model writes (a malformed block, whose value never completes, is read by the pure reader too).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from envs.formats.base import CallDraft, read_json_head

_DECODER = json.JSONDecoder()


def partial_suffix_at(text: str, start: int, tag: str) -> int:
    """``partial_suffix(text[start:], tag)`` without copying the text: the length of the
    longest proper prefix of ``tag`` that ends ``text`` within ``text[start:]``."""
    most = min(len(tag) - 1, len(text) - start)
    if most <= 0 or tag[0] not in text[len(text) - most:]:
        return 0  # the common case, decided on a few characters
    return next((n for n in range(most, 0, -1) if text.endswith(tag[:n])), 0)


def first_non_space(text: str, pos: int, end: int) -> int:
    """The first index in ``[pos, end)`` whose character is not whitespace, else ``end``."""
    while pos < end and text[pos].isspace():
        pos += 1
    return pos


@dataclass
class ValueTracker:
    """Brackets and strings of a JSON value being written, read character by character: says
    when the value may be complete (its outer bracket or string closes). For valid JSON it
    agrees with ``json`` exactly; for invalid JSON it may say so early (the caller then asks
    the decoder), never late."""

    depth: int = 0
    in_string: bool = False
    escaped: bool = False

    def complete_in(self, text: str, pos: int, end: int) -> bool:
        """Read ``text[pos:end]``; True once the value may be complete."""
        for ch in text[pos:end]:  # one slice of the new text, then a character loop
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif ch == "\\":
                    self.escaped = True
                elif ch == '"':
                    self.in_string = False
                    if self.depth == 0:
                        return True
            elif ch == '"':
                self.in_string = True
            elif ch in "{[":
                self.depth += 1
            elif ch in "}]":
                self.depth -= 1
                if self.depth <= 0:
                    return True
        return False


@dataclass
class OpenCall:
    """What is known of one open call block between feeds."""

    start: int
    """Where the block (tag or object) starts in the text."""
    index: int | None = None
    """The call's index once it has a name (calls count in the order written)."""
    searched: int = 0
    """How far the text was searched for the block's end (its closing tag, or its object)."""
    tracker: ValueTracker | None = None
    """The block's own JSON object (formats whose calls are bare objects), while open."""
    undecodable: bool = False
    """That object looked complete but does not decode: ask the decoder on each feed."""
    value_start: int | None = None
    """Where the arguments value starts while it is being written (the shortcut is on)."""
    value: ValueTracker = field(default_factory=ValueTracker)
    scanned: int = 0
    """How far ``value`` has read."""
    name: str | None = None
    streamable: bool = False
    pure: bool = False
    """The value looked complete but does not decode: read this block purely from now on."""


def read_open_call(text: str, start: int, end: int, arg_keys: tuple[str, ...], memo: OpenCall) -> CallDraft:
    """``read_json_call(text[start:end], False, arg_keys)``, an open block's body, reading only
    the new text while its arguments value is being written. Such a draft carries ``span``
    (where its arguments lie in ``text``) instead of the arguments' text."""
    if memo.value_start is not None:
        if not memo.value.complete_in(text, memo.scanned, end):
            memo.scanned = end
            return CallDraft(name=memo.name, streamable=memo.streamable, span=(memo.value_start, end))
        memo.value_start = None  # the value may be complete: the pure reader decides
    draft, value_at = read_json_head(text[start:end], False, arg_keys)
    if value_at is not None and not memo.pure and text[start + value_at] in '{["':
        memo.value, memo.value_start = ValueTracker(), start + value_at
        if memo.value.complete_in(text, memo.value_start, end):
            memo.value_start, memo.pure = None, True  # complete yet undecodable: malformed
        else:
            memo.scanned, memo.name, memo.streamable = end, draft.name, draft.streamable
    return draft


def object_end(text: str, memo: OpenCall) -> int | None:
    """Where the JSON object at ``memo.start`` ends (``raw_decode``), or None while it does
    not decode; reads only the new text until the object may be complete."""
    if memo.tracker is None:
        memo.tracker, memo.searched = ValueTracker(), memo.start
    if not memo.undecodable:
        if not memo.tracker.complete_in(text, memo.searched, len(text)):
            memo.searched = len(text)
            return None
        memo.searched = len(text)
    try:
        return _DECODER.raw_decode(text, memo.start)[1]
    except ValueError:
        memo.undecodable = True  # as scan does, ask the decoder on each feed from now on
        return None


@dataclass
class Feed:
    """What one feed of an incremental scanner found."""

    content: str = ""
    """Content decided since the last feed (raw, in order)."""
    calls: list[tuple[int, CallDraft]] = field(default_factory=list)
    """Calls that closed in this feed and the open one, by index."""
