"""An engine as a service: the plain class the driver wraps as a Ray actor.

One ``EngineServer`` owns one engine. Its methods are the engine's verbs (generate, stream,
abort, pause, resume, update_weights) plus weight following: with a weight source (the
learner's broker, through an adapter with ``async latest(have) -> (version, WeightHandle) |
None``) it polls for newer versions in the background and loads them without failing a request.
A caller may hold the version it synced to (``sync_weights(hold_s)``: a rollout actor's wave,
whose episodes then run on one version) and the follower waits until that hold ends.
Clients reach a group of these through ``rollout.engines.client.RayEngineClient``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, AsyncIterator

from rollout.cores import pin_process
from rollout.engines import make_engine
from rollout.engines.base import Chunk, Completion, SamplingParams
from rollout.engines.transport import WeightHandle
from storage import node_copy

log = logging.getLogger(__name__)


class EngineServer:
    def __init__(self, cfg: Any, model_path: str, seed: int = 0, weights: Any = None, rank: int = 1,
                 follow: bool = False) -> None:
        """``rank``: this engine's rank in the learner's weight broadcast group (1..N).
        ``follow``: this server owns its process (an actor): its first request calls
        ``start`` if nobody has, so an actor that Ray started again after a crash pins its
        cores and serves the newest weights, not the ones it was built with."""
        self.cfg, self.weights, self.rank, self._follow_on_use = cfg, weights, rank, follow
        self._joined: dict[str, Any] | None = None
        # a stored policy (``cluster.storage``) is copied to this node first
        self.engine = make_engine(cfg, node_copy(model_path), seed=seed)
        self._follower: asyncio.Task | None = None
        self._starting: asyncio.Future | None = None
        self._sync_lock: asyncio.Lock | None = None
        self._follow_errors = 0
        self._hold_until = 0.0
        """Monotonic time until which the follower loads nothing (``sync_weights(hold_s)``)."""

    async def start(self) -> int:
        """Take the configured intra-op threads (the actor's process is the engine's own) and
        begin following the weight source (idempotent); returns the serving version. An
        in-process client never calls it: it leaves its host's threads alone and syncs weights
        when asked."""
        import torch

        self._follow_on_use = False
        torch.set_num_threads(self.cfg.torch_threads)
        if self.cfg.cpu_affinity:
            pin_process(self.cfg.cpu_affinity, "rollout.engine.cpu_affinity")
        if self.weights is not None and self._follower is None:
            self._follower = asyncio.get_running_loop().create_task(self._follow())
        return self.engine.version

    async def _started(self) -> None:
        """In an actor nobody started (Ray started it again after a crash): start, and load
        the newest weights before the first request is served; concurrent first requests
        share the one start."""
        if self._follow_on_use and self._starting is None:
            self._starting = asyncio.ensure_future(self._restart())
        if self._starting is not None and not self._starting.done():
            await self._starting

    async def _restart(self) -> None:
        await self.start()
        await self._load_newest()
        log.warning("engine %d: started again (a restarted actor), serving version %d", self.rank, self.engine.version)

    async def _follow(self) -> None:
        while True:
            try:
                await self._load_newest(follower=True)
            except Exception:  # noqa: BLE001 - a failed poll must not stop serving
                self._follow_errors += 1
                log.exception("engine: polling the weight source failed; serving the current version")
            await asyncio.sleep(self.cfg.weight_poll_s)

    async def sync_weights(self, hold_s: float = 0.0) -> int:
        """Load the newest published version now, if newer than the one serving, and end any
        earlier hold; with ``hold_s`` keep serving it (the follower idle) for up to that long
        or until the next sync. A weight update mid-episode makes the episode's cached turns
        stale (its next turn is computed again from the start): a wave started together and
        held runs on one version, as a sync step does."""
        await self._started()
        return await self._load_newest(hold_s=hold_s)

    async def _load_newest(self, follower: bool = False, hold_s: float = 0.0) -> int:
        """Load the newest version: a sync (ending any hold, then holding for ``hold_s``), or
        the ``follower``'s poll, which loads nothing while a hold lasts."""
        if self.weights is None:
            return self.engine.version
        if self._sync_lock is None:
            self._sync_lock = asyncio.Lock()
        async with self._sync_lock:  # the follower and an explicit sync never load twice
            if follower and time.monotonic() < self._hold_until:  # checked under the lock: a
                return self.engine.version  # poll that waited out a sync sees the sync's hold
            got = await self.weights.latest(self.engine.version)
            if got is not None:
                await self._join_group_of(got[1])
                await self.engine.update_weights(*got)
            if not follower:
                self._hold_until = time.monotonic() + hold_s
        return self.engine.version

    async def _join_group_of(self, handle: WeightHandle) -> None:
        """A broadcast handle names its group: join it (as this engine's rank) before the
        first version sent over it; every engine of the group does the same."""
        init = getattr(handle, "init", None)
        if init is not None and init != self._joined:
            await self.engine.join_weight_group({**init, "rank": self.rank})
            self._joined = init

    async def generate(self, prompt_ids: list[int], params: SamplingParams, request_id: str) -> Completion:
        await self._started()
        return await self.engine.generate(prompt_ids, params, request_id)

    async def stream(self, prompt_ids: list[int], params: SamplingParams,
                     request_id: str) -> AsyncIterator[Chunk]:
        await self._started()
        async for chunk in self.engine.stream(prompt_ids, params, request_id):
            yield chunk

    async def abort(self, request_id: str) -> bool:
        return await self.engine.abort(request_id)

    async def join_weight_group(self, init: dict[str, Any]) -> None:
        await self.engine.join_weight_group(init)

    async def prompt_logprobs(self, prompt_ids: list[int], first: int = 1) -> tuple[int, list[float]]:
        await self._started()
        return await self.engine.prompt_logprobs(prompt_ids, first)

    async def pause(self) -> None:
        await self.engine.pause()

    async def resume(self) -> None:
        await self.engine.resume()

    async def update_weights(self, version: int, handle: WeightHandle) -> int:
        return await self.engine.update_weights(version, handle)

    def version(self) -> int:
        return self.engine.version

    async def vigil(self) -> None:
        """Never returns: the driver's call that fails the moment this process dies (an engine
        on the broadcast weight transport, which is not restarted, ends the run at once)."""
        await asyncio.Event().wait()

    def stats(self) -> dict[str, float]:
        return {**self.engine.stats(), "weight_poll_errors": float(self._follow_errors)}
