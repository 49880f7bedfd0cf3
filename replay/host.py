"""Hosts any replay backend inside one actor, so producers and the learner share it by handle.

For the in-process backend the actor *is* the store; for Redis it is a thin client (state
lives in Redis, so the actor can be restarted freely). The host also keeps which producer
holds how many reservations, so a producer that dies has them given back
(``release_producer``) instead of shrinking admission for the rest of the run.

Restarted (Redis only; cluster/actors.py): Ray re-sends the calls that were in flight when
the host died, so the host makes those safe to run twice where it can. An acknowledgement
carries an operation id made from its claim id (a re-sent one returns the first's reply, not
"unknown claim"). What stays imprecise: the reservation ledger starts empty (a producer that
dies later gives back only what it reserved since), a reservation or release whose reply was
lost is counted twice, and a claim whose reply was lost stays claimed until the next
``recover`` (counted in ``claimed``; a learner restart or ``--resume`` delivers it). A
restarted host also takes over the run's embedded redis-server: the dead host started and
watched it, so the new one shuts it down cleanly and starts it again on the same port.

The learner waits for a batch inside the host (``claim_wait``) rather than asking again and
again: the actor runs calls on several threads (``max_concurrency``), one at a time under a
lock, and a put wakes the waiting claim. Asked every 20 ms instead, the replay actor used
0.12 s of CPU an async step against 0.06 s a sync one (bench/pipeline.py, 2026-11-26), on
the generating core, and a batch waited up to 20 ms after its last put.
"""

from __future__ import annotations

import functools
import threading
import time
from pathlib import Path
from typing import Any, Callable, TypeVar

from replay.base import Claim, LiveShare, PutResult, ReplayStats
from replay.config import ReplayConfig
from replay.record import GroupRecord, as_record
from replay.registry import make_store
from rollout.ports import producer_name
from rollout.trajectory import Group

F = TypeVar("F", bound=Callable[..., Any])
T = TypeVar("T")
ACTOR_THREADS = 9
"""``max_concurrency`` for the host's actor (the run adds one per rollout worker, whose
admission request waits here for room): the waiting claim, producers' puts and stats, and the
driver's ``vigil``, which holds one thread for the host's life."""
RECHECK_S = 0.25
"""A waiting claim or reservation also looks again this often: a group put into Redis, or an
ack made, by another client (not through this host) wakes no one."""


def _serial(method: F) -> F:
    """One call at a time: the stores are not thread-safe."""

    @functools.wraps(method)
    def locked(self: "ReplayHost", *args: Any, **kwargs: Any) -> Any:
        with self._changed:
            return method(self, *args, **kwargs)

    return locked  # type: ignore[return-value]


class ReplayHost:
    def __init__(self, cfg: ReplayConfig, batch_groups: int, run_dir: str, run_id: str) -> None:
        self.restarted = _restarted_actor()
        """Ray started this host again after its process died."""
        if self.restarted and cfg.type == "redis" and cfg.url == "embedded":
            from replay.redis_server import stop_embedded

            stop_embedded(run_dir)  # make_store starts it again, and this host watches it
        self.store = make_store(cfg, batch_groups, Path(run_dir), run_id)
        self._durable_acks = cfg.type == "redis"
        self._held: dict[str, int] = {}
        """Producer process -> reservations granted and not yet used by a put or released."""
        self._gone: set[str] = set()
        """Producer processes given up for dead (``release_producer``): what they still ask
        for is refused, what they give back was given back already."""
        self._changed = threading.Condition()
        """Held by every call; notified when groups may have become claimable."""

    @_serial
    def reserve(self, n: int, producer: str | None = None) -> int:
        if producer in self._gone:  # a dead process's request, still waiting here
            return 0
        granted = self.store.reserve(n)
        if producer is not None:
            self._held[producer] = self._held.get(producer, 0) + granted
        return granted

    @_serial
    def reserve_wait(self, n: int, producer: str | None = None, wait_s: float = 0.0) -> int:
        """``reserve``, waiting up to ``wait_s`` for room when none is free now (an ack,
        which publishes a version, or a release wakes it): a producer that starts its groups
        in waves (``rollout.admission``) starts the next one as soon as admission allows, not
        at its next poll."""
        return self._retry(lambda: self.reserve(n, producer), wait_s)

    @_serial
    def release(self, n: int, producer: str | None = None) -> None:
        if producer in self._gone:  # ``release_producer`` gave them back
            return
        self.store.release(n)
        if producer is not None:
            self._held[producer] = max(0, self._held.get(producer, 0) - n)
        self._changed.notify_all()

    def put(self, group: Group | GroupRecord, scheduled: bool = True) -> PutResult:
        return self.put_many([group], scheduled)[0]

    @_serial
    def put_many(self, groups: list[Group | GroupRecord], scheduled: bool = True) -> list[PutResult]:
        """Producers in other processes send records (``GroupRecord.of``): the host then
        neither unpickles models nor encodes them (replay/record.py)."""
        records = [as_record(g) for g in groups]
        results = self.store.put_many(records, scheduled)
        for record, result in zip(records, results):
            producer = record.producer
            if scheduled and producer in self._held and result.status in ("accepted", "stale"):
                self._held[producer] = max(0, self._held[producer] - 1)  # the put used its reservation
        self._changed.notify_all()
        return results

    @_serial
    def release_producer(self, producer: str) -> int:
        """Give back every reservation ``producer`` holds (it died with its groups in flight)
        and refuse its dead processes' calls still in flight (``rollout.ports.ActorPorts``);
        returns how many: the groups it lost. Called before the producer's new process asks."""
        dead = [p for p in self._held if producer_name(p) == producer]
        n = sum(self._held.pop(p) for p in dead)
        self._gone.update(dead)
        if n:
            self.store.release(n)
            self._changed.notify_all()  # the room is free for the live producers waiting
        return n

    @_serial
    def live_room(self) -> int:
        return self.store.live_room()

    @_serial
    def claim(self, n: int, live: LiveShare | None = None) -> Claim | None:
        return self.store.claim(n, live)

    @_serial
    def claim_wait(self, n: int, live: LiveShare | None = None, wait_s: float = 0.0) -> Claim | None:
        """``claim``, waiting up to ``wait_s`` for the groups to arrive (a put wakes it)."""
        return self._retry(lambda: self.store.claim(n, live), wait_s)

    def _retry(self, attempt: Callable[[], T], wait_s: float) -> T:
        """``attempt()`` again whenever ``_changed`` is notified (or every ``RECHECK_S``) until
        it gives a claim or a grant, or ``wait_s`` has passed. The caller holds ``_changed``;
        waiting releases it, so puts, acks and releases go on meanwhile."""
        deadline = time.monotonic() + wait_s
        while True:
            got = attempt()
            left = deadline - time.monotonic()
            if got or left <= 0:  # None (no claim) and 0 (no grant) are nothing yet
                return got
            self._changed.wait(min(left, RECHECK_S))

    @_serial
    def ack(self, claim_id: str, version: int, commit: bool = False) -> None:
        if self._durable_acks:  # one operation id per claim: Ray's re-sent call runs once
            self.store.ack(claim_id, version, commit, op_id=f"ack-{claim_id}")
        else:
            self.store.ack(claim_id, version, commit)
        self._changed.notify_all()  # a new version widens admission: wakes ``reserve_wait``

    @_serial
    def commit(self, version: int) -> int:
        return self.store.commit(version)

    @_serial
    def recover(self, checkpoint_version: int | None = None) -> int:
        requeued = self.store.recover(checkpoint_version)
        self._changed.notify_all()
        return requeued

    @_serial
    def stats(self) -> ReplayStats:
        return self.store.stats()

    @_serial
    def close(self) -> None:
        self.store.close()

    def vigil(self) -> None:
        """Never returns: the driver's call that fails the moment this process dies (no
        lock held; it takes one of the actor's threads for good)."""
        threading.Event().wait()


def _restarted_actor() -> bool:
    """Whether this process is a Ray actor started again after its first process died."""
    import sys

    if "ray" not in sys.modules:  # in-process (tests, tools): never restarted
        return False
    import ray

    if not ray.is_initialized() or ray.get_runtime_context().get_actor_id() is None:
        return False  # the driver or a task built it
    return bool(ray.get_runtime_context().was_current_actor_reconstructed)
