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

Between decoding steps the thread also honours the control plane: aborted rows finish, a pause
holds the batch, and staged weights are loaded (``weight_update: in_flight``, the default), so
a long completion continues on the new weights and records the version change; with
``between_batches`` nothing joins while weights are staged, so the batch drains and they load
when no row is running.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Mapping

import torch
import torch.nn.functional as F

from rollout.config import HFEngineConfig
from rollout.engines.base import (Chunk, Completion, Engine, SamplingParams, add_span, check_first,
                                  new_request_id)
from rollout.engines.kv_cache import append_rows, growing_cache, select_rows
from rollout.engines.prefix_cache import LayerKV, PrefixCache
from rollout.engines.sampling import RowSampler
from rollout.engines.transport import WeightHandle, check_fits, shapes_of

_PAUSE_POLL_S = 0.005


@dataclass
class _Request:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    future: asyncio.Future
    stream: asyncio.Queue | None = None
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    spans: list[tuple[int, int]] = field(default_factory=list)
    aborted: bool = False
    t0: float = field(default_factory=time.perf_counter)
    kv_version: int = -1
    """The weights version its prefill ran on: its KV is kept only if every token was computed
    on that version."""
    generator: torch.Generator | None = None
    """Its own sampling noise (``params.seed``): the same tokens again, whatever shares the batch."""


@dataclass
class _Score:
    """A prompt log-prob request: ``ids``'s tokens from ``first`` on, each given its prefix."""

    ids: list[int]
    first: int
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future


class _Rows:
    """The requests decoding together, between two steps: their KV cache, padding mask
    (``[n, kv]``, True = a real token), next positions and next-token logits, row i of each
    belonging to ``reqs[i]``."""

    def __init__(self, reqs: list[_Request], cache: Any, mask: torch.Tensor, next_pos: torch.Tensor,
                 logits: torch.Tensor) -> None:
        self.reqs, self.cache, self.mask, self.next_pos, self.logits = reqs, cache, mask, next_pos, logits

    def keep(self, idx: list[int]) -> None:
        """Keep rows ``idx`` only, and drop the cache columns none of them attends to (the left
        padding that only rows now gone needed)."""
        index = torch.tensor(idx, device=self.mask.device)
        self.reqs = [self.reqs[i] for i in idx]
        self.mask, self.next_pos, self.logits = self.mask[index], self.next_pos[index], self.logits[index]
        first = int(self.mask.any(0).int().argmax())  # first column a row still attends to
        select_rows(self.cache, index, drop_left=first)
        self.mask = self.mask[:, first:]

    def join(self, other: "_Rows") -> None:
        """Append ``other``'s rows; the narrower cache is left-padded with masked columns."""
        width = max(self.mask.shape[1], other.mask.shape[1])
        append_rows(self.cache, other.cache)
        self.reqs = self.reqs + other.reqs
        self.mask = torch.cat([F.pad(m, (width - m.shape[1], 0), value=False) for m in (self.mask, other.mask)])
        self.next_pos = torch.cat([self.next_pos, other.next_pos])
        self.logits = torch.cat([self.logits, other.logits])

    def grow(self) -> torch.Tensor:
        """The mask of one more token per row (SDPA gets it 4D, ``[n, 1, 1, kv]``: one query
        token may see every real token so far, and transformers passes a 4D mask through
        instead of building one at every token)."""
        self.mask = torch.cat([self.mask, self.mask.new_ones((len(self.reqs), 1))], dim=1)
        return self.mask


class HFEngine(Engine):
    def __init__(self, cfg: HFEngineConfig, model_path: str, seed: int = 0) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.cfg = cfg
        self._tokenizer = AutoTokenizer.from_pretrained(model_path)
        dtype = getattr(torch, cfg.dtype)
        self.model = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype).to(cfg.device).eval()
        self._version = 0
        self._staged: tuple[Mapping[str, Any], int] | None = None
        self._staged_lock = threading.Lock()
        self._resumed = threading.Event()
        self._resumed.set()
        self._open: dict[str, _Request] = {}
        self._waiting: deque[_Request] = deque()
        """Requests not yet decoding; the batcher and the decode thread (joins) take from it."""
        self._waiting_lock = threading.Lock()
        self._scoring: deque[_Score] = deque()
        """Prompt log-prob requests; the decode thread scores them between steps or batches."""
        self._prefix = PrefixCache(int(cfg.prefix_cache_mib * 2**20))
        """Touched on the decode thread only."""
        self._arrived: asyncio.Event | None = None
        self._batcher: asyncio.Task | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._decodes = 0
        """Batches queued or decoding: while any is, staged weights load at its step boundaries
        (a load queued behind a batch held by a pause would wait for the resume)."""
        self._decodes_lock = threading.Lock()
        # On the model's device: sampling draws its noise there (a CPU generator fails on cuda).
        self._gen = torch.Generator(device=self.model.device).manual_seed(seed)
        self._sdpa = self.model.config._attn_implementation == "sdpa"
        # Every batch decodes on this one thread: torch's OpenMP workers belong to the thread
        # that calls into torch, and a fresh thread per batch (asyncio.to_thread under a new
        # event loop, or a pool handing out another worker) leaves the previous pool spinning
        # on the same cores (measured: about 2x slower per token on 2 cores, bench/engines.py).
        self._decoder = ThreadPoolExecutor(max_workers=1, thread_name_prefix="hf-decode")
        self._stats = {"tokens": 0.0, "batches": 0.0, "rows": 0.0, "decode_s": 0.0, "weight_loads": 0.0,
                       "requests": 0.0, "aborted": 0.0, "weight_changes_mid_request": 0.0, "joins": 0.0,
                       "forwards": 0.0, "forward_rows": 0.0, "prefill_tokens": 0.0}

    @property
    def version(self) -> int:
        return self._version

    @property
    def tokenizer(self) -> Any:
        return self._tokenizer

    # -- weights ---------------------------------------------------------------------------
    async def update_weights(self, version: int, handle: WeightHandle) -> int:
        if version <= self._version:
            return self._version
        state = await handle.load()
        self._check_fits(state, version)  # refuse bad weights here, never inside a batch
        with self._staged_lock:
            if self._staged is None or version > self._staged[1]:
                self._staged = (state, version)
        while self._waiting_for(version):
            if not self._decodes:  # idle: loaded on the decode thread before any batch queued later
                await self._load_staged()
            else:  # loaded at the batch's next step boundary, or here once it has ended
                await asyncio.sleep(_PAUSE_POLL_S)
        return self._version

    def _waiting_for(self, version: int) -> bool:
        # An apply holds the lock from taking the staged state to done; a load under way (on
        # the decode thread) means still waiting, found without blocking the event loop on it.
        if not self._staged_lock.acquire(blocking=False):
            return True
        try:
            return self._version < version and self._staged is not None
        finally:
            self._staged_lock.release()

    def _check_fits(self, state: Mapping[str, Any], version: int) -> None:
        check_fits(shapes_of(self.model.state_dict()), shapes_of(state), version,
                   bool(self.model.config.tie_word_embeddings), "the engine's model")

    async def _load_staged(self) -> None:
        """Load staged weights on the decode thread (from the event loop): every forward pass
        runs on that thread, so a load never lands under one, and the event loop never waits
        for a pass (a long prompt scoring) to end."""
        if self._staged is not None:
            await asyncio.get_running_loop().run_in_executor(self._decoder, self._apply_staged)

    def _apply_staged(self) -> None:
        """Load staged weights now (decode thread only: see ``_load_staged``)."""
        with self._staged_lock:
            staged, self._staged = self._staged, None
            if staged is None:
                return
            state, version = staged
            self.model.load_state_dict(dict(state), strict=False)
            self._version = version
        self._stats["weight_loads"] += 1

    # -- control ---------------------------------------------------------------------------
    async def pause(self) -> None:
        self._resumed.clear()

    async def resume(self) -> None:
        self._resumed.set()

    async def join_weight_group(self, init: dict[str, Any]) -> None:
        from rollout.engines.transport import BroadcastGroup

        await asyncio.to_thread(BroadcastGroup.join, init, self.cfg.device)

    async def prompt_logprobs(self, prompt_ids: list[int], first: int = 1) -> tuple[int, list[float]]:
        ids = list(prompt_ids)
        check_first(first, len(ids))
        loop = asyncio.get_running_loop()
        item = _Score(ids, first, loop, loop.create_future())
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
                results = self._score(items)
            except Exception as exc:  # noqa: BLE001 - fail these requests, keep serving
                for it in items:
                    it.loop.call_soon_threadsafe(_fail, it.future, exc)
                continue
            for it, result in zip(items, results):
                it.loop.call_soon_threadsafe(_resolve, it.future, result)

    def _score(self, items: list[_Score]) -> list[tuple[int, list[float]]]:
        """One forward over the tokens of ``items`` past their kept prefixes (never past
        ``first - 1``: a kept prefix has keys and values, not logits)."""
        version = self._version  # loads run on this thread too: none lands under the pass
        reuse = [self._prefix.lookup(it.ids, version, it.first - 1) for it in items]
        keep = max(len(it.ids) - it.first + 1 for it in items)
        out, mask, _ = self._extend([it.ids for it in items], reuse, keep)
        for i, (it, (reused, _)) in enumerate(zip(items, reuse)):
            # A scorer's next row may extend this one (IG's next boundary): keep what this row
            # computed before its scored tokens, unless the cache already held (nearly) all of it
            if it.first - 1 - reused >= self._prefix.block:
                self._keep_row(it.ids, out.past_key_values, mask, i, version)
        logp = torch.log_softmax(out.logits.float(), dim=-1)  # the last ``keep`` positions
        results = []
        for i, it in enumerate(items):
            n = len(it.ids)  # position p's logits are at kept column keep - n + p
            cols = torch.arange(it.first - 1, n - 1, device=logp.device) + keep - n
            targets = torch.tensor(it.ids[it.first:], device=logp.device)
            results.append((version, logp[i, cols].gather(-1, targets[:, None])[:, 0].tolist()))
        return results

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
        req = _Request(request_id, list(prompt_ids), params, loop.create_future(),
                       asyncio.Queue() if stream else None)
        if params.seed is not None:
            req.generator = torch.Generator(device=self.model.device).manual_seed(params.seed)
        self._open[request_id] = req
        self._stats["requests"] += 1
        with self._waiting_lock:
            self._waiting.append(req)
        self._arrived.set()
        return req

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
            req.spans.append((0, self._version))
        done = Completion(req.request_id, req.token_ids, req.logprobs, reason, req.spans,  # type: ignore[arg-type]
                          {"generate": time.perf_counter() - req.t0})
        if not req.future.done():
            req.future.set_result(done)
        if req.stream is not None:
            req.stream.put_nowait(Chunk(req.request_id, [], [], done.version_spans[-1][1], reason))  # type: ignore[arg-type]

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
        future = self._decoder.submit(self._decode, batch)
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
            if in_flight:
                self._apply_staged()
        if in_flight:
            self._apply_staged()

    def _emit(self, req: _Request, token: int, logprob: float, reason: str | None) -> None:
        """Record one sampled token (decode thread) and hand it to the event loop."""
        add_span(req.spans, len(req.token_ids), self._version)
        if len(req.spans) == 2 and req.spans[1][0] == len(req.token_ids):
            self._stats["weight_changes_mid_request"] += 1
        req.token_ids.append(token)
        req.logprobs.append(logprob)
        assert self._loop is not None
        if req.stream is not None:
            chunk = Chunk(req.request_id, [token], [logprob], self._version)
            self._loop.call_soon_threadsafe(req.stream.put_nowait, chunk)
        if reason is not None:
            self._loop.call_soon_threadsafe(self._finish, req, reason)

    def _prefill(self, reqs: list[_Request]) -> _Rows:
        """Prefill of ``reqs``, each past the longest kept prefix of its prompt (all but its
        last token at most: that one's logits start the decoding): their cache and their
        first tokens' logits.

        Identical prompts are computed once and their row copied: a GRPO group's G episodes
        open with the same prompt and arrive together, and that first-turn prefill was most
        of the engine's prefill work (vLLM shares it the same way, through its prefix cache)."""
        for r in reqs:
            r.kv_version = self._version
        slots: dict[tuple[int, ...], int] = {}
        row_of = [slots.setdefault(tuple(r.prompt_ids), len(slots)) for r in reqs]
        prompts = [list(p) for p in slots]
        reuse = [self._prefix.lookup(p, self._version, len(p) - 1) for p in prompts]
        out, mask, pos = self._extend(prompts, reuse, keep=1)
        self._stats["prefill_tokens"] += sum(len(p) - r for p, (r, _) in zip(prompts, reuse))
        cache, logits, next_pos = out.past_key_values, out.logits[:, -1], pos[:, -1:] + 1
        if len(prompts) < len(reqs):
            index = torch.tensor(row_of, device=mask.device)
            select_rows(cache, index)
            mask, next_pos, logits = mask[index], next_pos[index], logits[index]
        return _Rows(list(reqs), cache, mask, next_pos, logits)

    def _extend(self, prompts: list[list[int]], reuse: list[tuple[int, list[LayerKV]]],
                keep: int) -> tuple[Any, torch.Tensor, torch.Tensor]:
        """One forward pass over each prompt's tokens past its reused prefix (``reuse[i]``: its
        length r and KV); the output (logits of the last ``keep`` positions), the cache's
        padding mask and the new tokens' positions.

        Row i is laid out ``[left padding | r reused | padding | the s new tokens]``: the reused
        KV left-padded to the longest reuse R, the new tokens right-aligned in a block as wide
        as the longest s, masked columns in between (positions come from the ids, not the
        columns, so a gap changes nothing). Without reuse this is a plain left-padded prefill."""
        dev = self.cfg.device
        n, width = len(prompts), max(r for r, _ in reuse)
        new = max(len(p) - r for p, (r, _) in zip(prompts, reuse))
        ids = torch.full((n, new), self._tokenizer.pad_token_id or 0, dtype=torch.long)
        att = torch.zeros((n, width + new), dtype=torch.long)
        pos = torch.zeros((n, new), dtype=torch.long)
        for i, (p, (r, _)) in enumerate(zip(prompts, reuse)):
            s = len(p) - r
            ids[i, new - s:] = torch.tensor(p[r:])
            att[i, width - r:width] = 1
            att[i, width + new - s:] = 1
            pos[i, new - s:] = torch.arange(r, len(p))
        ids, att, pos = ids.to(dev), att.to(dev), pos.to(dev)
        past = self._past(reuse, width) if width else growing_cache(self.model.config)
        out = self.model(input_ids=ids, attention_mask=att, position_ids=pos, past_key_values=past,
                         use_cache=True, logits_to_keep=keep)
        return out, att.bool(), pos

    def _past(self, reuse: list[tuple[int, list[LayerKV]]], width: int) -> Any:
        """A batch cache (``kv_cache.growing_cache``) of the reused prefixes, each left-padded
        to ``width`` columns."""
        like = next(kv for r, kv in reuse if r)
        cache = growing_cache(self.model.config)
        for layer, (k0, _) in enumerate(like):
            blank = k0.new_zeros((k0.shape[0], width, k0.shape[2]))
            keys = [F.pad(kv[layer][0], (0, 0, width - r, 0)) if r else blank for r, kv in reuse]
            values = [F.pad(kv[layer][1], (0, 0, width - r, 0)) if r else blank for r, kv in reuse]
            cache.update(torch.stack(keys).to(self.cfg.device), torch.stack(values).to(self.cfg.device), layer)
        return cache

    def _remember(self, rows: _Rows, going: list[int]) -> None:
        """Keep the KV of the rows leaving: their prompt and every token fed forward (all but
        the last one sampled), when one weights version computed all of it."""
        stay = set(going)
        for i, req in enumerate(rows.reqs):
            if i not in stay and not req.aborted and req.kv_version == self._version:
                self._keep_row(req.prompt_ids + req.token_ids[:-1], rows.cache, rows.mask, i, self._version)

    def _keep_row(self, ids: list[int], cache: Any, mask: torch.Tensor, row: int, version: int) -> None:
        """Hand row ``row`` of a batch cache (its real columns, copied) to the prefix cache."""
        if self._prefix.max_bytes <= 0 or len(ids) < self._prefix.block:
            return
        cols = mask[row].nonzero()[:, 0]
        if len(cols) == len(ids):  # the row's real columns are exactly these tokens
            kv = [(layer.keys[row][:, cols], layer.values[row][:, cols]) for layer in cache.layers]
            self._prefix.add(ids, kv, version)

    def _forward(self, rows: _Rows, tokens: torch.Tensor) -> None:
        """One decoding step: each row's sampled token in, its next-token logits out."""
        mask = rows.grow()
        out = self.model(input_ids=tokens.unsqueeze(-1), attention_mask=mask[:, None, None] if self._sdpa else mask,
                         position_ids=rows.next_pos, past_key_values=rows.cache, use_cache=True)
        self._stats["forwards"] += 1  # decode steps and their rows: how full batches run
        self._stats["forward_rows"] += len(rows.reqs)
        rows.next_pos = rows.next_pos + 1
        rows.logits = out.logits[:, -1]

    def _sampler(self, reqs: list[_Request]) -> RowSampler:
        return RowSampler([r.params.temperature for r in reqs], [r.params.top_p for r in reqs], self._gen,
                          self.cfg.device, [r.generator for r in reqs])

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

    def _sample_and_emit(self, rows: _Rows, sampler: RowSampler) -> tuple[list[int], torch.Tensor]:
        """Sample every row's next token and hand it out; returns the rows that go on and the
        tokens they feed back."""
        tok, lp = sampler(rows.logits)
        going: list[int] = []
        for i, (t, logp) in enumerate(zip(tok.tolist(), lp.tolist())):
            req = rows.reqs[i]
            if req.aborted:
                assert self._loop is not None
                self._loop.call_soon_threadsafe(self._finish, req, "abort")
                continue
            limit = req.params.max_new_tokens
            stop = t == self._tokenizer.eos_token_id or t in req.params.stop_token_ids
            reason = "stop" if stop else "length" if len(req.token_ids) + 1 >= limit else None
            self._emit(req, t, logp, reason)
            if reason is None:
                going.append(i)
        return going, tok

    @torch.inference_mode()
    def _decode(self, batch: list[_Request]) -> None:
        """Decode ``batch`` and every request that joins it, until no row is left."""
        t0 = time.perf_counter()
        rows = self._prefill(batch)
        sampler = self._sampler(rows.reqs)
        while True:
            self._step_boundary()
            if self._scoring:
                self._score_waiting()
            going, tok = self._sample_and_emit(rows, sampler)
            changed = len(going) < len(rows.reqs)
            if changed:
                self._remember(rows, going)
            if going:
                if changed:
                    rows.keep(going)
                    tok = tok[going]
                self._forward(rows, tok)
            joining = self._take_waiting(self.cfg.max_batch - len(going)) if self._may_join(len(going)) else []
            if joining:
                self._stats["joins"] += bool(going)  # into running rows, not a fresh start
                batch.extend(joining)
                new = self._prefill(joining)
                if going:
                    rows.join(new)
                else:
                    rows = new
                changed = True
            elif not going:
                break
            if changed:
                sampler = self._sampler(rows.reqs)
            t0 = self._busy_since(t0)  # per step, not per batch: rows join a batch for minutes
        self._stats["tokens"] += sum(len(r.token_ids) for r in batch)
        self._stats["batches"] += 1
        self._stats["rows"] += len(batch)
        self._busy_since(t0)

    def _busy_since(self, t0: float) -> float:
        """Count the time since ``t0`` as decoding; returns now."""
        now = time.perf_counter()
        self._stats["decode_s"] += now - t0
        return now

    def stats(self) -> dict[str, float]:
        return {**self._stats, **self._prefix.stats, "prefix_entries": float(len(self._prefix)),
                "open_requests": float(len(self._open)), "version": float(self._version)}

    async def close(self) -> None:
        if self._batcher is not None:
            self._batcher.cancel()
        self._decoder.shutdown(wait=False)


def _resolve(future: asyncio.Future, result: Any) -> None:
    if not future.done():
        future.set_result(result)


def _fail(future: asyncio.Future, exc: BaseException) -> None:
    if not future.done():
        future.set_exception(exc)
