"""Hugging Face transformers engine: dynamic batching of concurrent requests, KV-cache decoding.

Concurrent requests are queued; a batcher task takes whatever is waiting (up to ``max_batch``),
left-pads it, prefills once and decodes token by token with the model's KV cache, sampling
each row at its own temperature. The decode loop runs in a worker thread so the event loop
keeps serving (streams, aborts, weight updates, environment steps) meanwhile.

Batching is continuous: between decoding steps finished rows leave the batch (their cache rows
dropped) and requests that arrived meanwhile join it (prefilled together, their cache left-padded
to the batch's length or the batch's to theirs), so a request never waits for a whole batch to
end and the batch stays full when requests arrive staggered (multi-turn episodes, live
sessions).

Prefixes are reused: the KV of every finished row is kept (``rollout.engines.prefix_cache``,
``prefix_cache_mib``), and a request whose tokens extend a kept row (an episode's next turn, an
IG answer template after a context just generated from) prefills only the tokens past it.
Prompt log-probs (``prompt_logprobs``) are scored in batches on the same thread, between
decoding steps, so a scorer is never held up by a batch that keeps going.

LoRA adapters (``update_adapter``, ``rollout.engines.adapters``) are served side by side on the
one base model: a request names its adapter (``SamplingParams.adapter``), rows of different
adapters share a batch, and a new version of one adapter is loaded in place between two steps
while every other row decodes on (no pause, no drained batch).

Between decoding steps the thread also honours the control plane: aborted rows finish, a pause
holds the batch, and staged weights are loaded (``weight_update: in_flight``, the default), so
a long completion continues on the new weights and records the version change; with
``between_batches`` nothing joins while weights are staged, so the batch drains and they load
when no row is running.

The split is at the thread boundary: the decoding (model, weights version, prefix cache,
prefill, steps, sampling, prompt scoring) is ``rollout/engines/hf_batch.py``'s
``DecodeBatch``, plain torch on the decode thread; this module is the event-loop front
(requests, streams, aborts, pauses, staged weights) and the hooks (``_Hooks``) the decode
loop calls between steps and per token.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, AsyncIterator, Mapping

import torch

from rollout.config import HFEngineConfig
from rollout.engines.adapters import Adapter, adapter_layers
from rollout.engines.base import Chunk, Completion, Engine, SamplingParams, check_first, new_request_id
from rollout.engines.hf_batch import DecodeBatch, Row
from rollout.engines.transport import WeightHandle, check_fits, shapes_of

_PAUSE_POLL_S = 0.005


@dataclass
class _Request(Row):
    """A row with its answer: the future ``generate`` awaits, and the queue ``stream`` reads."""

    future: asyncio.Future | None = None
    stream: asyncio.Queue | None = None


@dataclass
class _Score:
    """A prompt log-prob request: ``ids``'s tokens from ``first`` on, each given its prefix."""

    ids: list[int]
    first: int
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future
    adapter: str | None = None


class HFEngine(Engine):
    features = frozenset({"adapters"})

    def __init__(self, cfg: HFEngineConfig, model_path: str, seed: int = 0) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.cfg = cfg
        self._tokenizer = AutoTokenizer.from_pretrained(model_path)
        dtype = getattr(torch, cfg.dtype)
        self.model = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype).to(cfg.device).eval()
        self._stats = {"tokens": 0.0, "batches": 0.0, "rows": 0.0, "decode_s": 0.0, "weight_loads": 0.0,
                       "requests": 0.0, "aborted": 0.0, "weight_changes_mid_request": 0.0, "joins": 0.0,
                       "forwards": 0.0, "forward_rows": 0.0, "prefill_tokens": 0.0, "adapter_loads": 0.0}
        self._batch = DecodeBatch(self.model, cfg, self._tokenizer.pad_token_id or 0, self._tokenizer.eos_token_id,
                                  seed, self._stats)
        """The model, its version and prefix cache, and decoding: touched on the decode thread only."""
        self._staged: tuple[Mapping[str, Any], int] | None = None
        self._staged_adapters: dict[str, Adapter] = {}
        """Adapter versions waiting for a step boundary (the newest of each name)."""
        self._removing: set[str] = set()
        """Adapters being unloaded: no new request may name them."""
        self._staged_removals: set[str] = set()
        """Adapters no open request names, to unload at a step boundary."""
        self._staged_lock = threading.Lock()
        self._resumed = threading.Event()
        self._resumed.set()
        self._open: dict[str, _Request] = {}
        self._waiting: deque[_Request] = deque()
        """Requests not yet decoding; the batcher and the decode thread (joins) take from it."""
        self._waiting_lock = threading.Lock()
        self._scoring: deque[_Score] = deque()
        """Prompt log-prob requests; the decode thread scores them between steps or batches."""
        self._arrived: asyncio.Event | None = None
        self._batcher: asyncio.Task | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._decodes = 0
        """Batches queued or decoding: while any is, staged weights load at its step boundaries
        (a load queued behind a batch held by a pause would wait for the resume)."""
        self._decodes_lock = threading.Lock()
        # Every batch decodes on this one thread: torch's OpenMP workers belong to the thread
        # that calls into torch, and a fresh thread per batch (asyncio.to_thread under a new
        # event loop, or a pool handing out another worker) leaves the previous pool spinning
        # on the same cores (measured: about 2x slower per token on 2 cores, bench/engines.py).
        self._decoder = ThreadPoolExecutor(max_workers=1, thread_name_prefix="hf-decode")
        self._hooks = _Hooks(self)

    @property
    def version(self) -> int:
        return self._batch.version

    @property
    def tokenizer(self) -> Any:
        return self._tokenizer

    # -- weights ---------------------------------------------------------------------------
    async def update_weights(self, version: int, handle: WeightHandle) -> int:
        if version <= self._batch.version:
            return self._batch.version
        state = await handle.load()
        self._check_fits(state, version)  # refuse bad weights here, never inside a batch
        with self._staged_lock:
            if self._staged is None or version > self._staged[1]:
                self._staged = (state, version)
        await self._until_loaded(lambda: self._waiting_for(version))
        return self._batch.version

    async def _until_loaded(self, staged: Any) -> None:
        """Wait while ``staged()`` says what was staged has not loaded yet."""
        while staged():
            if not self._decodes:  # idle: loaded on the decode thread before any batch queued later
                await self._load_staged()
            else:  # loaded at the batch's next step boundary, or here once it has ended
                await asyncio.sleep(_PAUSE_POLL_S)

    async def update_adapter(self, name: str, version: int, handle: WeightHandle, scale: float) -> int:
        """Serve ``version`` of adapter ``name`` (``<module>.lora_A/B.weight`` tensors from
        ``handle``, applied as ``scale * B A``): loaded between two decoding steps, in place of
        its previous version, while other rows decode on. Returns the version serving it."""
        if name in self._removing:
            raise ValueError(f"adapter {name!r} is being unloaded")
        held = self._batch.adapters.adapters.get(name)
        if held is not None and version <= held.version:
            return held.version
        layers = adapter_layers(await handle.load())
        self._batch.adapters.check(layers)  # refuse a misfit here, never inside a batch
        with self._staged_lock:
            staged = self._staged_adapters.get(name)
            if staged is None or version > staged.version:
                self._staged_adapters[name] = Adapter(name, version, float(scale), layers)
        await self._until_loaded(lambda: name in self._staged_adapters or self._staged_lock.locked())
        self._stats["adapter_loads"] += 1
        return self._batch.adapters.version(name)

    async def remove_adapter(self, name: str) -> None:
        """Unload adapter ``name`` once no open request names it (new ones are refused from
        now), with its prefix-cache entries."""
        self._removing.add(name)
        try:
            while any(r.adapter == name for r in self._open.values()) or name in self._staged_adapters:
                await asyncio.sleep(_PAUSE_POLL_S)
            with self._staged_lock:
                self._staged_removals.add(name)
            # At the running batch's next step boundary, as loads: a pool's engine serving other
            # runs may never be idle, so a removal queued behind its decode loop would never run.
            await self._until_loaded(lambda: name in self._staged_removals or self._staged_lock.locked())
        finally:
            self._removing.discard(name)

    def _waiting_for(self, version: int) -> bool:
        # An apply holds the lock from taking the staged state to done; a load under way (on
        # the decode thread) means still waiting, found without blocking the event loop on it.
        if not self._staged_lock.acquire(blocking=False):
            return True
        try:
            return self._batch.version < version and self._staged is not None
        finally:
            self._staged_lock.release()

    def _check_fits(self, state: Mapping[str, Any], version: int) -> None:
        check_fits(shapes_of(self.model.state_dict()), shapes_of(state), version,
                   bool(self.model.config.tie_word_embeddings), "the engine's model")

    async def _load_staged(self) -> None:
        """Load staged weights on the decode thread (from the event loop): every forward pass
        runs on that thread, so a load never lands under one, and the event loop never waits
        for a pass (a long prompt scoring) to end."""
        if self._staged is not None or self._staged_adapters or self._staged_removals:
            await asyncio.get_running_loop().run_in_executor(self._decoder, self._apply_staged)

    def _apply_staged(self, weights: bool = True) -> None:
        """Load staged adapters and unload removed ones, and load staged weights unless
        ``weights`` is False, now (decode thread only: see ``_load_staged``). Adapters load and
        unload at every step boundary, whatever ``weight_update`` says: replacing or removing
        one adapter in place changes no other row (no row names a removed one)."""
        with self._staged_lock:
            adapters, self._staged_adapters = self._staged_adapters, {}
            removals, self._staged_removals = self._staged_removals, set()
            for adapter in adapters.values():
                self._batch.load_adapter(adapter)
            for name in removals:
                self._batch.remove_adapter(name)
            staged = self._staged if weights else None
            if staged is None:
                return
            self._staged = None
            state, version = staged
            self._batch.load(state, version)
        self._stats["weight_loads"] += 1

    # -- control ---------------------------------------------------------------------------
    async def pause(self) -> None:
        self._resumed.clear()

    async def resume(self) -> None:
        self._resumed.set()

    async def join_weight_group(self, init: dict[str, Any]) -> None:
        from rollout.engines.transport import BroadcastGroup

        await asyncio.to_thread(BroadcastGroup.join, init, self.cfg.device)

    async def prompt_logprobs(self, prompt_ids: list[int], first: int = 1,
                              adapter: str | None = None) -> tuple[int, list[float]]:
        ids = list(prompt_ids)
        check_first(first, len(ids))
        self._check_adapter(adapter)
        loop = asyncio.get_running_loop()
        item = _Score(ids, first, loop, loop.create_future(), adapter)
        with self._waiting_lock:
            self._scoring.append(item)
        # On the decode thread: torch calls stay on the one thread that owns the OpenMP pool. A
        # running batch scores it at its next step and this call then finds nothing left.
        loop.run_in_executor(self._decoder, self._score_waiting)
        return await item.future

    @torch.inference_mode()
    def _score_waiting(self) -> None:
        """Score every waiting prompt log-prob request: up to ``max_batch`` rows and
        ``score_batch_tokens`` tokens (one row at least) per forward pass."""
        while True:
            items: list[_Score] = []
            with self._waiting_lock:
                tokens = 0
                while self._scoring and len(items) < self.cfg.max_batch and (
                        not items or tokens + len(self._scoring[0].ids) <= self.cfg.score_batch_tokens):
                    items.append(self._scoring.popleft())
                    tokens += len(items[-1].ids)
            if not items:
                return
            try:
                results = self._batch.score(items)
            except Exception as exc:  # noqa: BLE001 - fail these requests, keep serving
                for it in items:
                    it.loop.call_soon_threadsafe(_fail, it.future, exc)
                continue
            for it, result in zip(items, results):
                it.loop.call_soon_threadsafe(_resolve, it.future, result)

    async def abort(self, request_id: str) -> bool:
        req = self._open.get(request_id)
        if req is None:
            return False
        req.aborted = True  # a running row ends at the next step; a waiting one when dequeued
        return True

    # -- requests --------------------------------------------------------------------------
    def _submit(self, prompt_ids: list[int], params: SamplingParams, request_id: str | None,
                stream: bool) -> _Request:
        request_id = request_id or new_request_id()
        loop = asyncio.get_running_loop()
        if self._loop is not loop:  # first call, or a new event loop (e.g. a fresh asyncio.run)
            self._loop, self._arrived = loop, asyncio.Event()
            with self._waiting_lock:
                self._waiting.clear()  # requests of a closed loop have no one to answer
            self._batcher = loop.create_task(self._run_batcher())
        if self._batcher.done() and self._batcher.exception():
            raise RuntimeError("engine batcher died") from self._batcher.exception()
        if request_id in self._open:
            raise ValueError(f"request id {request_id!r} is already in use")
        self._check_adapter(params.adapter)
        req = _Request(request_id, list(prompt_ids), params, future=loop.create_future(),
                       stream=asyncio.Queue() if stream else None)
        if params.seed is not None:
            req.generator = torch.Generator(device=self.model.device).manual_seed(params.seed)
        self._open[request_id] = req
        self._stats["requests"] += 1
        with self._waiting_lock:
            self._waiting.append(req)
        self._arrived.set()
        return req

    def serving_version(self, adapter: str | None = None) -> int:
        self._check_adapter(adapter)
        return self._batch.version_of(adapter)

    def _check_adapter(self, name: str | None) -> None:
        if name is None:
            return
        if name in self._removing or name not in self._batch.adapters:
            loaded = sorted(set(self._batch.adapters.adapters) - self._removing)
            raise ValueError(f"adapter {name!r} is not loaded on this engine (loaded: {loaded}); "
                             "load it first with update_adapter")

    def _take_waiting(self, k: int) -> list[_Request]:
        """Up to ``k`` waiting requests (any thread); aborted ones are answered on the way."""
        taken: list[_Request] = []
        with self._waiting_lock:
            while self._waiting and len(taken) < k:
                req = self._waiting.popleft()
                if req.aborted:
                    assert self._loop is not None
                    self._loop.call_soon_threadsafe(self._finish, req, "abort")
                else:
                    taken.append(req)
        return taken

    async def generate(self, prompt_ids: list[int], params: SamplingParams,
                       request_id: str | None = None) -> Completion:
        req = self._submit(prompt_ids, params, request_id, stream=False)
        try:
            return await asyncio.shield(req.future)
        except asyncio.CancelledError:
            req.aborted = True
            raise

    async def stream(self, prompt_ids: list[int], params: SamplingParams,
                     request_id: str | None = None) -> AsyncIterator[Chunk]:
        req = self._submit(prompt_ids, params, request_id, stream=True)
        assert req.stream is not None
        try:
            while True:
                chunk = await req.stream.get()
                if isinstance(chunk, BaseException):
                    raise chunk
                yield chunk
                if chunk.finish_reason is not None:
                    return
        finally:
            req.aborted = True  # a consumer that stops early frees the row

    def _finish(self, req: _Request, reason: str, exc: BaseException | None = None) -> None:
        """Resolve a request (on the event loop thread)."""
        self._open.pop(req.request_id, None)
        if exc is not None:
            if not req.future.done():
                req.future.set_exception(exc)
                req.future.exception()  # a streamed request's future is never awaited
            if req.stream is not None:
                req.stream.put_nowait(exc)
            return
        self._stats["aborted"] += reason == "abort"
        if not req.spans:
            req.spans.append((0, self._batch.version_of(req.adapter)))
        done = Completion(req.request_id, req.token_ids, req.logprobs, reason, req.spans,  # type: ignore[arg-type]
                          {"generate": time.perf_counter() - req.t0}, req.adapter, req.top)
        if not req.future.done():
            req.future.set_result(done)
        if req.stream is not None:
            req.stream.put_nowait(Chunk(req.request_id, [], [], done.version_spans[-1][1], reason,  # type: ignore[arg-type]
                                        req.adapter))

    async def _run_batcher(self) -> None:
        assert self._arrived is not None
        while True:
            await self._arrived.wait()
            if self.cfg.batch_wait_ms > 0:
                await asyncio.sleep(self.cfg.batch_wait_ms / 1000)
            self._arrived.clear()  # before taking: a request arriving after sets it again
            while not self._resumed.is_set():
                await self._load_staged()  # pause, load, resume: loads happen while paused too
                await asyncio.sleep(_PAUSE_POLL_S)
            await self._load_staged()
            batch = self._take_waiting(self.cfg.max_batch)
            if not batch:
                continue
            try:  # ``batch`` grows by the requests that join it while it decodes
                await asyncio.wrap_future(self._submit_decode(batch))
            except Exception as exc:  # noqa: BLE001 - fail these requests, keep serving
                for req in batch:
                    if req.request_id in self._open:
                        self._finish(req, "abort", exc)
            await self._load_staged()
            with self._waiting_lock:
                if self._waiting:
                    self._arrived.set()  # left waiting (batch full, or held for a weight load)

    def _submit_decode(self, batch: list[_Request]) -> Future:
        """Queue ``batch``'s decoding on the decode thread; counted in ``_decodes`` from now
        until it ends (or is cancelled unstarted), whoever waits for it (a batcher of a closed
        event loop is cancelled, while its batch decodes on and takes newer requests)."""
        with self._decodes_lock:
            self._decodes += 1
        future = self._decoder.submit(self._batch.run, batch, self._hooks)
        future.add_done_callback(self._decode_ended)
        return future

    def _decode_ended(self, _: Future) -> None:
        with self._decodes_lock:
            self._decodes -= 1

    # -- the decode thread -----------------------------------------------------------------
    def _step_boundary(self) -> None:
        """Between two decoding steps: wait out a pause, load staged weights."""
        in_flight = self.cfg.weight_update == "in_flight"
        while not self._resumed.wait(_PAUSE_POLL_S):
            self._apply_staged(weights=in_flight)
        self._apply_staged(weights=in_flight)

    def _may_join(self, running: int) -> bool:
        """Whether waiting requests may join a batch of ``running`` rows now: at once into an
        empty one; else once the oldest has waited ``join_wait_ms`` (those that arrive
        meanwhile join with it: one prefill and one cache copy for all), and never while
        weights wait for the batch to end (``between_batches``), or it might never end."""
        with self._waiting_lock:
            if not self._waiting:
                return False
            waited = time.perf_counter() - self._waiting[0].t0
        if running and waited * 1000 < self.cfg.join_wait_ms:
            return False
        if self.cfg.weight_update == "in_flight":
            return True
        with self._staged_lock:
            return self._staged is None

    def stats(self) -> dict[str, float]:
        prefix = self._batch.prefix
        return {**self._stats, **prefix.stats, "prefix_entries": float(len(prefix)),
                "open_requests": float(len(self._open)), "version": float(self._batch.version),
                "adapters": float(len(self._batch.adapters.adapters))}

    async def close(self) -> None:
        if self._batcher is not None:
            self._batcher.cancel()
        self._decoder.shutdown(wait=False)


class _Hooks:
    """The engine's side of the decode loop (``DecodeHooks``), called on the decode thread:
    what crosses to the event loop goes through ``call_soon_threadsafe``."""

    def __init__(self, engine: HFEngine) -> None:
        self.engine = engine

    def boundary(self) -> None:
        self.engine._step_boundary()
        if self.engine._scoring:
            self.engine._score_waiting()

    def emitted(self, row: Row, token: int, logprob: float, reason: str | None) -> None:
        req, loop = row, self.engine._loop
        assert isinstance(req, _Request) and loop is not None
        if req.stream is not None:
            chunk = Chunk(req.request_id, [token], [logprob], self.engine._batch.version_of(req.adapter), None, req.adapter,
                          req.top[-1:] if req.params.top_logprobs else [])
            loop.call_soon_threadsafe(req.stream.put_nowait, chunk)
        if reason is not None:
            loop.call_soon_threadsafe(self.engine._finish, req, reason)

    def aborted(self, row: Row) -> None:
        assert self.engine._loop is not None
        self.engine._loop.call_soon_threadsafe(self.engine._finish, row, "abort")

    def joining(self, running: int) -> list[Row]:
        engine = self.engine
        if not engine._may_join(running):
            return []
        return list(engine._take_waiting(engine.cfg.max_batch - running))


def _resolve(future: asyncio.Future, result: Any) -> None:
    if not future.done():
        future.set_result(result)


def _fail(future: asyncio.Future, exc: BaseException) -> None:
    if not future.done():
        future.set_exception(exc)
