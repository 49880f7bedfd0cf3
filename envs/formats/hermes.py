"""Hermes tool calls: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks
anywhere in the message, any number (parallel calls). Qwen2.5's, Hermes 2 Pro's and the
builtin tiny model's convention; ``qwen3`` is the same calls after a ``<think>`` reasoning block.
"""

from __future__ import annotations

from envs.formats.base import ChatFormat, Scan, ToolCall, dumps, partial_suffix, read_json_call
from envs.formats.incremental import Feed, OpenCall, first_non_space, partial_suffix_at, read_open_call

OPEN, CLOSE = "<tool_call>", "</tool_call>"


class Hermes(ChatFormat):
    name = "hermes"
    call_tags = (OPEN, CLOSE)
    newline_blocks = False
    """Write each block on its own lines (Qwen3's templates do); the builtin model writes them inline."""

    def scan_calls(self, text: str, final: bool) -> Scan:
        scan, pos = Scan(), 0
        while True:
            start = text.find(OPEN, pos)
            if start < 0:
                tail = text[pos:]
                scan.content += tail if final else tail[:len(tail) - partial_suffix(tail, OPEN)]
                return scan
            scan.content += text[pos:start]
            end = text.find(CLOSE, start)
            closed = end >= 0
            body = text[start + len(OPEN):end] if closed else text[start + len(OPEN):]
            if not closed and not final:
                body = body[:len(body) - partial_suffix(body, CLOSE)]
            # Leading whitespace only: the arguments' text must only grow as the block does.
            draft = read_json_call(body.lstrip(), closed or final, ("arguments",))
            draft.closed = closed
            block_end = end + len(CLOSE) if closed else len(text)
            if not closed and final:
                draft.error = f"unterminated {OPEN}: close it with {CLOSE}"
                draft.call = None
            if draft.name is not None:
                scan.calls.append(draft)
            elif closed or final:  # not a call: the client sees what the model wrote
                scan.content += text[start:block_end]
            else:
                return scan  # an open block without a name yet: hold everything after it
            if draft.error:
                scan.errors.append(draft.error)
            if not closed:
                return scan
            pos = block_end

    def call_scanner(self, start: int) -> "HermesScanner":
        return HermesScanner(start)

    def render(self, content: str | None, calls: list[ToolCall], reasoning: str | None = None) -> str:
        sep = "\n" if self.newline_blocks else ""
        blocks = [f"{OPEN}{sep}{dumps({'name': c.name, 'arguments': c.arguments})}{sep}{CLOSE}" for c in calls]
        text = (content or "") + (sep if content and calls else "") + sep.join(blocks)
        if reasoning is not None and self.think:
            text = f"{self.think[0]}\n{reasoning.strip()}\n{self.think[1]}\n\n{text}"
        return text

    def call_syntax(self) -> str:
        return ("To call a tool, write a JSON object with its name and arguments between "
                f"{OPEN} and {CLOSE}, one block per call:\n"
                f'{OPEN}\n{{"name": "<tool name>", "arguments": {{<arguments as JSON>}}}}\n{CLOSE}')


class Qwen3(Hermes):
    """Hermes calls after reasoning in ``<think>...</think>`` (split off as ``reasoning``)."""

    name = "qwen3"
    think = ("<think>", "</think>")
    newline_blocks = True


class HermesScanner:
    """``Hermes.scan_calls`` of a growing unfinished text, read from where the last feed left
    off: decided content and closed blocks are never read again, an open block's body through
    ``read_open_call``."""

    def __init__(self, start: int) -> None:
        self.pos = start  # everything before is decided (content sent, blocks closed)
        self.block: OpenCall | None = None
        self.calls = 0

    def feed(self, text: str) -> Feed:
        out = Feed()
        while True:
            if self.block is None:
                start = text.find(OPEN, self.pos)
                if start < 0:
                    end = len(text) - partial_suffix_at(text, self.pos, OPEN)
                    out.content += text[self.pos:end]
                    self.pos = end
                    return out
                out.content += text[self.pos:start]
                self.pos, self.block = start, OpenCall(start, searched=start + len(OPEN))
            if not self._read_block(text, self.block, out):
                return out

    def _read_block(self, text: str, block: OpenCall, out: Feed) -> bool:
        """Read the open block into ``out``; True when it closed (go on after it)."""
        body = block.start + len(OPEN)
        end = text.find(CLOSE, max(body, block.searched - len(CLOSE) + 1))
        block.searched = len(text)
        if end >= 0:
            draft = read_json_call(text[body:end].lstrip(), True, ("arguments",))
            draft.closed = True
        else:
            body_end = len(text) - partial_suffix_at(text, body, CLOSE)
            draft = read_open_call(text, first_non_space(text, body, body_end), body_end, ("arguments",), block)
        if draft.name is not None:
            if block.index is None:
                block.index, self.calls = self.calls, self.calls + 1
            out.calls.append((block.index, draft))
        elif end >= 0:  # not a call: the client sees what the model wrote
            out.content += text[block.start:end + len(CLOSE)]
        if end < 0:
            return False
        self.block, self.pos = None, end + len(CLOSE)
        return True
