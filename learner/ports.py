"""The learner's outlets: claim batches, publish weights (the weight sync acknowledges them).

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
    def commit(self, version: int) -> None: ...
    def publish(self, version: int, state: Mapping[str, Any], ack: tuple[str, bool] | None = None) -> None:
        """Hand ``version`` to the weight sync, which acknowledges ``ack`` = (claim id, commit)
        to replay once every engine serves it; returns without waiting for that."""
    def settle(self) -> None:
        """Wait until the last published version is served and its batch acknowledged."""
    def republish(self) -> int:
        """The last published version again (a restarted weight sync lost it); returns it."""


class ActorLearnerPorts:
    """``sync``: the run's ``learner.weights.WeightSync`` actor. ``weights``: a
    ``rollout.weights`` config and the engine count, for the publisher the learner builds in
    its own process (object store when None)."""

    def __init__(self, replay: Any, sync: Any, weights: Any = None, run_dir: str = "", engines: int = 1) -> None:
        self.replay, self.sync = replay, sync
        self.weights, self.run_dir, self.engines = weights, run_dir, engines
        self._publisher: Any = None
        self._last: tuple[int, Any] | None = None
        """The last (version, handle) published: what a restarted weight sync is given again."""
        self._pushing: Any = None
        """The weight sync's call for the last version (an ObjectRef): one in flight at a time."""

    def claim(self, n: int, live: LiveShare | None = None, wait_s: float = 0.0) -> Claim | None:
        import ray

        return ray.get(self.replay.claim_wait.remote(n, live, wait_s))  # puts wake it (replay/host.py)

    def commit(self, version: int) -> None:
        import ray

        self.settle()  # a commit forgets acknowledged claims: the version's ack goes first
        ray.get(self.replay.commit.remote(version))

    def publisher(self) -> Any:
        from learner.weights import ObjectStorePublisher, make_publisher

        if self._publisher is None:
            self._publisher = (ObjectStorePublisher() if self.weights is None
                               else make_publisher(self.weights, self.run_dir, self.engines))
        return self._publisher

    def publish(self, version: int, state: Mapping[str, Any], ack: tuple[str, bool] | None = None) -> None:
        self.settle()  # versions reach the engines one at a time, in order
        self._last = (version, self.publisher().publish(version, state))
        self._pushing = self.sync.publish.remote(*self._last, ack)

    def settle(self) -> None:
        import ray

        if self._pushing is not None:
            ray.get(self._pushing)
            self._pushing = None

    def republish(self) -> int:
        """Runs beside a ``publish`` that may be waiting on the sync it replaces (Ray re-sends
        that call, acknowledgement included, to the new process): the sync keeps the newest."""
        import ray

        last = self._last
        if last is not None:
            ray.get(self.sync.publish.remote(*last, None))
        return last[0] if last else 0


class LocalLearnerPorts:
    """The learner's outlets in one process: a replay store object (``replay.base.ReplayStore``)
    and the last published weights kept here (benches, tools and tests without Ray): the
    caller loads ``published`` into its engine; nothing generates meanwhile, so the batch is
    acknowledged at once."""

    def __init__(self, store: Any) -> None:
        self.store = store
        self.published: tuple[int, Mapping[str, Any]] | None = None

    def claim(self, n: int, live: LiveShare | None = None, wait_s: float = 0.0) -> Claim | None:
        return poll_claim(lambda: self.store.claim(n, live), wait_s)  # nothing to wake a local store

    def commit(self, version: int) -> None:
        self.store.commit(version)

    def publish(self, version: int, state: Mapping[str, Any], ack: tuple[str, bool] | None = None) -> None:
        self.published = (version, state)
        if ack is not None:
            self.store.ack(ack[0], version, ack[1])

    def settle(self) -> None:
        pass

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

