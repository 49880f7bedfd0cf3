"""The rollout actor's outlets, as plain async callables.

The worker never imports Ray: the driver hands it actor handles, and this adapter turns them
into the four calls the worker makes. A test (or a future in-process deployment) can pass
any object with the same coroutine methods.
"""

from __future__ import annotations

from typing import Any, Mapping, Protocol

from envs.base import Observation, StepResult, Task
from rollout.trajectory import Group


class RolloutPorts(Protocol):
    async def reserve(self, n: int) -> int: ...
    async def release(self, n: int) -> None: ...
    async def submit(self, group: Group) -> Any: ...
    async def latest_weights(self, have: int) -> tuple[int, Mapping[str, Any]] | None: ...


class ActorPorts:
    """Ports backed by Ray actor handles (replay, reward, weight broker)."""

    def __init__(self, replay: Any, reward: Any, broker: Any) -> None:
        self.replay, self.reward, self.broker = replay, reward, broker

    async def reserve(self, n: int) -> int:
        return await self.replay.reserve.remote(n)

    async def release(self, n: int) -> None:
        await self.replay.release.remote(n)

    async def submit(self, group: Group) -> Any:
        return await self.reward.submit.remote(group)

    async def latest_weights(self, have: int) -> tuple[int, Mapping[str, Any]] | None:
        got = await self.broker.latest.remote(have)
        if got is None:
            return None
        version, boxed = got  # the state dict travels as an object ref inside a list
        return version, await boxed[0]


class ActorEnvPort:
    """An ``envs.host.EnvHost`` Ray actor as a ``rollout.remote_env.EnvHostPort``."""

    def __init__(self, host: Any) -> None:
        self.handle = host

    async def open(self, task: Task) -> tuple[str, Observation, int]:
        return await self.handle.open.remote(task)

    async def step(self, episode_id: str, action: str) -> StepResult:
        return await self.handle.step.remote(episode_id, action)

    def close(self, episode_id: str) -> None:
        self.handle.close.remote(episode_id)  # fire and forget: nothing waits on a close
