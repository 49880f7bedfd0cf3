"""Episodes of one environment hosted for remote callers, addressed by episode id.

Heavy environments (simulators, browsers, large indexes, tool sandboxes) run in their own
processes so their work neither stalls a rollout actor's event loop nor is duplicated in every
rollout actor's memory. The driver wraps ``EnvHost`` in a Ray actor; rollout actors drive
episodes through ``rollout.remote_env.RemoteEnvironment``. Plain Python: no Ray here.
"""

from __future__ import annotations

import uuid
from typing import Any

from envs.formats import DEFAULT_FORMAT
from envs.base import Environment, Observation, StepResult, Task
from envs.registry import make_task_source


class UnknownEpisodeError(KeyError):
    """A step for an episode this host does not hold (closed, or the host restarted)."""


class EnvHost:
    """Opens, steps and closes episodes of the environment ``env_cfg`` describes."""

    def __init__(self, env_cfg: Any) -> None:
        self.source = make_task_source(env_cfg)
        self._episodes: dict[str, Environment] = {}
        self._counts = {"opened": 0, "steps": 0, "closed": 0}

    async def open(self, task: Task, chat_format: str = DEFAULT_FORMAT) -> tuple[str, Observation, int]:
        """Start an episode: (episode id, first observation, turn limit). ``chat_format``: the
        policy's, which the episode parses actions in."""
        env = self.source.make_env()
        env.chat_format = chat_format
        episode_id = uuid.uuid4().hex
        self._episodes[episode_id] = env
        self._counts["opened"] += 1
        try:
            obs = await env.reset(task)
        except BaseException:
            self.close(episode_id)
            raise
        return episode_id, obs, env.max_turns

    async def step(self, episode_id: str, action: str) -> StepResult:
        env = self._episodes.get(episode_id)
        if env is None:
            raise UnknownEpisodeError(
                f"episode {episode_id} is not open on this environment actor (closed, or the "
                "actor restarted after a crash and lost it)")
        self._counts["steps"] += 1
        return await env.step(action)

    def close(self, episode_id: str) -> None:
        env = self._episodes.pop(episode_id, None)
        if env is not None:
            self._counts["closed"] += 1
            env.close()

    def stats(self) -> dict[str, int]:
        return {**self._counts, "open": len(self._episodes)}
