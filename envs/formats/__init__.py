"""Chat formats: how a model family writes tool calls (and reasoning), and how tools are shown
to it. One registry, keyed by name (``rollout.chat_format``), used by the environments (parsing
actions), the rollout (rendering prompts: ``rollout.chat``) and the live gateway (OpenAI
``tool_calls``, streamed deltas, ``reasoning_content``).

==============  ===========================================================================
``hermes``      ``<tool_call>{"name", "arguments"}</tool_call>`` blocks (Qwen2.5, Hermes, the
                builtin tiny model). The default.
``qwen3``       Hermes calls after ``<think>...</think>`` reasoning, split off as reasoning.
``llama3_json`` Llama 3.1/3.2: the message is ``{"name", "parameters"}`` objects, ``;``-separated.
``mistral``     ``[TOOL_CALLS]`` then a JSON list of ``{"name", "arguments"}`` objects.
==============  ===========================================================================

Pure text: the standard library and pydantic only (``envs`` is upstream of everything).
"""

from __future__ import annotations

from envs.formats.base import CallDraft, ChatFormat, ParsedAction, Split, ToolCall
from envs.formats.hermes import Hermes, Qwen3
from envs.formats.json_calls import Llama3Json, Mistral
from envs.formats.stream import StreamDelta, StreamParser, final_split

FORMATS: dict[str, ChatFormat] = {f.name: f for f in (Hermes(), Qwen3(), Llama3Json(), Mistral())}
"""The registry: every chat format by name."""

DEFAULT_FORMAT = "hermes"


def get_format(name: str | ChatFormat) -> ChatFormat:
    """The format called ``name`` (a format passes through); unknown names fail listing the known."""
    if isinstance(name, ChatFormat):
        return name
    if name not in FORMATS:
        raise ValueError(f"unknown chat format {name!r}; known: {', '.join(sorted(FORMATS))} "
                         "(set rollout.chat_format)")
    return FORMATS[name]


def demo_text(text: str, chat_format: str | ChatFormat) -> str:
    """A demonstration's assistant message, written in the default format's syntax (every
    environment's demonstrations are: ``envs.base.replay_gold_calls``), as ``chat_format``
    writes it: its content, calls and reasoning re-rendered (the default format: as written)."""
    fmt = get_format(chat_format)
    if fmt.name == DEFAULT_FORMAT:
        return text
    split = get_format(DEFAULT_FORMAT).split(text)
    return fmt.render(split.content, split.valid_calls(), split.reasoning)


__all__ = ["DEFAULT_FORMAT", "FORMATS", "CallDraft", "ChatFormat", "ParsedAction", "Split", "StreamDelta",
           "StreamParser", "ToolCall", "demo_text", "final_split", "get_format"]
