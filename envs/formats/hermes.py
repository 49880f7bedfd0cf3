"""Hermes tool calls: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks
anywhere in the message, any number (parallel calls). Qwen2.5's, Hermes 2 Pro's and the
builtin tiny model's convention; ``qwen3`` is the same calls after a ``<think>`` reasoning block.
"""

from __future__ import annotations

from envs.formats.base import ChatFormat, Scan, ToolCall, dumps, partial_suffix, read_json_call

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
