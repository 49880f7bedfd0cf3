"""An engine as a service: the plain class the driver wraps as a Ray actor.

One ``EngineServer`` owns one engine. Its methods are the engine's verbs (generate, stream,
abort, pause, resume, update_weights). New weights are pushed to it (``update_weights``, by the
learner's weight sync, ``learner.weights.WeightSync``); it never polls. An engine actor that Ray
started again after a crash catches up first: before it serves anything it loads what its
``catch_up`` source lists (``async versions() -> [(AdapterSpec | None, version, WeightHandle)]``:
a run's weight sync found by name, or an engine pool's table of attached runs, one entry per
adapter). On the broadcast transport the driver has every engine join the learner's group once,
at the run's start (``join_weight_group``). An engine of a pool, shared by several LoRA runs,
admits requests through a ``FairGate`` keyed by adapter (``fair``).
Clients reach a group of these through ``rollout.engines.client.RayEngineClient``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any, AsyncIterator

from rollout.cores import pin_process
from rollout.engines import make_engine
from rollout.engines.base import AdapterSpec, Chunk, Completion, SamplingParams
from rollout.engines.fair import FairGate
from rollout.engines.transport import BroadcastWeights, WeightHandle
from storage import node_copy

log = logging.getLogger(__name__)


class EngineServer:
    def __init__(self, cfg: Any, model_path: str, seed: int = 0, catch_up: Any = None,
                 restarted_by_ray: bool = False, fair: tuple[int, int] | None = None,
                 engine: Any = None) -> None:
        """``catch_up``: where the newest published weights are, for an actor Ray starts again.
        ``restarted_by_ray``: this server owns its process (an actor): its first call runs
        ``start`` if nobody has, so an actor that Ray started again after a crash pins its
        cores and serves the newest weights, not the ones it was built with. ``fair``:
        (requests running at once, of them per adapter) for an engine several runs share.
        ``engine``: an engine already built, served instead of ``cfg``'s (benches: a config
        never carries one)."""
        self.cfg, self.catch_up, self._start_on_use = cfg, catch_up, restarted_by_ray
        self.gate = FairGate(*fair) if fair is not None else None
        self._queued: dict[str, asyncio.Task] = {}  # request id -> its wait for a gate slot (abort takes it out)
        # a stored policy (``cluster.storage``) is copied to this node first
        self.engine = engine if engine is not None else make_engine(cfg, node_copy(model_path), seed=seed)
        self._starting: asyncio.Future | None = None
        self._joined: asyncio.Event | None = None

    async def start(self) -> int:
        """Take the configured intra-op threads (the actor's process is the engine's own) and
        pin its cores (idempotent); returns the serving version. An in-process client never
        calls it: it leaves its host's threads alone."""
        import torch

        self._start_on_use = False
        torch.set_num_threads(self.cfg.torch_threads)
        if self.cfg.cpu_affinity:
            pin_process(self.cfg.cpu_affinity, "rollout.engine.cpu_affinity")
        return self.engine.version

    async def _started(self) -> None:
        """In an actor nobody started (Ray started it again after a crash): start, and load
        the newest weights before the first call is served; concurrent first calls share the
        one start."""
        if self._start_on_use and self._starting is None:
            self._starting = asyncio.ensure_future(self._restart())
        if self._starting is not None and not self._starting.done():
            await self._starting

    async def _restart(self) -> None:
        await self.start()
        listed = await self.catch_up.versions() if self.catch_up is not None else []
        for adapter, version, handle in listed:
            await self._load(version, handle, adapter)
        log.warning("engine: started again (a restarted actor), caught up %d version(s)", len(listed))

    async def load(self, version: int, handle: WeightHandle, adapter: AdapterSpec | None = None) -> int:
        """The weight sync's push: ``version`` of the whole weights, or of ``adapter`` (a LoRA
        run publishing its adapter alone, served beside the others this engine holds)."""
        await self._started()
        return await self._load(version, handle, adapter)

    async def _load(self, version: int, handle: WeightHandle, adapter: AdapterSpec | None) -> int:
        if adapter is not None:
            await self._receivable(handle)
            return await self.engine.update_adapter(adapter.name, version, handle, adapter.scale)
        if version <= self.engine.version:  # a republish leaves the serving version alone
            return self.engine.version
        await self._receivable(handle)
        return await self.engine.update_weights(version, handle)

    async def update_weights(self, version: int, handle: WeightHandle) -> int:
        """Serve ``version`` of the whole weights; returns the version serving once loaded."""
        return await self.load(version, handle)

    async def _receivable(self, handle: WeightHandle) -> None:
        """A broadcast version is received once this engine has joined the group: a learner
        publishes as it starts (restored, or a LoRA run's version 0) before the driver's join."""
        if isinstance(handle, BroadcastWeights):
            await self._joined_event().wait()

    async def join_weight_group(self, init: dict[str, Any]) -> None:
        """Join the learner's weight broadcast group as rank ``init["rank"]`` (the driver's
        start step, with the learner's rank 0 at the same time)."""
        await self.engine.join_weight_group(init)
        self._joined_event().set()

    def _joined_event(self) -> asyncio.Event:
        if self._joined is None:
            self._joined = asyncio.Event()
        return self._joined

    @contextlib.asynccontextmanager
    async def _turn(self, adapter: str | None, request_id: str | None = None) -> AsyncIterator[bool]:
        """A slot of the fair gate for ``adapter``'s request (nothing to wait for without
        one); yields False for a request aborted while it waited: it never reaches the engine."""
        if self.gate is None:
            yield True
            return
        if not await self._admitted(adapter, request_id):
            yield False
            return
        try:
            yield True
        finally:
            self.gate.release(adapter)

    async def _admitted(self, adapter: str | None, request_id: str | None) -> bool:
        """Wait for a slot; False (and no slot held) when ``abort`` came first."""
        wait = asyncio.ensure_future(self.gate.acquire(adapter))
        if request_id is not None:
            self._queued[request_id] = wait
        try:
            await asyncio.wait([wait])
        except asyncio.CancelledError:  # the caller went away: give back a slot granted meanwhile
            self._give_back(wait, adapter)
            raise
        finally:  # gone from the table: ``abort`` took it out
            aborted = request_id is not None and self._queued.pop(request_id, None) is None
        if aborted:  # maybe granted as the abort came: then the slot goes back
            self._give_back(wait, adapter)
            return False
        wait.result()
        return True

    def _give_back(self, wait: asyncio.Task, adapter: str | None) -> None:
        if wait.done() and not wait.cancelled() and wait.exception() is None:
            self.gate.release(adapter)
        else:
            wait.cancel()

    def _aborted_now(self, request_id: str, adapter: str | None) -> Completion:
        """What an engine answers a request aborted before it sampled anything."""
        version = self.engine.serving_version(adapter)
        return Completion(request_id, [], [], "abort", [(0, version)], adapter=adapter)

    async def generate(self, prompt_ids: list[int], params: SamplingParams, request_id: str) -> Completion:
        await self._started()
        async with self._turn(params.adapter, request_id) as admitted:
            if not admitted:
                return self._aborted_now(request_id, params.adapter)
            return await self.engine.generate(prompt_ids, params, request_id)

    async def stream(self, prompt_ids: list[int], params: SamplingParams,
                     request_id: str) -> AsyncIterator[Chunk]:
        await self._started()
        async with self._turn(params.adapter, request_id) as admitted:
            if not admitted:
                yield Chunk(request_id, [], [], self.engine.serving_version(params.adapter), "abort", params.adapter)
                return
            async for chunk in self.engine.stream(prompt_ids, params, request_id):
                yield chunk

    async def abort(self, request_id: str) -> bool:
        """End a request: one still waiting at the fair gate leaves it without running."""
        wait = self._queued.pop(request_id, None)
        if wait is not None:
            wait.cancel()  # a no-op if granted meanwhile: ``_admitted`` gives the slot back
            return True
        return await self.engine.abort(request_id)

    async def prompt_logprobs(self, prompt_ids: list[int], first: int = 1,
                              adapter: str | None = None) -> tuple[int, list[float]]:
        await self._started()
        async with self._turn(adapter):
            return await self.engine.prompt_logprobs(prompt_ids, first, adapter)

    async def update_adapter(self, name: str, version: int, handle: WeightHandle, scale: float) -> int:
        """Serve ``version`` of LoRA adapter ``name`` beside the others (``Engine.update_adapter``)."""
        return await self.load(version, handle, AdapterSpec(name, scale))

    async def remove_adapter(self, name: str) -> None:
        await self.engine.remove_adapter(name)

    async def pause(self) -> None:
        await self.engine.pause()

    async def resume(self) -> None:
        await self.engine.resume()

    def version(self) -> int:
        return self.engine.version

    def features(self) -> list[str]:
        """``Engine.features`` (a list: what a Ray call returns)."""
        return sorted(self.engine.features)

    async def vigil(self) -> None:
        """Never returns: the driver's call that fails the moment this process dies (an engine
        on the broadcast weight transport, which is not restarted, ends the run at once)."""
        await asyncio.Event().wait()

    def stats(self) -> dict[str, float]:
        out = self.engine.stats()
        if self.gate is not None:
            out |= {"fair_running": float(self.gate.busy), "fair_waiting": float(self.gate.waiting())}
        return out
