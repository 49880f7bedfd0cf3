"""vLLM engine: vLLM's async engine (``AsyncLLM``) behind TurnRL's engine interface.

vLLM schedules requests continuously over a paged KV cache with prefix caching; TurnRL sends
token ids and reads back sampled ids, their log-probs and the weights version of every token.

- **Log-probs.** vLLM runs with ``logprobs_mode="processed_logprobs"``: the log-prob of each
  sampled token under the distribution it was sampled from, after temperature *and* top-p.
  The HF engine records log-probs under the tempered distribution before the top-p cut; the
  two agree whenever ``top_p == 1`` (TurnRL's default) and for greedy decoding.
- **Versions.** Every weights load ends with ``update_weight_version(str(version))``; vLLM
  labels each output token with the version that produced it, and the engine turns those
  labels into ``Chunk.version`` and ``Completion.version_spans``.
- **In-flight updates.** ``weight_update: in_flight`` pauses with ``mode="keep"`` (requests
  stay scheduled, their KV kept), loads, resumes: a request in flight continues on the new
  weights. ``between_batches`` pauses with ``mode="wait"``: requests in flight finish first
  on the old weights, new ones wait. Prefix-cache blocks are salted with the weights version
  (``_salt``): a prompt log-prob request never reuses KV that older weights computed, and a
  generation only KV at most ``stale_kv_versions`` old (its salt names a span of that many
  versions plus one).
- **Weights** reach vLLM's own worker processes through ``collective_rpc`` into
  ``vllm_worker.TurnRLWorkerExtension``: a safetensors path the worker reads, or buckets it
  receives from the learner's broadcast. A state dict (object store, in memory) is written to
  a private safetensors file first (``/dev/shm`` where it exists): vLLM's RPC channel does not
  carry tensors.
- **Adapters** (``max_loras`` >= 1): vLLM's multi-LoRA serving, each version of a named adapter
  a ``LoRARequest`` of its own; a request keeps the version it started on
  (``rollout.engines.vllm_adapters``).
- **Event loop.** ``AsyncLLM`` binds to the event loop that first uses it, so the engine runs
  it on a loop thread of its own and bridges every call: callers may use any loop (a Ray
  actor's, a test's ``asyncio.run``).
"""

from __future__ import annotations

import asyncio
import os
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, AsyncIterator, Awaitable, Mapping, TypeVar

from rollout.config import VLLMEngineConfig
from rollout.engines.base import Chunk, Completion, Engine, SamplingParams, check_first, new_request_id, refuse_adapter
from rollout.engines.transport import (TIED_HEAD, BroadcastWeights, FileWeights, WeightHandle, check_fits, shapes_of,
                                       write_safetensors)
from rollout.engines.vllm_adapters import AdapterVersion, VLLMAdapters, lora_engine_args
from rollout.engines.vllm_setup import checkpoint_shapes, vllm_env

T = TypeVar("T")
_DONE = object()


def _label_at(starts: list[tuple[str, int]], index: int) -> int:
    """The version whose span holds output token ``index`` (vLLM's initial label, "default"
    or "0", is version 0)."""
    label = starts[0][0]
    for version, first in starts:
        if first <= index:
            label = version
    return int(label) if label.isdigit() else 0


class VLLMEngine(Engine):
    features = frozenset({"guided"})

    def __init__(self, cfg: VLLMEngineConfig, model_path: str, seed: int = 0) -> None:
        from transformers import AutoConfig, AutoTokenizer

        vllm_env(cfg)
        self.cfg, self.model_path, self.seed = cfg, model_path, seed
        self._tokenizer = AutoTokenizer.from_pretrained(model_path)
        self._shapes = checkpoint_shapes(model_path)
        self._tied = bool(AutoConfig.from_pretrained(model_path).tie_word_embeddings)
        if self._tied:
            self._shapes.setdefault(TIED_HEAD, self._shapes["model.embed_tokens.weight"])
        self._version = 0
        self._user_paused = False
        self._open: set[str] = set()
        self._stats = {"tokens": 0.0, "requests": 0.0, "aborted": 0.0, "weight_loads": 0.0, "adapter_loads": 0.0,
                       "weight_changes_mid_request": 0.0, "load_s": 0.0, "prefill_tokens": 0.0,
                       "prefix_reused_tokens": 0.0}
        self._scratch = tempfile.TemporaryDirectory(prefix="turnrl-vllm-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
        if cfg.max_loras:
            self.features = frozenset({*self.features, "adapters"})
        self._adapters = VLLMAdapters(Path(self._scratch.name), self._shapes, cfg.max_lora_rank)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="vllm-engine-loop", daemon=True)
        self._thread.start()
        self._update_lock = self._call(self._make_lock())
        self._llm: Any = None
        self._call(self._start())

    # -- the engine's own loop ---------------------------------------------------------------
    def _call(self, coro: Awaitable[T]) -> T:
        """Run ``coro`` on the engine loop and wait (construction and shutdown only)."""
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    async def _on_loop(self, coro: Awaitable[T]) -> T:
        """Run ``coro`` on the engine loop, awaited from the caller's loop."""
        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(coro, self._loop))

    @staticmethod
    async def _make_lock() -> asyncio.Lock:
        return asyncio.Lock()

    async def _start(self) -> None:
        """Start vLLM's engine as ``self._llm``. Never in a local: vLLM's first import, made in
        this frame, keeps the import's frames alive (this one too, through their callers), and
        a local here would keep the engine past ``close()``, to be shut down again at
        interpreter exit, which fails."""
        from vllm import AsyncEngineArgs
        from vllm.platforms import current_platform
        from vllm.v1.engine.async_llm import AsyncLLM

        self._on_cpu = current_platform.is_cpu()
        cfg = self.cfg
        args = AsyncEngineArgs(
            model=self.model_path, dtype=cfg.dtype, seed=self.seed, max_model_len=cfg.max_model_len,
            max_num_seqs=cfg.max_num_seqs, enable_prefix_caching=cfg.prefix_caching,
            tensor_parallel_size=cfg.tensor_parallel_size, gpu_memory_utilization=cfg.gpu_memory_utilization,
            # shards as processes of this actor, on its node and its GPUs (never a Ray executor
            # that would place them elsewhere)
            distributed_executor_backend="mp" if cfg.tensor_parallel_size > 1 else None,
            # vLLM loads the tokenizer (no detokenizing: requests set detokenize=False) because
            # structured outputs compile their grammars against its vocabulary.
            enforce_eager=cfg.enforce_eager, logprobs_mode="processed_logprobs", **lora_engine_args(cfg),
            worker_extension_cls="rollout.engines.vllm_worker.TurnRLWorkerExtension", disable_log_stats=True)
        self._llm = AsyncLLM.from_engine_args(args)
        await self._llm.update_weight_version("0")

    @property
    def version(self) -> int:
        return self._version

    @property
    def tokenizer(self) -> Any:
        return self._tokenizer

    # -- requests ------------------------------------------------------------------------------
    def _sampling(self, params: SamplingParams) -> Any:
        from vllm import SamplingParams as VSampling
        from vllm.sampling_params import RequestOutputKind, StructuredOutputsParams

        refuse_adapter(self, params.adapter)
        eos = self._tokenizer.eos_token_id
        stops = sorted(set(params.stop_token_ids) | ({eos} if eos is not None else set()))
        # The grammar masks the logits before sampling: processed log-probs are the constrained ones.
        guided = StructuredOutputsParams(structural_tag=params.guide) if params.guide else None
        # Bias and penalties act before the sampler's processed log-probs are taken: the recorded
        # log-probs (and the alternatives) are those of the distribution actually sampled.
        return VSampling(temperature=params.temperature, top_p=params.top_p, max_tokens=params.max_new_tokens,
                         stop_token_ids=stops, logprobs=params.top_logprobs, detokenize=False,
                         output_kind=RequestOutputKind.DELTA, seed=params.seed, structured_outputs=guided,
                         logit_bias=dict(params.logit_bias) or None, presence_penalty=params.presence_penalty,
                         frequency_penalty=params.frequency_penalty)

    async def stream(self, prompt_ids: list[int], params: SamplingParams,
                     request_id: str | None = None) -> AsyncIterator[Chunk]:
        rid = request_id or new_request_id()
        if rid in self._open:
            raise ValueError(f"request id {rid!r} is already in use")
        self._open.add(rid)
        self._stats["requests"] += 1
        queue: asyncio.Queue = asyncio.Queue()
        caller = asyncio.get_running_loop()
        feeder = asyncio.run_coroutine_threadsafe(self._feed(list(prompt_ids), params, rid, caller, queue), self._loop)
        finished = False
        try:
            while True:
                item = await queue.get()
                if item is _DONE:
                    finished = True
                    return
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            self._open.discard(rid)
            if not finished:  # the consumer left early: end the request in vLLM too
                feeder.cancel()
                await self._on_loop(self._llm.abort(rid))

    async def _feed(self, prompt_ids: list[int], params: SamplingParams, rid: str,
                    caller: asyncio.AbstractEventLoop, queue: asyncio.Queue) -> None:
        """On the engine loop: run one vLLM request and hand its chunks to the caller's loop."""
        put = lambda item: caller.call_soon_threadsafe(queue.put_nowait, item)  # noqa: E731
        prompt = {"prompt_token_ids": prompt_ids, "cache_salt": self._salt(exact=False)}
        done = 0
        lora = None
        try:
            sampling = self._sampling(params)
            lora = self._begin(params.adapter)
            async for out in self._llm.generate(prompt, sampling, request_id=rid,
                                                lora_request=lora.request if lora else None):
                o = out.outputs[0]
                ids = list(o.token_ids)
                lps = [entry[t].logprob for t, entry in zip(ids, o.logprobs or [])]
                reason = o.finish_reason if out.finished else None
                chunks = self._chunks(rid, done, ids, lps, o.weight_versions, lora)
                if params.top_logprobs:
                    _attach_top(chunks, o.logprobs or [], params.top_logprobs)
                for chunk in chunks:
                    put(chunk)
                done += len(ids)
                self._stats["tokens"] += len(ids)
                if reason is not None:
                    self._count_prefill(len(prompt_ids), out.num_cached_tokens)
                    self._stats["aborted"] += reason == "abort"
                    last = (lora.version if lora else
                            _label_at(self._version_starts(rid, o.weight_versions), max(done - 1, 0)))
                    put(Chunk(rid, [], [], last, reason, params.adapter))
                    break
            put(_DONE)
        except BaseException as exc:  # noqa: BLE001 - handed to the consumer, which re-raises
            put(exc)
            raise
        finally:
            if lora is not None:
                await self._end(lora)

    def _chunks(self, rid: str, start: int, ids: list[int], lps: list[float], final_spans: Any,
                lora: AdapterVersion | None) -> list[Chunk]:
        """A request's new tokens as chunks: an adapter's request carries the one version of
        the adapter it started on; the base's, a chunk per weights version."""
        if lora is None:
            return self._split_by_version(rid, start, ids, lps, final_spans)
        return [Chunk(rid, ids, lps, lora.version, None, lora.name)] if ids else []

    def _split_by_version(self, rid: str, start: int, ids: list[int], lps: list[float],
                          final_spans: Any) -> list[Chunk]:
        """One chunk per weights version among these tokens (almost always one)."""
        chunks: list[Chunk] = []
        starts = self._version_starts(rid, final_spans)
        for k, (tid, lp) in enumerate(zip(ids, lps)):
            v = _label_at(starts, start + k)
            if not chunks or chunks[-1].version != v:
                chunks.append(Chunk(rid, [], [], v))
            chunks[-1].token_ids.append(tid)
            chunks[-1].logprobs.append(lp)
        return chunks

    def _version_starts(self, rid: str, final_spans: Any) -> list[tuple[str, int]]:
        """``(version label, first output token)`` of ``rid``: vLLM labels each output batch
        with the engine core's weights version (set at every load); the final output carries
        the spans, an open request's state holds them so far."""
        if final_spans:
            return [(s.version, s.start) for s in final_spans]
        state = self._llm.output_processor.request_states.get(rid)
        return getattr(state, "weight_version_starts", None) or [(str(self._version), 0)]

    def _count_prefill(self, prompt_len: int, cached: int | None) -> None:
        """A finished request's prompt tokens: taken from the prefix cache or computed (the same
        counters as the HF engine's)."""
        self._stats["prefix_reused_tokens"] += cached or 0
        self._stats["prefill_tokens"] += prompt_len - (cached or 0)

    def _salt(self, exact: bool) -> str:
        """The prefix-cache salt of a request now: blocks hit only under an equal salt. Exact:
        this version's own. Else the span of ``stale_kv_versions + 1`` versions this one is
        in, so a hit is at most that many versions old (the same as exact when it is 0)."""
        span = self.cfg.stale_kv_versions + 1
        return f"v{self._version}" if exact or span == 1 else f"g{self._version // span}"

    async def generate(self, prompt_ids: list[int], params: SamplingParams,
                       request_id: str | None = None) -> Completion:
        rid = request_id or new_request_id()
        t0 = time.perf_counter()
        comp = Completion.empty(rid)
        async for chunk in self.stream(prompt_ids, params, rid):
            comp.take(chunk)
        if len(comp.version_spans) > 1:
            self._stats["weight_changes_mid_request"] += 1
        comp.timings = {"generate": time.perf_counter() - t0}
        return comp

    async def join_weight_group(self, init: dict[str, Any]) -> None:
        # The receiving end lives in vLLM's worker (where the weights are), not in this process.
        await self._on_loop(self._llm.collective_rpc("turnrl_join_broadcast", args=(dict(init),)))

    async def prompt_logprobs(self, prompt_ids: list[int], first: int = 1,
                              adapter: str | None = None) -> tuple[int, list[float]]:
        refuse_adapter(self, adapter)
        check_first(first, len(prompt_ids))
        version, lps = await self._on_loop(self._prompt_logprobs(list(prompt_ids), adapter))
        return version, lps[first - 1:]  # vLLM scores the whole prompt (its prefix cache saves the KV)

    async def _prompt_logprobs(self, prompt_ids: list[int], adapter: str | None) -> tuple[int, list[float]]:
        """vLLM's prompt log-probs (``prompt_logprobs=0``: the prompt token's own), from one
        forward over the prompt with ``adapter`` (its version) or the base weights; the one
        sampled token is discarded."""
        from vllm import SamplingParams as VSampling
        from vllm.sampling_params import RequestOutputKind

        params = VSampling(max_tokens=1, temperature=0.0, prompt_logprobs=0, detokenize=False,
                           output_kind=RequestOutputKind.FINAL_ONLY)
        version, rid = self._version, new_request_id()
        prompt = {"prompt_token_ids": prompt_ids, "cache_salt": self._salt(exact=True)}
        out = None
        lora = self._begin(adapter)
        try:
            async for out in self._llm.generate(prompt, params, request_id=rid,
                                                lora_request=lora.request if lora else None):
                pass
        finally:
            if lora is not None:
                await self._end(lora)
        assert out is not None and out.prompt_logprobs is not None
        self._count_prefill(len(prompt_ids), out.num_cached_tokens)
        lps = [entry[t].logprob for t, entry in zip(prompt_ids[1:], out.prompt_logprobs[1:])]
        if lora is not None:
            return lora.version, lps
        return _label_at(self._version_starts(rid, out.outputs[0].weight_versions), 0) if out.outputs else version, lps

    async def abort(self, request_id: str) -> bool:
        if request_id not in self._open:
            return False
        await self._on_loop(self._llm.abort(request_id))
        return True

    # -- control -------------------------------------------------------------------------------
    async def pause(self) -> None:
        self._user_paused = True
        await self._on_loop(self._llm.pause_generation(mode="keep", clear_cache=False))

    async def resume(self) -> None:
        self._user_paused = False
        await self._on_loop(self._llm.resume_generation())

    async def update_weights(self, version: int, handle: WeightHandle) -> int:
        return await self._on_loop(self._update(version, handle))

    async def _update(self, version: int, handle: WeightHandle) -> int:
        async with self._update_lock:
            if version <= self._version:
                return self._version
            method, arg, cleanup = await self._load_call(handle, version)
            t0 = time.perf_counter()
            mode = "keep" if self.cfg.weight_update == "in_flight" else "wait"
            if not self._user_paused:  # a caller's own pause stays in force after the load
                await self._llm.pause_generation(mode=mode, clear_cache=False)
            try:
                await self._llm.collective_rpc(method, args=(arg,))
                await self._llm.update_weight_version(str(version))
                self._version = version
            finally:
                if not self._user_paused:
                    await self._llm.resume_generation()
                cleanup()
            self._stats["weight_loads"] += 1
            self._stats["load_s"] += time.perf_counter() - t0
            return self._version

    def serving_version(self, adapter: str | None = None) -> int:
        return self._version if adapter is None else self._adapters.serving(adapter).version

    def _begin(self, adapter: str | None) -> AdapterVersion | None:
        """A request starts: on ``adapter``'s current version, or on the base model (refused on
        CPU while adapters are on: ``VLLMAdapters.base_allowed``)."""
        if adapter is not None:
            return self._adapters.begin(adapter)
        if "adapters" in self.features:
            self._adapters.base_allowed(self._on_cpu)
        return None

    async def _end(self, lora: AdapterVersion) -> None:
        await self._adapters.drop(self._llm, self._adapters.end(lora))

    async def update_adapter(self, name: str, version: int, handle: WeightHandle, scale: float) -> int:
        """Serve ``version`` of adapter ``name`` to the requests that start from now on
        (``rollout.engines.vllm_adapters``); returns the version serving it."""
        refuse_adapter(self, name)

        async def load() -> int:
            async with self._update_lock:
                t0 = time.perf_counter()
                served = await self._adapters.load(self._llm, name, version, handle, scale)
                self._stats["adapter_loads"] += served == version
                self._stats["load_s"] += time.perf_counter() - t0
                return served

        return await self._on_loop(load())

    async def remove_adapter(self, name: str) -> None:
        """Unload adapter ``name`` once no request runs on it (new ones are refused from now)."""
        refuse_adapter(self, name)
        await self._on_loop(self._adapters.remove(self._llm, name))

    async def _load_call(self, handle: WeightHandle, version: int) -> tuple[str, Any, Any]:
        """(worker method, its argument, cleanup) for ``handle``, after checking the weights fit."""
        if isinstance(handle, FileWeights):
            self._check_fits(await asyncio.to_thread(handle.shapes), version)
            return "turnrl_load_file", handle.path, lambda: None
        if isinstance(handle, BroadcastWeights):
            self._check_fits({e["name"]: tuple(e["shape"]) for e in handle.layout_entries()}, version)
            return "turnrl_receive_broadcast", handle.layout, lambda: None
        state = await handle.load()
        self._check_fits(shapes_of(state), version)
        path = os.path.join(self._scratch.name, f"v{version}.safetensors")
        await asyncio.to_thread(write_safetensors, state, path)
        return "turnrl_load_file", path, lambda: os.unlink(path)

    def _check_fits(self, shapes: Mapping[str, tuple[int, ...]], version: int) -> None:
        check_fits(self._shapes, shapes, version, self._tied, "the engine's model")

    def stats(self) -> dict[str, float]:
        return {**self._stats, "open_requests": float(len(self._open)), "version": float(self._version),
                "adapters": float(len(self._adapters.current))}

    async def close(self) -> None:
        if self._llm is None:
            return
        await self._on_loop(self._shutdown())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._scratch.cleanup()

    async def _shutdown(self) -> None:
        """On the engine loop, where vLLM's output handler runs: it is cancelled, not left to
        find its engine core gone. The reference is dropped here, while the interpreter is
        whole (vLLM's ``__del__`` shuts down again and fails at interpreter exit)."""
        import gc

        llm, self._llm = self._llm, None
        llm.shutdown()
        await asyncio.sleep(0)  # let the cancelled output handler finish and drop its reference
        del llm
        gc.collect()


def _attach_top(chunks: list[Chunk], entries: list[Any], k: int) -> None:
    """Each token's ``k`` alternatives from vLLM's per-token log-prob dicts (the top ``k`` by
    rank, plus the sampled token where it ranks lower), onto the chunks that hold those tokens."""
    tops = [sorted(((t, e.logprob) for t, e in entry.items() if e.rank is not None and e.rank <= k),
                   key=lambda te: -te[1])[:k] for entry in entries]
    at = 0
    for chunk in chunks:
        chunk.top = tops[at: at + len(chunk.token_ids)]
        at += len(chunk.token_ids)
