"""The incremental stream parser against the specification it replaces: on many random splits
of real messages in every chat format (calls, parallel calls, reasoning, malformed calls,
plain content), ``StreamParser`` sends exactly ``RescanParser``'s delta on every feed, and the
deltas of a finished stream add up to the one-shot parse (``final_split``). Pure: ms each."""

from __future__ import annotations

import random

import pytest

from envs.formats import FORMATS, ToolCall, final_split, get_format
from envs.formats.stream import RescanParser, StreamDelta, StreamParser

SEARCH = ToolCall(name="search", arguments={"query": "capital of France", "k": [1, {"x": "}"}]})
LOOKUP = ToolCall(name="lookup", arguments={"id": 3, "city": "Paris é \"quoted\" \\ back"})
CODE = ToolCall(name="python", arguments={"code": "def f(x):\n    return {'a': [x, '}']}\n" * 20})
LATE_THINK = {"prompt opened it</think>Paris"}
"""Reasoning the prompt opened: a stream cannot know it is reasoning until ``</think>``."""
MARKERS = ("<|python_tag|>", "[TOOL_CALLS]")  # one token each: a stream never cuts them

EXTRA = {
    "hermes": ['Sure.<tool_call>{"name": "s", "arguments": {"q": 1}}</tool_call> and <tool_call>[1]</tool_call>',
               '<tool_call>{"arguments": {"q": "a"}, "name": "late"}</tool_call>x',
               '<tool_call>{"name": "s", "arguments": "{\\"q\\": 1}"}</tool_call>',
               '<tool_call>{"name": "s", "arguments": {"q": tru}} </tool_call><tool_call>{"name": "t"}',
               '<tool_call> {"name": "s", "arguments": {"q": "</tool"}}</tool_call>', "<tool_ca", "a < b </tool_call>"],
    "qwen3": ["<think>\nplan\n</think>\n\nPlain answer.", "  <think>unfinished", "prompt opened it</think>Paris",
              '<think></think><tool_call>{"name": "s", "arguments": {}}</tool_call>', "<thi", "<thinking>no"],
    "llama3_json": ['<|python_tag|>{"name": "s", "parameters": {"q": 1}}; {"name": "t", "parameters": {}}',
                    '  {"name": "s", "parameters": {"q": 1}} ; oops', "Just text { not a call",
                    '{"name": "s", "parameters": {"q": 1]}', '{"parameters": {"q": 1}}'],
    "mistral": ['Let me.[TOOL_CALLS] [{"name": "s", "arguments": {"q": 1}}, {"name": "t", "arguments": {}}] after',
                '[TOOL_CALLS]{"name": "s", "arguments": {"q": 1}}', "[TOOL_CALL", "no calls at all",
                '[TOOL_CALLS][{"name": "s", "arguments": {"q": 1}} junk', '[TOOL_CALLS][1, {"name": "s"}]'],
}


def examples(name: str) -> list[str]:
    fmt = get_format(name)
    why = "First search, then look up." if name == "qwen3" else None
    return [fmt.render("Let me check two things.", [SEARCH, LOOKUP], why), fmt.render(None, [CODE], why),
            fmt.render("Hi.\n\nHow can I help?", []), *EXTRA[name]]


def random_cuts(text: str, rng: random.Random) -> list[int]:
    """Cut points 1..len(text): chunks of 1-8 characters, never inside a marker."""
    inside = {i for m in MARKERS for at in _find_all(text, m) for i in range(at + 1, at + len(m))}
    cuts, i = [], 0
    while i < len(text):
        i = min(len(text), i + rng.randint(1, 8))
        while i in inside:
            i += 1
        cuts.append(i)
    return cuts


def _find_all(text: str, sub: str) -> list[int]:
    out, at = [], text.find(sub)
    while at >= 0:
        out.append(at)
        at = text.find(sub, at + 1)
    return out


def _sum(deltas: list[StreamDelta]) -> tuple[str, str, dict[int, list]]:
    content = reasoning = ""
    calls: dict[int, list] = {}
    for d in deltas:
        content, reasoning = content + d.content, reasoning + d.reasoning
        for c in d.calls:
            entry = calls.setdefault(c.index, [None, ""])
            entry[0] = entry[0] or c.name
            entry[1] += c.arguments
    return content, reasoning, calls


@pytest.mark.parametrize("tools", [True, False])
@pytest.mark.parametrize("name", sorted(FORMATS))
def test_incremental_deltas_equal_the_rescan_on_random_splits(name: str, tools: bool) -> None:
    fmt, rng = get_format(name), random.Random(f"{name}{tools}")
    for text in examples(name):
        for _ in range(25):
            fast, spec, got = StreamParser(fmt, tools), RescanParser(fmt, tools), []
            cuts = random_cuts(text, rng)
            for i in cuts:
                delta = fast.feed(text[:i])
                assert delta == spec.feed(text[:i]), (text, i)
                got.append(delta)
            delta = fast.feed(text, final=True)
            assert delta == spec.feed(text, final=True), text
            got.append(delta)
            assert not fast._rescan, text  # every feed was followed, none re-scanned
            if text in LATE_THINK:
                continue  # content sent before the </think> stays sent (the re-scan's rule too)
            split = final_split(fmt, text, tools)
            content, reasoning, calls = _sum(got)
            assert (content or None, reasoning or None) == (split.content, split.reasoning), text
            assert [tuple(calls[i]) for i in sorted(calls)] == [(d.name, d.arguments) for d in split.calls], text


def test_a_rewritten_end_and_a_cut_python_tag_go_to_the_rescan() -> None:
    fmt = get_format("hermes")
    fast, spec = StreamParser(fmt), RescanParser(fmt)
    for text in ["Hello ", "Hello.", "Hello. <tool_call>", 'Hello. <tool_call>{"name": "s"}</tool_call>']:
        assert fast.feed(text) == spec.feed(text)  # "Hello " -> "Hello." is not an extension
    assert fast._rescan
    llama = get_format("llama3_json")
    fast, spec = StreamParser(llama), RescanParser(llama)
    for text in ["<|py", '<|python_tag|>{"name": "s", "parameters": {}}']:
        assert fast.feed(text) == spec.feed(text)
    assert fast._rescan and fast.feed("x", final=True) is not None


def test_long_arguments_take_the_shortcut() -> None:
    """While a call's arguments are being written, a feed reads only the new text (the shortcut
    is on for every character of them but the last), and leaves it when the value closes."""
    fmt = get_format("hermes")
    text = fmt.render(None, [CODE])
    parser, on = StreamParser(fmt), 0
    for i in range(1, len(text) + 1):
        parser.feed(text[:i])
        block = parser._calls.block
        on += block is not None and block.value_start is not None
    arguments = len(fmt.split(text).calls[0].arguments)
    assert on == arguments - 1
