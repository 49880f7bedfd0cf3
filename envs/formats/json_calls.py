"""Formats whose calls are bare JSON objects rather than tagged blocks.

``llama3_json`` (Llama 3.1/3.2's JSON tool calling): a message that calls tools is nothing but
``{"name": ..., "parameters": {...}}`` objects (``"arguments"`` is read too), several separated
by ``;``, optionally after the ``<|python_tag|>`` token; any other message is content.

``mistral``: content, then ``[TOOL_CALLS]`` and a JSON list of ``{"name", "arguments"}`` objects.
"""

from __future__ import annotations

import json

from envs.formats.base import ChatFormat, Scan, ToolCall, dumps, partial_suffix, read_json_call

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

    def render(self, content: str | None, calls: list[ToolCall], reasoning: str | None = None) -> str:
        if not calls:
            return content or ""
        return (content or "") + self.marker + dumps([{"name": c.name, "arguments": c.arguments} for c in calls])

    def call_syntax(self) -> str:
        return (f"To call tools, write {self.marker} followed by a JSON list with one object per call:\n"
                f'{self.marker}[{{"name": "<tool name>", "arguments": {{<arguments as JSON>}}}}]')
