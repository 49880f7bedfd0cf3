"""An OpenEnv environment as a TurnRL task source (``env.type: openenv``).

A task is a ``reset`` seed (train and held-out seeds disjoint); an episode is one WebSocket
session of openenv-core's ``GenericEnvClient`` on the environment's server (``envs.openenv.server``):
``reset(seed=...)`` gives the opening observation, each assistant turn is one ``step``, the
environment's rewards are the turns' rewards and their sum the episode's outcome, and its
``done`` (or ``max_turns``) ends the episode.

With ``action: tool`` the policy sees the server's action schema as one tool and acts by calling
it; a malformed call, a missing one, or arguments the server rejects come back as an observation
(``invalid_action``), as in every TurnRL environment. A server that dies or does not answer
within ``step_timeout_s`` fails that episode with the cause; the run goes on, and a local server
that stopped answering is started again for the next episode.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from envs.base import Environment, Observation, SplitTaskSource, StepResult, Task, step_observation
from envs.config import OpenEnvConfig
from envs.openenv.server import OpenEnvServer
from envs.toolcalls import ToolCall, format_call, parse_action
from envs.tools import check_arguments, tool_message

_CLOSING: set[asyncio.Task[None]] = set()
"""Client closes scheduled from ``close`` (kept referenced until they finish)."""


def _client_cls() -> Any:
    try:
        from openenv.core.generic_client import GenericEnvClient
    except ImportError as exc:
        raise ValueError("env.type openenv needs openenv-core: pip install openenv-core") from exc
    return GenericEnvClient


class OpenEnvSource(SplitTaskSource):
    """Reset seeds as tasks, the server's episodes as episodes."""

    scores_outcome = True

    def __init__(self, cfg: OpenEnvConfig) -> None:
        _client_cls()
        self.cfg, self.success_at = cfg, cfg.success_at
        self.server = OpenEnvServer(cfg.server)
        self.tool: dict[str, Any] | None = None
        if cfg.action == "tool":  # needs the server: a server that cannot start fails the run here
            self.tool = {"type": "function", "function": {
                "name": cfg.tool_name, "description": cfg.tool_description, "parameters": self.server.action_schema()}}
        base, n = cfg.seed * 10**7, cfg.num_train_tasks
        self.splits = {"train": [self._task("train", base + i) for i in range(n)],
                       "heldout": [self._task("heldout", base + n + i) for i in range(cfg.num_heldout_tasks)]}

    def _task(self, split: str, seed: int) -> Task:
        return Task(task_id=f"{split}-{seed}", messages=[{"role": "system", "content": self.cfg.system_prompt}],
                    tools=[self.tool] if self.tool else [], metadata={"seed": seed})

    def render(self, observation: dict[str, Any]) -> str:
        """What the policy reads of an observation (``observation_field``, or its fields as JSON)."""
        if self.cfg.observation_field is not None:
            value = observation.get(self.cfg.observation_field, "")
            return value if isinstance(value, str) else json.dumps(value)
        fields = {k: v for k, v in observation.items() if k not in ("done", "reward", "metadata")}
        if len(fields) == 1 and isinstance(next(iter(fields.values())), str):
            return next(iter(fields.values()))
        return json.dumps(fields)

    def action_of(self, text: str, chat_format: str) -> tuple[dict[str, Any] | None, list[ToolCall], str]:
        """The action a reply makes, the calls it made, and what was wrong when it makes none."""
        if self.tool is None:
            return {self.cfg.text_field: text}, [], ""
        parsed = parse_action(text, chat_format)
        name = self.cfg.tool_name
        example = format_call(ToolCall(name=name, arguments={"...": "..."}), chat_format)
        if parsed.errors:
            return None, parsed.calls, "; ".join(parsed.errors)
        if len(parsed.calls) != 1 or parsed.calls[0].name != name:
            got = ", ".join(c.name for c in parsed.calls) or "none"
            return None, parsed.calls, f"Act with exactly one call of the {name} tool, as {example} (calls made: {got})."
        call = parsed.calls[0]
        problems = check_arguments(self.tool, call.arguments)
        return (None, [call], f"{name}: " + "; ".join(problems)) if problems else (call.arguments, [call], "")

    def make_env(self) -> Environment:
        return OpenEnvEpisode(self)

    def success(self, task: Task, answer: str | None) -> bool:
        return False  # an episode's success is its outcome (``success_at``), never an answer

    def demonstration(self, task: Task) -> list[dict[str, Any]]:
        raise ValueError("an OpenEnv environment has no demonstrations: set policy.sft.enabled=false, or warm-start "
                         "with policy.sft.env on an environment that has them")

    def provides(self) -> set[str]:
        return {"anchor"}


class OpenEnvEpisode(Environment):
    """One episode: one session of the server."""

    def __init__(self, source: OpenEnvSource) -> None:
        self.source, self.cfg = source, source.cfg
        self.max_turns = self.cfg.max_turns
        self.client: Any = None
        self.turn, self.done = 0, True

    async def _answer(self, what: str, coro: Any) -> Any:
        timeout = self.cfg.step_timeout_s
        try:
            return await asyncio.wait_for(coro, timeout)
        except TimeoutError:
            if not await asyncio.to_thread(self.source.server.healthy):
                self.source.server.stop()  # stopped answering at all: the next episode starts it again
            raise TimeoutError(f"openenv server {self.cfg.server.name!r} did not answer {what} within {timeout:g} s") from None

    async def reset(self, task: Task) -> Observation:
        url = await asyncio.to_thread(self.source.server.base_url)
        self.client = _client_cls()(base_url=url, connect_timeout_s=self.cfg.step_timeout_s,
                                    message_timeout_s=self.cfg.step_timeout_s + 1)
        result = await self._answer("reset", self.client.reset(seed=task.metadata["seed"], **self.cfg.reset_args))
        text = self.source.render(result.observation)
        self.turn, self.done = 0, bool(result.done)
        return Observation(messages=[{"role": "user", "content": text}], anchor=text)

    async def step(self, action: str) -> StepResult:
        if self.client is None or self.done:
            raise RuntimeError("step() called with no episode running: call reset(task) first")
        self.turn += 1
        payload, calls, problem = self.source.action_of(action, self.chat_format)
        reward, env_done = 0.0, False
        if payload is not None:
            try:
                result = await self._answer("step", self.client.step(payload))
            except RuntimeError as exc:
                if "VALIDATION_ERROR" not in str(exc):
                    raise
                problem = f"the environment refused the action: {exc}"
            else:
                text, reward, env_done = self.source.render(result.observation), float(result.reward or 0.0), bool(result.done)
        if problem:
            text = f"Error: {problem}"
        self.done = env_done or self.turn >= self.max_turns
        name = self.cfg.tool_name if self.source.tool else None
        message = tool_message(name, text) if name else {"role": "user", "content": text}
        return StepResult(observation=step_observation([message], self.done), reward=reward, done=self.done,
                          invalid_action=bool(problem), tool_calls=calls, info={"turn": self.turn, "env_done": env_done})

    def close(self) -> None:
        client, self.client = self.client, None
        if client is None:
            return
        try:
            task = asyncio.get_running_loop().create_task(client.close())
        except RuntimeError:  # no loop running (a synchronous caller)
            asyncio.run(client.close())
            return
        _CLOSING.add(task)
        task.add_done_callback(_CLOSING.discard)
