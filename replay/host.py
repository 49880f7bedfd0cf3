"""Hosts any replay backend inside one actor, so producers and the learner share it by handle.

For the in-process backend the actor *is* the store; for Redis it is a thin client (state
lives in Redis, so the actor can be restarted freely). The host also keeps which producer
holds how many reservations, so a producer that dies has them given back
(``release_producer``) instead of shrinking admission for the rest of the run.
"""

from __future__ import annotations

from pathlib import Path

from replay.base import Claim, LiveShare, PutResult, ReplayStats
from replay.config import ReplayConfig
from replay.registry import make_store
from rollout.trajectory import Group


class ReplayHost:
    def __init__(self, cfg: ReplayConfig, batch_groups: int, run_dir: str, run_id: str) -> None:
        self.store = make_store(cfg, batch_groups, Path(run_dir), run_id)
        self._held: dict[str, int] = {}
        """Producer -> reservations granted and not yet used by a put or released."""

    def reserve(self, n: int, producer: str | None = None) -> int:
        granted = self.store.reserve(n)
        if producer is not None:
            self._held[producer] = self._held.get(producer, 0) + granted
        return granted

    def release(self, n: int, producer: str | None = None) -> None:
        self.store.release(n)
        if producer is not None:
            self._held[producer] = max(0, self._held.get(producer, 0) - n)

    def put(self, group: Group, scheduled: bool = True) -> PutResult:
        result = self.store.put(group, scheduled)
        producer = group.trajectories[0].metadata.get("producer")
        if scheduled and producer in self._held and result.status in ("accepted", "stale"):
            self._held[producer] = max(0, self._held[producer] - 1)  # the put used its reservation
        return result

    def release_producer(self, producer: str) -> int:
        """Give back every reservation ``producer`` holds (it died with its groups in flight);
        returns how many: the groups it lost."""
        n = self._held.pop(producer, 0)
        if n:
            self.store.release(n)
        return n

    def live_room(self) -> int:
        return self.store.live_room()

    def claim(self, n: int, live: LiveShare | None = None) -> Claim | None:
        return self.store.claim(n, live)

    def ack(self, claim_id: str, version: int) -> None:
        self.store.ack(claim_id, version)

    def commit(self, version: int) -> int:
        return self.store.commit(version)

    def recover(self, checkpoint_version: int | None = None) -> int:
        return self.store.recover(checkpoint_version)

    def stats(self) -> ReplayStats:
        return self.store.stats()

    def close(self) -> None:
        self.store.close()
