"""An environment episode whose work runs elsewhere (an ``envs.host.EnvHost`` actor).

``RemoteEnvironment`` is an ordinary ``Environment`` to the episode loop, so an episode reads
the same whether its environment is local or remote; a host that crashes fails the episodes
it held (their next call raises), not the run.
"""

from __future__ import annotations

from typing import Protocol

from envs.formats import DEFAULT_FORMAT
from envs.base import Environment, Observation, StepResult, Task


class EnvHostPort(Protocol):
    """The three calls a remote episode makes (``rollout.ports.ActorEnvPort`` binds Ray)."""

    async def open(self, task: Task, chat_format: str = DEFAULT_FORMAT) -> tuple[str, Observation, int]: ...
    async def step(self, episode_id: str, action: str) -> StepResult: ...
    def close(self, episode_id: str) -> None: ...


class RemoteEnvironment(Environment):
    def __init__(self, host: EnvHostPort) -> None:
        self.host = host
        self.episode_id: str | None = None

    async def reset(self, task: Task) -> Observation:
        self.episode_id, obs, self.max_turns = await self.host.open(task, self.chat_format)
        return obs

    async def step(self, action: str) -> StepResult:
        if self.episode_id is None:
            raise RuntimeError("step() before reset()")
        return await self.host.step(self.episode_id, action)

    def close(self) -> None:
        if self.episode_id is not None:
            self.host.close(self.episode_id)
            self.episode_id = None


class HostPicker:
    """Hands each new episode the next host, round-robin."""

    def __init__(self, hosts: list[EnvHostPort]) -> None:
        if not hosts:
            raise ValueError("HostPicker needs at least one environment host")
        self.hosts, self._next = hosts, 0

    def make_env(self) -> RemoteEnvironment:
        host = self.hosts[self._next % len(self.hosts)]
        self._next += 1
        return RemoteEnvironment(host)
