"""The learner's outlets: claim and acknowledge batches, publish weights.

The learner worker stays plain Python; this adapter binds it to Ray actor handles.
"""

from __future__ import annotations

from typing import Any, Mapping, Protocol

from replay.base import Claim, LiveShare


class LearnerPorts(Protocol):
    def claim(self, n: int, live: LiveShare | None = None) -> Claim | None: ...
    def ack(self, claim_id: str, version: int) -> None: ...
    def commit(self, version: int) -> None: ...
    def publish(self, version: int, state: Mapping[str, Any]) -> None: ...


class ActorLearnerPorts:
    def __init__(self, replay: Any, broker: Any) -> None:
        self.replay, self.broker = replay, broker

    def claim(self, n: int, live: LiveShare | None = None) -> Claim | None:
        import ray

        return ray.get(self.replay.claim.remote(n, live))

    def ack(self, claim_id: str, version: int) -> None:
        import ray

        ray.get(self.replay.ack.remote(claim_id, version))

    def commit(self, version: int) -> None:
        import ray

        ray.get(self.replay.commit.remote(version))

    def publish(self, version: int, state: Mapping[str, Any]) -> None:
        import ray

        ray.get(self.broker.publish.remote(version, [ray.put(dict(state))]))
