"""Hugging Face transformers engine: dynamic batching of concurrent requests, KV-cache decoding.

Concurrent ``generate`` calls are queued; a batcher task takes whatever is waiting (up to
``max_batch``), left-pads it, prefills once and decodes token by token with the model's KV
cache, sampling each row at its own temperature. The decode loop runs in a worker thread so
the actor's event loop keeps stepping environments meanwhile. Staged weights are loaded
between batches, so every completion carries exactly one weights version.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Any, Mapping

import torch

from rollout.config import HFEngineConfig
from rollout.engines.base import Completion, Engine, SamplingParams


@dataclass
class _Request:
    prompt_ids: list[int]
    params: SamplingParams
    future: asyncio.Future


def sample_tokens(logits: torch.Tensor, temps: torch.Tensor, top_p: torch.Tensor, gen: torch.Generator):
    """Sample one token per row; returns (tokens, log-probs under the tempered distribution).

    logits [B, V]; temps [B] (0 = greedy); top_p [B]."""
    greedy = temps <= 0
    scaled = logits.float() / torch.where(greedy, torch.ones_like(temps), temps).unsqueeze(-1)
    logp = torch.log_softmax(scaled, dim=-1)
    probs = logp.exp()
    if bool((top_p < 1).any()):
        sorted_p, idx = probs.sort(dim=-1, descending=True)
        keep = (sorted_p.cumsum(-1) - sorted_p) < top_p.unsqueeze(-1)
        sorted_p = torch.where(keep, sorted_p, torch.zeros_like(sorted_p))
        probs = torch.zeros_like(probs).scatter(-1, idx, sorted_p)
    sampled = torch.multinomial(probs, 1, generator=gen).squeeze(-1)
    tokens = torch.where(greedy, logp.argmax(-1), sampled)
    return tokens, logp.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)


class HFEngine(Engine):
    def __init__(self, cfg: HFEngineConfig, model_path: str, seed: int = 0) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.cfg = cfg
        self._tokenizer = AutoTokenizer.from_pretrained(model_path)
        dtype = getattr(torch, cfg.dtype)
        self.model = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype).to(cfg.device).eval()
        self._version = 0
        self._pending: tuple[Mapping[str, Any], int] | None = None
        self._queue: asyncio.Queue[_Request] | None = None
        self._batcher: asyncio.Task | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._gen = torch.Generator().manual_seed(seed)
        self._stats = {"tokens": 0.0, "batches": 0.0, "rows": 0.0, "decode_s": 0.0, "weight_loads": 0.0}

    @property
    def version(self) -> int:
        return self._version

    @property
    def tokenizer(self) -> Any:
        return self._tokenizer

    def update_weights(self, state: Mapping[str, Any], version: int) -> None:
        if version > self._version:
            self._pending = (state, version)
            if self._queue is None:  # idle engine: apply at once
                self._apply_pending()

    def _apply_pending(self) -> None:
        if self._pending is None:
            return
        state, version = self._pending
        self._pending = None
        missing, unexpected = self.model.load_state_dict(dict(state), strict=False)
        tied = {"lm_head.weight"} if self.model.config.tie_word_embeddings else set()
        if unexpected or set(missing) - tied:
            raise RuntimeError(f"weights v{version} do not fit the engine's model: missing={missing} unexpected={unexpected}")
        self._version = version
        self._stats["weight_loads"] += 1

    async def generate(self, prompt_ids: list[int], params: SamplingParams) -> Completion:
        loop = asyncio.get_running_loop()
        if self._loop is not loop:  # first call, or a new event loop (e.g. a fresh asyncio.run)
            self._loop, self._queue = loop, asyncio.Queue()
            self._batcher = loop.create_task(self._run_batcher())
        if self._batcher.done() and self._batcher.exception():
            raise RuntimeError("engine batcher died") from self._batcher.exception()
        fut = asyncio.get_running_loop().create_future()
        await self._queue.put(_Request(list(prompt_ids), params, fut))
        return await fut

    async def _run_batcher(self) -> None:
        assert self._queue is not None
        while True:
            batch = [await self._queue.get()]
            if self.cfg.batch_wait_ms > 0:
                await asyncio.sleep(self.cfg.batch_wait_ms / 1000)
            while not self._queue.empty() and len(batch) < self.cfg.max_batch:
                batch.append(self._queue.get_nowait())
            self._apply_pending()
            try:
                results = await asyncio.to_thread(self._decode, batch)
            except Exception as exc:  # noqa: BLE001 - fail these requests, keep serving
                for req in batch:
                    if not req.future.done():
                        req.future.set_exception(exc)
                continue
            for req, res in zip(batch, results):
                if not req.future.done():
                    req.future.set_result(res)

    @torch.no_grad()
    def _decode(self, batch: list[_Request]) -> list[Completion]:
        t0 = time.perf_counter()
        dev = self.cfg.device
        n, width = len(batch), max(len(r.prompt_ids) for r in batch)
        pad = self._tokenizer.pad_token_id or 0
        ids = torch.full((n, width), pad, dtype=torch.long)
        att = torch.zeros((n, width), dtype=torch.long)
        for i, r in enumerate(batch):
            ids[i, width - len(r.prompt_ids):] = torch.tensor(r.prompt_ids)
            att[i, width - len(r.prompt_ids):] = 1
        ids, att = ids.to(dev), att.to(dev)
        pos = (att.cumsum(-1) - 1).clamp(min=0)
        temps = torch.tensor([r.params.temperature for r in batch], device=dev)
        top_p = torch.tensor([r.params.top_p for r in batch], device=dev)
        limits = [r.params.max_new_tokens for r in batch]
        stops = [set(r.params.stop_token_ids) | {self._tokenizer.eos_token_id} for r in batch]
        out = self.model(input_ids=ids, attention_mask=att, position_ids=pos, use_cache=True, logits_to_keep=1)
        next_pos = pos[:, -1:] + 1
        toks: list[list[int]] = [[] for _ in batch]
        lps: list[list[float]] = [[] for _ in batch]
        reasons: list[str | None] = [None] * n
        for _ in range(max(limits)):
            tok, lp = sample_tokens(out.logits[:, -1], temps, top_p, self._gen)
            for i, (t, logp) in enumerate(zip(tok.tolist(), lp.tolist())):
                if reasons[i] is None:
                    toks[i].append(t)
                    lps[i].append(logp)
                    if t in stops[i]:
                        reasons[i] = "stop"
                    elif len(toks[i]) >= limits[i]:
                        reasons[i] = "length"
            if all(reasons):
                break
            att = torch.cat([att, torch.ones((n, 1), dtype=att.dtype, device=dev)], dim=1)
            out = self.model(input_ids=tok.unsqueeze(-1), attention_mask=att, position_ids=next_pos,
                             past_key_values=out.past_key_values, use_cache=True)
            next_pos = next_pos + 1
        dt = time.perf_counter() - t0
        self._stats["tokens"] += sum(len(t) for t in toks)
        self._stats["batches"] += 1
        self._stats["rows"] += n
        self._stats["decode_s"] += dt
        return [Completion(t, logps, r or "length", self._version, {"generate": dt}) for t, logps, r in zip(toks, lps, reasons)]

    def stats(self) -> dict[str, float]:
        return dict(self._stats)

    async def close(self) -> None:
        if self._batcher is not None:
            self._batcher.cancel()
