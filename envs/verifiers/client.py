"""The verifiers side of the bridge: a ``verifiers`` client whose model is TurnRL's episode.

A verifiers environment plays its rollout against a ``vf.Client`` (its abstraction over model
APIs). ``EpisodeClient`` is one: each model request it gets (the conversation so far and the
tools) is handed to the TurnRL episode through an inbox, and it waits for the reply the episode
makes from the policy's sampled text (``reply``). No HTTP and no second tokenisation: the
environment sees the reply as parsed messages, TurnRL keeps the sampled tokens.

This module imports verifiers; ``envs.verifiers.source`` imports it only once it has checked
that the package is there.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any

import verifiers as vf
from verifiers.types import Response, ResponseMessage
from verifiers.types import ToolCall as VfToolCall

from envs.formats.base import Split
from envs.tools import function_tool

MODEL = "turnrl-policy"
"""The model name the environment's requests carry."""


@dataclass
class ModelRequest:
    """One model call of the environment's rollout, waiting for the policy's reply."""

    messages: list[Any]
    """The conversation so far (verifiers' message objects)."""
    tools: list[dict[str, Any]]
    """The tools offered, as OpenAI function definitions."""
    reply: asyncio.Future = field(repr=False)
    """Resolved with the ``Response`` the episode builds."""


class EpisodeClient(vf.Client):
    """A ``vf.Client`` answered by a TurnRL episode: requests go to ``inbox``."""

    def __init__(self, inbox: asyncio.Queue) -> None:
        super().__init__(inbox)  # not a ClientConfig: kept as the "native client"

    def setup_client(self, config: Any) -> Any:
        raise TypeError("an EpisodeClient is made by its episode, never from a ClientConfig")

    async def to_native_tool(self, tool: Any) -> dict[str, Any]:
        return openai_tool(tool)

    async def to_native_prompt(self, messages: Any) -> tuple[list[Any], dict[str, Any]]:
        return list(messages), {}

    async def get_native_response(self, prompt: list[Any], model: str, sampling_args: Any,
                                  tools: list[dict[str, Any]] | None = None, **kwargs: Any) -> Response:
        request = ModelRequest(prompt, tools or [], asyncio.get_running_loop().create_future())
        await self.client.put(request)
        return await request.reply

    async def raise_from_native_response(self, response: Response) -> None:
        return None  # the episode built it: nothing to check

    async def from_native_response(self, response: Response) -> Response:
        return response

    async def close(self) -> None:
        return None


def openai_tool(tool: Any) -> dict[str, Any]:
    """A verifiers tool definition (a ``vf.Tool``, or its dict) as an OpenAI function tool."""
    get = tool.get if isinstance(tool, dict) else lambda k, d=None: getattr(tool, k, d)
    return function_tool(get("name"), get("description"), get("parameters"))


def reply(split: Split, turn: int) -> tuple[Response, dict[str, str]]:
    """The ``Response`` an environment reads from the policy's message ``split``: its content,
    reasoning and every named call (a malformed one's arguments as written, for the
    environment to report), and each call id's tool name."""
    calls = [VfToolCall(id=f"call_{turn}_{i}", name=d.name or "", arguments=d.arguments)
             for i, d in enumerate(split.calls)]
    message = ResponseMessage(content=split.content, reasoning_content=split.reasoning, tool_calls=calls or None,
                              finish_reason="tool_calls" if calls else "stop", is_truncated=False)
    response = Response(id=f"turnrl-{turn}", created=int(time.time()), model=MODEL, message=message)
    return response, {c.id: c.name for c in calls}


def text_of(content: Any) -> str:
    """A message's text: a string, or its text parts joined (other parts cannot be shown to a
    text policy: ValueError)."""
    if content is None or isinstance(content, str):
        return content or ""
    texts = []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else getattr(part, "type", None)
        if kind != "text":
            raise ValueError(f"a message holds a {kind!r} part: only text reaches the policy")
        texts.append(part["text"] if isinstance(part, dict) else part.text)
    return "".join(texts)


def plain(message: Any, names: dict[str, str] | None = None) -> dict[str, Any]:
    """A verifiers message (object or dict) as the chat message TurnRL renders: role and text;
    a tool result also its call id and, when known, the tool's name."""
    get = message.get if isinstance(message, dict) else lambda k, d=None: getattr(message, k, d)
    out: dict[str, Any] = {"role": get("role"), "content": text_of(get("content"))}
    if out["role"] == "tool":
        out["tool_call_id"] = get("tool_call_id")
        if names and get("tool_call_id") in names:
            out["name"] = names[get("tool_call_id")]
    return out


def rollout_input(row: dict[str, Any]) -> dict[str, Any]:
    """A dataset row as the ``RolloutInput`` the environment's ``rollout`` takes."""
    return {k: v for k, v in row.items() if v is not None}


async def play(env: Any, row: dict[str, Any], inbox: asyncio.Queue) -> Any:
    """The environment's own rollout of ``row`` against an ``EpisodeClient`` on ``inbox``,
    then its rubric's scoring: the finished state (``reward``, ``metrics``)."""
    state = await env.rollout(rollout_input(row), EpisodeClient(inbox), MODEL, None)
    if env.score_rollouts:
        await env.rubric.score_rollout(state)
    else:
        await env.rubric.dummy_score_rollout(state)
    await env.rubric.cleanup(state)
    return state


def load(env_id: str, args: dict[str, Any]) -> Any:
    """``vf.load_environment(env_id, **args)``; ValueError naming the field when it fails."""
    try:
        env = vf.load_environment(env_id, **args)
    except Exception as exc:  # noqa: BLE001 - any failure of the user's loader is a config error
        cause = exc.__cause__ or exc
        raise ValueError(f"env.id {env_id!r}: verifiers could not load it: {type(cause).__name__}: {cause}") from None
    if not isinstance(env, vf.Environment):
        raise ValueError(f"env.id {env_id!r}: load_environment returned a {type(env).__name__}, "
                         "not a verifiers Environment")
    return env
