"""Hosts any replay backend inside one actor, so producers and the learner share it by handle.

For the in-process backend the actor *is* the store; for Redis it is a thin client (state
lives in Redis, so the actor can be restarted freely).
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

    def reserve(self, n: int) -> int:
        return self.store.reserve(n)

    def release(self, n: int) -> None:
        self.store.release(n)

    def put(self, group: Group, scheduled: bool = True) -> PutResult:
        return self.store.put(group, scheduled)

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
