"""Formats whose calls are bare JSON objects rather than tagged blocks.

``llama3_json`` (Llama 3.1/3.2's JSON tool calling): a message that calls tools is nothing but
``{"name": ..., "parameters": {...}}`` objects (``"arguments"`` is read too), several separated
by ``;``, optionally after the ``<|python_tag|>`` token; any other message is content.

``mistral``: content, then ``[TOOL_CALLS]`` and a JSON list of ``{"name", "arguments"}`` objects.
"""

from __future__ import annotations

import json

from envs.formats.base import ChatFormat, Scan, ToolCall, dumps, partial_suffix, read_json_call
from envs.formats.incremental import (Feed, OpenCall, first_non_space, object_end, partial_suffix_at,
                                      read_open_call)

_DECODER = json.JSONDecoder()


def scan_objects(text: str, pos: int, final: bool, arg_keys: tuple[str, ...], seps: str,
                 end_char: str | None, scan: Scan) -> int | None:
    """Read call objects from ``pos`` (separated by ``seps`` and whitespace) into ``scan``,
    up to ``end_char`` or the end. Returns the index after ``end_char``, or None when the
    text ran out first (or is held back at an open object without a name)."""
    while True:
        while pos < len(text) and (text[pos].isspace() or text[pos] in seps):
            pos += 1
        if pos >= len(text):
            return None
        if end_char is not None and text[pos] == end_char:
            return pos + 1
        if text[pos] != "{":
            scan.content += text[pos:]
            if final:
                scan.errors.append(f"expected another tool call object, got {text[pos:pos + 20]!r}")
            return len(text)
        try:
            _, end = _DECODER.raw_decode(text, pos)
            body, closed = text[pos:end], True
        except ValueError:
            body, closed, end = text[pos:], False, len(text)
        draft = read_json_call(body, closed or final, arg_keys)
        draft.closed = closed
        if not closed and final:
            draft.error, draft.call = "unterminated tool call: its JSON object is not closed", None
        if draft.name is not None:
            scan.calls.append(draft)
        elif closed or final:
            scan.content += body
        else:
            return None
        if draft.error:
            scan.errors.append(draft.error)
        if not closed:
            return None
        pos = end


class Llama3Json(ChatFormat):
    name = "llama3_json"
    markers = frozenset({"<|python_tag|>"})
    keys = ("parameters", "arguments")

    def scan_calls(self, text: str, final: bool) -> Scan:
        scan = Scan()
        body = text.replace("<|python_tag|>", "", 1) if text.lstrip().startswith("<|python_tag|>") else text
        start = len(body) - len(body.lstrip())
        if start == len(body) and not final:
            return scan  # only whitespace so far: a call or content, not known yet
        if not body.startswith("{", start):
            scan.content = body
            return scan
        scan_objects(body, start, final, self.keys, ";", None, scan)
        return scan

    def call_scanner(self, start: int) -> "Llama3Scanner":
        return Llama3Scanner(start, self.keys)

    def render(self, content: str | None, calls: list[ToolCall], reasoning: str | None = None) -> str:
        if not calls:  # the family cannot mix text and calls in one message
            return content or ""
        return "; ".join(dumps({"name": c.name, "parameters": c.arguments}) for c in calls)

    def call_syntax(self) -> str:
        return ("To call a tool, reply with only a JSON object with its name and parameters; "
                "for several calls, separate the objects with '; ':\n"
                '{"name": "<tool name>", "parameters": {<arguments as JSON>}}')


class Mistral(ChatFormat):
    name = "mistral"
    marker = "[TOOL_CALLS]"
    markers = frozenset({"[TOOL_CALLS]"})

    def scan_calls(self, text: str, final: bool) -> Scan:
        scan = Scan()
        at = text.find(self.marker)
        if at < 0:
            scan.content = text if final else text[:len(text) - partial_suffix(text, self.marker)]
            return scan
        scan.content = text[:at]
        pos = at + len(self.marker)
        while pos < len(text) and text[pos].isspace():
            pos += 1
        if pos < len(text) and text[pos] == "[":
            after = scan_objects(text, pos + 1, final, ("arguments", "parameters"), ",", "]", scan)
        elif pos < len(text):
            after = scan_objects(text, pos, final, ("arguments", "parameters"), ",", None, scan)
        else:
            after = None
        if after is not None and after < len(text):
            scan.content += text[after:]
        return scan

    def call_scanner(self, start: int) -> "MistralScanner":
        return MistralScanner(start, self.marker)

    def render(self, content: str | None, calls: list[ToolCall], reasoning: str | None = None) -> str:
        if not calls:
            return content or ""
        return (content or "") + self.marker + dumps([{"name": c.name, "arguments": c.arguments} for c in calls])

    def call_syntax(self) -> str:
        return (f"To call tools, write {self.marker} followed by a JSON list with one object per call:\n"
                f'{self.marker}[{{"name": "<tool name>", "arguments": {{<arguments as JSON>}}}}]')


class ObjectsScanner:
    """``scan_objects`` of a growing unfinished text, read from where the last feed left off."""

    def __init__(self, pos: int, arg_keys: tuple[str, ...], seps: str, end_char: str | None) -> None:
        self.pos, self.keys, self.seps, self.end_char = pos, arg_keys, seps, end_char
        self.block: OpenCall | None = None
        self.content_from: int | None = None  # the rest is content from here (not a call object)
        self.calls = 0

    def feed(self, text: str, out: Feed) -> int | None:
        """Read into ``out``; the index after ``end_char`` once it is written, else None."""
        if self.content_from is not None:
            out.content += text[self.content_from:]
            self.content_from = len(text)
            return None
        while True:
            if self.block is None:
                while self.pos < len(text) and (text[self.pos].isspace() or text[self.pos] in self.seps):
                    self.pos += 1
                if self.pos >= len(text):
                    return None
                if self.end_char is not None and text[self.pos] == self.end_char:
                    return self.pos + 1
                if text[self.pos] != "{":
                    out.content += text[self.pos:]
                    self.content_from = len(text)
                    return None
                self.block = OpenCall(self.pos)
            if not self._read_object(text, self.block, out):
                return None

    def _read_object(self, text: str, block: OpenCall, out: Feed) -> bool:
        """Read the open object into ``out``; True when it closed (go on after it)."""
        end = object_end(text, block)
        if end is not None:
            draft = read_json_call(text[block.start:end], True, self.keys)
            draft.closed = True
        else:
            draft = read_open_call(text, block.start, len(text), self.keys, block)
        if draft.name is not None:
            if block.index is None:
                block.index, self.calls = self.calls, self.calls + 1
            out.calls.append((block.index, draft))
        elif end is not None:
            out.content += text[block.start:end]
        if end is None:
            return False
        self.block, self.pos = None, end
        return True


class Llama3Scanner:
    """``Llama3Json.scan_calls`` of a growing unfinished text: the message's first character
    decides between calls and content; then only new text is read."""

    def __init__(self, start: int, arg_keys: tuple[str, ...]) -> None:
        self.start, self.keys = start, arg_keys
        self.objects: ObjectsScanner | None = None
        self.content_from: int | None = None

    def feed(self, text: str) -> Feed | None:
        """None: the text so far is a cut ``<|python_tag|>``, which the pure scan reads as
        content and then not (the stream re-scans from here on)."""
        out = Feed()
        if self.objects is None and self.content_from is None:
            tag = "<|python_tag|>"
            first = first_non_space(text, self.start, len(text))
            if first == len(text):
                return out
            at = first
            if text.startswith(tag, first):
                at = first_non_space(text, first + len(tag), len(text))
                if at == len(text):
                    return out
            elif tag.startswith(text[first:first + len(tag)]):
                return None
            if text[at] == "{":
                self.objects = ObjectsScanner(at, self.keys, ";", None)
            else:  # content: the message as written, without a leading python tag
                out.content = text[self.start:first] if at != first else ""
                self.content_from = first + len(tag) if at != first else self.start
        if self.content_from is not None:
            out.content += text[self.content_from:]
            self.content_from = len(text)
        else:
            self.objects.feed(text, out)
        return out


class MistralScanner:
    """``Mistral.scan_calls`` of a growing unfinished text, read from where the last feed left off."""

    def __init__(self, start: int, marker: str) -> None:
        self.pos, self.marker = start, marker
        self.objects: ObjectsScanner | None = None
        self.marked = False  # [TOOL_CALLS] was written
        self.tail_from: int | None = None

    def feed(self, text: str) -> Feed:
        out = Feed()
        if not self.marked:
            at = text.find(self.marker, self.pos)
            if at < 0:
                end = len(text) - partial_suffix_at(text, self.pos, self.marker)
                out.content, self.pos = text[self.pos:end], end
                return out
            out.content, self.pos, self.marked = text[self.pos:at], at + len(self.marker), True
        if self.objects is None:
            first = first_non_space(text, self.pos, len(text))
            if first == len(text):
                return out
            listed = text[first] == "["
            self.objects = ObjectsScanner(first + listed, ("arguments", "parameters"), ",", "]" if listed else None)
        if self.tail_from is None:
            self.tail_from = self.objects.feed(text, out)
        if self.tail_from is not None:
            out.content += text[self.tail_from:]
            self.tail_from = len(text)
        return out
