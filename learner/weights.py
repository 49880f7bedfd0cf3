"""Versioned weights: the learner publishes, one owner pushes them to every reader.

A publisher (one per ``rollout.weights.transport``) turns a state dict into a weight handle
(``rollout.engines.transport``): a state dict in Ray's object store, a safetensors file, or the
bucket layout of a broadcast the learner sends in the background. ``WeightSync`` is the one
owner of weight sync: the learner hands it each new (version, handle) and it pushes the version
to every model scorer and every engine (``update_weights``), and only once they all serve it
acknowledges the trained batch to replay, so replay's admission widens exactly when the engines
serve the version it counts from. Nothing polls.
"""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Mapping, Protocol

from rollout.engines.transport import (BroadcastGroup, BroadcastWeights, FileWeightsWriter, ObjectStoreWeights,
                                       WeightHandle, plan_buckets)


class ObjectStorePublisher:
    """State dicts into Ray's object store."""

    def publish(self, version: int, state: Mapping[str, Any]) -> WeightHandle:
        return ObjectStoreWeights.put(state)


class FilePublisher:
    """One safetensors file per version in ``directory`` (the newest two kept)."""

    def __init__(self, directory: str) -> None:
        self.writer = FileWeightsWriter(directory)

    def publish(self, version: int, state: Mapping[str, Any]) -> WeightHandle:
        return self.writer.publish(version, state)


class BroadcastPublisher:
    """Learner rank 0 of the weight broadcast group (rank 0 of ``1 + engines`` members).

    The group forms once, at the run's start: the driver has this rank (``join``) and every
    engine (``join_weight_group`` with ``init``) join it together. ``publish`` returns the
    handle at once and sends on a background thread, after the group has formed: receiving
    is a collective, so the send finishes only when every engine has loaded the version (the
    weight sync pushes it to all of them). A publish first waits for the previous send, so at
    most one version is ever in flight and no engine can skip one."""

    def __init__(self, engines: int, bucket_mib: int, timeout_s: float) -> None:
        import threading

        import torch

        from learner.deepspeed_setup import free_port  # here: the sync actor never imports torch

        self.device = "cuda" if torch.cuda.is_available() else "cpu"
        self.init = {"host": _node_ip(), "port": free_port(""), "world_size": 1 + engines,
                     "backend": "nccl" if self.device == "cuda" else "gloo", "timeout_s": timeout_s}
        self.bucket_bytes, self.timeout_s = bucket_mib << 20, timeout_s
        self._group: BroadcastGroup | None = None
        self._formed = threading.Event()
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="weights-broadcast")
        self._sending: Future | None = None
        self.sent_bytes = 0

    def join(self) -> None:
        """Form the group as its rank 0; returns once every engine has joined too."""
        if self._group is None:
            self._group = BroadcastGroup(self.init, rank=0, device=self.device)
            self._formed.set()

    def publish(self, version: int, state: Mapping[str, Any]) -> WeightHandle:
        if self._sending is not None:
            self._sending.result()  # re-raises a failed send here, in the learner
        layout = plan_buckets(state, self.bucket_bytes)
        self._sending = self._pool.submit(self._send, dict(state), layout)
        return BroadcastWeights(layout)

    def _send(self, state: dict[str, Any], layout: list[dict[str, Any]]) -> None:
        # A learner restored from a checkpoint publishes in its constructor, before the driver's
        # join step: the send waits for it.
        if not self._formed.wait(self.timeout_s):
            raise TimeoutError(f"the weight broadcast group did not form within {self.timeout_s:.0f}s "
                               "(rollout.weights.timeout_s): the run's engines never joined it")
        self.sent_bytes += self._group.send(state, layout)


def _node_ip() -> str:
    try:
        import ray

        return ray.util.get_node_ip_address()
    except Exception:  # noqa: BLE001 - outside Ray (tests, tools): this host
        return "127.0.0.1"


def make_publisher(cfg: Any, run_dir: str, engines: int) -> Any:
    """The publisher for ``rollout.weights`` (a ``WeightSyncConfig``)."""
    if cfg.transport == "file":
        return FilePublisher(f"{run_dir}/weights")
    if cfg.transport == "broadcast":
        return BroadcastPublisher(engines, cfg.bucket_mib, cfg.timeout_s)
    return ObjectStorePublisher()


class WeightTarget(Protocol):
    """An engine (group) or model scorer the weight sync pushes to."""

    async def update_weights(self, version: int, handle: WeightHandle) -> int | None:
        """Serve ``version`` from ``handle``; returns once it does (None: the target's process
        died, and catches up from ``WeightSync.latest`` when Ray starts it again)."""


class ReplayAck(Protocol):
    async def ack(self, claim_id: str, version: int, commit: bool) -> None:
        """Replay's ``ack``: the claim was trained on; the learner now publishes ``version``."""


class WeightSync:
    """The one owner of weight sync (a Ray actor in a run, an object in benches and tests).

    ``publish`` pushes a version to every model scorer, then to every engine (a trajectory an
    engine generates with it finds it held by the scorers), and once they all serve it,
    acknowledges the batch it came from to replay (``ack``: claim id and commit). Versions go
    out one at a time, in order: a broadcast's receivers must take every version the learner
    sends. ``latest`` is what an engine that Ray started again loads before it serves; a
    restarted sync holds nothing until the learner publishes again, which the driver has it do
    at once (``LearnerWorker.republish``), and meanwhile engines keep serving what they have.

    Why an actor of its own, not the learner's rank 0: it outlives a learner restart (a new
    learner continues above the version it holds), restarted engines find it by name, and the
    learner's next step never waits for the engines to load a version (one push in flight)."""

    def __init__(self, engines: list[WeightTarget], scorers: list[WeightTarget] = (),
                 replay: ReplayAck | None = None) -> None:
        self.engines, self.scorers, self.replay = list(engines), list(scorers), replay
        self._latest: tuple[int, WeightHandle | None] = (0, None)
        """(version, handle), replaced whole: readers never see one without the other."""
        self._served = -1
        """The newest version every engine and scorer serves (-1: none pushed yet; a LoRA run's
        adapter is pushed from version 0, its first, which engines must load before serving)."""
        self._pushing = asyncio.Lock()  # binds to a loop at first use (Python >= 3.10), not here
        self._counts = {"pushes": 0, "push_s": 0.0, "acks": 0, "lost_targets": 0}

    async def publish(self, version: int, handle: WeightHandle,
                      ack: tuple[str, bool] | None = None) -> int:
        """Push ``version`` to every engine and scorer, then ``ack`` = (claim id, commit) the
        batch it was trained on; returns the newest version they all serve. An older version
        (a republish racing a publish) only re-acks: targets serve nothing older than they have."""
        if self._latest[1] is None or version > self._latest[0]:  # before the push: a restarting engine loads it
            self._latest = (version, handle)
        async with self._pushing:
            if version > self._served:
                t0 = time.perf_counter()
                for targets in (self.scorers, self.engines):
                    done = await asyncio.gather(*[t.update_weights(version, handle) for t in targets])
                    self._counts["lost_targets"] += sum(v is None for v in done)
                self._served = version
                self._counts["pushes"] += 1
                self._counts["push_s"] += time.perf_counter() - t0
            if ack is not None and self.replay is not None:
                await self.replay.ack(ack[0], version, ack[1])
                self._counts["acks"] += 1
        return self._served

    async def settle(self) -> int:
        """Wait for the push (and acknowledgement) in flight; returns the version served."""
        async with self._pushing:
            return self._served

    def latest(self) -> tuple[int, WeightHandle] | None:
        """The newest published (version, handle), for a restarted engine to catch up from."""
        version, handle = self._latest
        return None if handle is None else (version, handle)

    def version(self) -> int:
        return self._latest[0]

    def stats(self) -> dict[str, float]:
        return {**self._counts, "version": float(self._latest[0]), "served": float(self._served)}

    async def vigil(self) -> None:
        """Never returns: the driver's call that fails the moment this process dies."""
        await asyncio.Event().wait()
