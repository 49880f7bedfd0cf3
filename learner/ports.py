"""The learner's outlets: claim and acknowledge batches, publish weights.

The learner worker stays plain Python; ``ActorLearnerPorts`` binds it to Ray actor handles,
``LocalLearnerPorts`` to objects in its own process.
"""

from __future__ import annotations

from typing import Any, Mapping, Protocol

from replay.base import Claim, LiveShare
from replay.client import poll_claim


class LearnerPorts(Protocol):
    def claim(self, n: int, live: LiveShare | None = None, wait_s: float = 0.0) -> Claim | None:
        """``n`` groups, waiting up to ``wait_s`` for them; None if they did not come."""
    def ack(self, claim_id: str, version: int, commit: bool = False) -> None: ...
    def commit(self, version: int) -> None: ...
    def publish(self, version: int, state: Mapping[str, Any]) -> None: ...
    def republish(self) -> int:
        """The last published version again (a restarted broker lost it); returns it."""


class ActorLearnerPorts:
    """``weights``: a ``rollout.weights`` config and the engine count, for the publisher the
    learner builds in its own process on first publish (object store when None)."""

    def __init__(self, replay: Any, broker: Any, weights: Any = None, run_dir: str = "", engines: int = 1) -> None:
        self.replay, self.broker = replay, broker
        self.weights, self.run_dir, self.engines = weights, run_dir, engines
        self._publisher: Any = None
        self._last: tuple[int, Any] | None = None
        """The last (version, handle) published: what a restarted broker is given again."""

    def claim(self, n: int, live: LiveShare | None = None, wait_s: float = 0.0) -> Claim | None:
        import ray

        return ray.get(self.replay.claim_wait.remote(n, live, wait_s))  # puts wake it (replay/host.py)

    def ack(self, claim_id: str, version: int, commit: bool = False) -> None:
        import ray

        ray.get(self.replay.ack.remote(claim_id, version, commit))

    def commit(self, version: int) -> None:
        import ray

        ray.get(self.replay.commit.remote(version))

    def publish(self, version: int, state: Mapping[str, Any]) -> None:
        import ray

        from learner.weights import ObjectStorePublisher, make_publisher

        if self._publisher is None:
            self._publisher = (ObjectStorePublisher() if self.weights is None
                               else make_publisher(self.weights, self.run_dir, self.engines))
        self._last = (version, self._publisher.publish(version, state))
        ray.get(self.broker.publish.remote(*self._last))

    def republish(self) -> int:
        """Runs beside a ``publish`` that may be waiting for the last version's broadcast to
        be received (engines find it only at the broker): the broker keeps the newest."""
        import ray

        last = self._last
        if last is not None:
            ray.get(self.broker.publish.remote(*last))
        return last[0] if last else 0


class LocalLearnerPorts:
    """The learner's outlets in one process: a replay store object (``replay.base.ReplayStore``)
    and the last published weights kept here (benches, tools and tests without Ray)."""

    def __init__(self, store: Any) -> None:
        self.store = store
        self.published: tuple[int, Mapping[str, Any]] | None = None

    def claim(self, n: int, live: LiveShare | None = None, wait_s: float = 0.0) -> Claim | None:
        return poll_claim(lambda: self.store.claim(n, live), wait_s)  # nothing to wake a local store

    def ack(self, claim_id: str, version: int, commit: bool = False) -> None:
        self.store.ack(claim_id, version, commit)

    def commit(self, version: int) -> None:
        self.store.commit(version)

    def publish(self, version: int, state: Mapping[str, Any]) -> None:
        self.published = (version, state)

    def republish(self) -> int:
        return self.published[0] if self.published else 0  # kept here: nothing was lost


def claim_batch(ports: LearnerPorts, n: int, live: int, wait_for_live: bool, wait_s: float) -> Claim | None:
    """One attempt at a batch of ``n`` groups, ``live`` of them live sessions, waiting up to
    ``wait_s``. With ``wait_for_live`` (or a batch of live sessions only) the batch is exactly
    that mix or nothing. Otherwise (``learner.live_shortfall: train_rollouts``) it is the
    ``n - live`` rollout groups plus as many of the ``live`` sessions as are ready, most first:
    the rollout share is what admission paces the producers by, so taking more rollout groups
    in place of missing sessions would outrun it. Sessions that arrive while the rollout
    groups are awaited wait for the next attempt (every ``wait_s``, 0.5 s in the learner)."""
    if not live:
        return ports.claim(n, None, wait_s)
    if wait_for_live or live == n:
        return ports.claim(n, (live, live), wait_s)
    for j in range(live, 0, -1):
        got = ports.claim(n - live + j, (j, j), 0.0)
        if got is not None:
            return got
    return ports.claim(n - live, None, wait_s)

