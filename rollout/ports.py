"""The rollout side's outlets, as plain async callables.

The worker never imports Ray: the driver hands it actor handles, and these adapters turn them
into the calls the worker (and the engine servers) make. A test (or a future in-process
deployment) can pass any object with the same coroutine methods.
"""

from __future__ import annotations

import uuid
from typing import Any, Protocol

from envs.formats import DEFAULT_FORMAT
from envs.base import Observation, StepResult, Task
from rollout.engines.base import AdapterSpec
from rollout.engines.transport import WeightHandle
from rollout.trajectory import Group


class SubmitLost(RuntimeError):
    """The reward service died while it held a submitted group (it restarts; the group is
    gone): the producer counts it dropped and gives its reservation back."""


class RolloutPorts(Protocol):
    async def reserve(self, n: int, wait_s: float = 0.0) -> int: ...
    async def release(self, n: int) -> None: ...
    async def submit(self, group: Group) -> Any: ...


INCARNATION_SEP = "#"
"""Between a producer's name and the token of one of its processes (``rollout-0#3f9a2c1b``)."""


def producer_name(producer: str) -> str:
    """The producer a reservation holder belongs to, whichever of its processes holds it."""
    return producer.split(INCARNATION_SEP, 1)[0]


class ActorPorts:
    """Ports backed by Ray actor handles (replay, reward). ``producer`` names this producer's
    reservations in replay, so they can be given back if it dies: its name (``name``) and a
    token of this process, drawn in the process that first uses it. Ray starts a restarted actor
    from the same pickled arguments, so without the token a call the dead process left in
    flight (an admission request waiting in replay) would be granted to the new one's name after
    the driver gave the dead one's reservations back, and held by no one forever."""

    def __init__(self, replay: Any, reward: Any, producer: str | None = None) -> None:
        self.replay, self.reward, self.name = replay, reward, producer
        self._token: str | None = None

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_token": None}  # every process its own

    @property
    def producer(self) -> str | None:
        if self.name is None:
            return None
        if self._token is None:
            self._token = uuid.uuid4().hex[:8]
        return f"{self.name}{INCARNATION_SEP}{self._token}"

    async def reserve(self, n: int, wait_s: float = 0.0) -> int:
        """Up to ``n`` admissions; with ``wait_s``, waits that long in replay for room."""
        if wait_s > 0:
            return await self.replay.reserve_wait.remote(n, self.producer, wait_s)
        return await self.replay.reserve.remote(n, self.producer)

    async def release(self, n: int) -> None:
        await self.replay.release.remote(n, self.producer)

    async def submit(self, group: Group) -> Any:
        import ray

        try:
            return await self.reward.submit.remote(group)
        except ray.exceptions.RayActorError as exc:
            raise SubmitLost(f"group {group.group_id}: the reward service died ({type(exc).__name__})") from exc


class WeightSyncSource:
    """The learner's weight sync (``learner.weights.WeightSync``) as a restarted engine's
    ``catch_up`` source: the newest version, loaded once before the engine serves (a version
    of ``adapter`` for a LoRA run that publishes its adapter alone). Found by its actor name on
    first use: an engine actor built with a name rather than a handle holds nothing in the
    object store that Ray would need to start it again."""

    def __init__(self, sync_name: str, adapter: AdapterSpec | None = None) -> None:
        self.sync_name, self.adapter = sync_name, adapter
        """``adapter``: the sync publishes versions of this LoRA adapter, not whole weights."""
        self._sync: Any = None

    def __getstate__(self) -> dict[str, Any]:
        return {"sync_name": self.sync_name, "adapter": self.adapter, "_sync": None}

    async def versions(self) -> list[tuple[AdapterSpec | None, int, WeightHandle]]:
        """What to load: the newest published version, if any."""
        if self._sync is None:
            import ray

            self._sync = ray.get_actor(self.sync_name)
        got = await self._sync.latest.remote()
        return [] if got is None else [(self.adapter, *got)]


class ActorEnvPort:
    """An ``envs.host.EnvHost`` Ray actor as a ``rollout.remote_env.EnvHostPort``."""

    def __init__(self, host: Any) -> None:
        self.handle = host

    async def open(self, task: Task, chat_format: str = DEFAULT_FORMAT) -> tuple[str, Observation, int]:
        return await self.handle.open.remote(task, chat_format)

    async def step(self, episode_id: str, action: str) -> StepResult:
        return await self.handle.step.remote(episode_id, action)

    def close(self, episode_id: str) -> None:
        self.handle.close.remote(episode_id)  # fire and forget: nothing waits on a close
