"""Versioned weights: the learner publishes, engines and scorers poll.

A publisher (one per ``rollout.weights.transport``) turns a state dict into a weight handle
(``rollout.engines.transport``): a state dict in Ray's object store, a safetensors file, or the
bucket layout of a broadcast the learner sends in the background. The broker holds only the
newest (version, handle); engines ask for anything newer than what they serve.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Mapping

from learner.deepspeed_setup import free_port
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

    ``publish`` returns the handle at once and sends on a background thread: receiving is a
    collective, so the send finishes only when every engine has loaded the version (they poll
    the broker for it). A publish first waits for the previous send, so at most one version is
    ever in flight and no engine can skip one. The group forms on the first send, when the
    engines join it from the first handle they see."""

    def __init__(self, engines: int, bucket_mib: int, timeout_s: float) -> None:
        import torch

        self.device = "cuda" if torch.cuda.is_available() else "cpu"
        self.init = {"host": _node_ip(), "port": free_port(""), "world_size": 1 + engines,
                     "backend": "nccl" if self.device == "cuda" else "gloo", "timeout_s": timeout_s}
        self.bucket_bytes = bucket_mib << 20
        self._group: BroadcastGroup | None = None
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="weights-broadcast")
        self._sending: Future | None = None
        self.sent_bytes = 0

    def publish(self, version: int, state: Mapping[str, Any]) -> WeightHandle:
        if self._sending is not None:
            self._sending.result()  # re-raises a failed send here, in the learner
        layout = plan_buckets(state, self.bucket_bytes)
        self._sending = self._pool.submit(self._send, dict(state), layout)
        return BroadcastWeights(layout, self.init)

    def _send(self, state: dict[str, Any], layout: list[dict[str, Any]]) -> None:
        if self._group is None:
            self._group = BroadcastGroup(self.init, rank=0, device=self.device)
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


class WeightBroker:
    """The newest (version, handle). Restartable (cluster/actors.py): a restarted broker holds
    nothing until the learner publishes again, which the driver has it do at once
    (``LearnerWorker.republish``); until then engines keep serving what they have."""

    def __init__(self) -> None:
        import threading

        self._latest: tuple[int, WeightHandle | None] = (0, None)
        """(version, handle), replaced whole: readers never see one without the other."""
        self._lock = threading.Lock()
        """Two threads (the driver's vigil holds one): a republish of an older version racing
        a publish of a newer one must never win."""

    def publish(self, version: int, handle: WeightHandle) -> None:
        """``handle``: where the version's weights are (its tensors never pass through here)."""
        with self._lock:
            if version > self._latest[0]:
                self._latest = (version, handle)

    def latest(self, have: int) -> tuple[int, WeightHandle] | None:
        version, handle = self._latest
        if handle is None or version <= have:
            return None
        return version, handle

    def version(self) -> int:
        return self._latest[0]

    def vigil(self) -> None:
        """Never returns: the driver's call that fails the moment this process dies."""
        import threading

        threading.Event().wait()
