"""The tool-call protocol environments read: parsed calls, errors and the ``<answer>`` that
ends an episode, in the policy's chat format (``envs.formats``; Hermes by default:
``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``). Parsing never raises: a
malformed call comes back as an error the environment turns into an observation.

The shapes (``ToolCall``, ``ParsedAction``) live in ``envs.formats`` and are re-exported here,
where every environment has imported them from.
"""

from __future__ import annotations

from envs.formats import DEFAULT_FORMAT, ChatFormat, ParsedAction, ToolCall, get_format
from envs.formats.base import ANSWER_RE

__all__ = ["ANSWER_RE", "ParsedAction", "ToolCall", "format_answer", "format_call", "parse_action"]


def parse_action(text: str, chat_format: str | ChatFormat = DEFAULT_FORMAT) -> ParsedAction:
    """Parse an assistant message into tool calls, errors and an optional answer."""
    return get_format(chat_format).parse(text)


def format_answer(answer: str) -> str:
    """The action that ends an episode with ``answer``."""
    return f"<answer>{answer}</answer>"


def format_call(call: ToolCall, chat_format: str | ChatFormat = DEFAULT_FORMAT) -> str:
    """Render a call the way the model is expected to write it."""
    return get_format(chat_format).render(None, [call])
