"""The Hugging Face engine's decode batch (``rollout/engines/hf.py`` is its event-loop front):
plain torch on one thread, no asyncio.

``DecodeBatch`` owns the model, its weights version, the prefix cache of kept rows' KV and
the shared sampling noise. ``run`` decodes a batch of rows to the end: prefill (past each
prompt's longest kept prefix; identical prompts once), then token by token with the model's
KV cache, each row sampled at its own temperature; finished rows leave between steps (their
KV kept for prefixes), and rows the front hands over join (prefilled together, the caches
left-padded to one width). What crosses to the front goes through ``DecodeHooks``: the step
boundary (pauses, weight loads, prompt scoring), each token, aborted rows, rows that join.
``score`` computes prompt log-probs on the same thread.

LoRA adapters (``rollout.engines.adapters``): a row whose params name an adapter is decoded
with it, whatever the other rows use (each forward pass routes rows to their adapters), its
tokens labelled with the adapter's version, its KV kept in the adapter's prefix-cache space.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Mapping, Protocol

import torch
import torch.nn.functional as F

from rollout.config import HFEngineConfig
from rollout.engines.adapters import Adapter, AdapterTable
from rollout.engines.base import SamplingParams, add_span
from rollout.engines.kv_cache import append_rows, growing_cache, select_rows
from rollout.engines.prefix_cache import Hit, PrefixCache
from rollout.engines.sampling import RowSampler


@dataclass
class Row:
    """A request as the decode thread sees it: its prompt and what it has sampled so far."""

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top: list[list[tuple[int, float]]] = field(default_factory=list)
    """Each token's alternatives, when ``params.top_logprobs`` asks for them."""
    spans: list[tuple[int, int]] = field(default_factory=list)
    """(first token index, weights version) of each run of tokens sampled on one version."""
    aborted: bool = False
    t0: float = field(default_factory=time.perf_counter)
    kv_version: int = -1
    """The oldest weights version that computed any of its KV (its reused prefix's, else its
    prefill's): kept for reuse only while that is at most ``stale_kv_versions`` old."""
    generator: torch.Generator | None = None
    """Its own sampling noise (``params.seed``): the same tokens again, whatever shares the batch."""

    @property
    def adapter(self) -> str | None:
        return self.params.adapter


class DecodeHooks(Protocol):
    """What the decode loop asks of its front, on the decode thread."""

    def boundary(self) -> None:
        """Between two decoding steps: wait out a pause, load staged weights, score waiting
        prompt log-prob requests."""

    def emitted(self, row: Row, token: int, logprob: float, reason: str | None) -> None:
        """``row`` sampled ``token`` (already recorded in it); ``reason``: it finished."""

    def aborted(self, row: Row) -> None:
        """``row`` was aborted and has left the batch."""

    def joining(self, running: int) -> list[Row]:
        """Rows to join a batch of ``running`` rows now (none: the batch goes on as it is)."""


class Rows:
    """The requests decoding together, between two steps: their KV cache, padding mask
    (``[n, kv]``, True = a real token), next positions and next-token logits, row i of each
    belonging to ``reqs[i]``."""

    def __init__(self, reqs: list[Row], cache: Any, mask: torch.Tensor, next_pos: torch.Tensor,
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

    def join(self, other: "Rows") -> None:
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


class DecodeBatch:
    """The model and the decoding of its batches (one thread only): see the module docstring."""

    def __init__(self, model: Any, cfg: HFEngineConfig, pad_id: int, eos_id: int | None, seed: int,
                 stats: dict[str, float]) -> None:
        """``stats``: the engine's counters, which this adds decoding's to."""
        self.model, self.cfg, self.pad_id, self.eos_id, self.stats = model, cfg, pad_id, eos_id, stats
        self.version = 0
        """The version of the weights the model holds."""
        self.adapters = AdapterTable(model)
        self.prefix = PrefixCache(int(cfg.prefix_cache_mib * 2**20), max_age=cfg.stale_kv_versions)
        # On the model's device: sampling draws its noise there (a CPU generator fails on cuda).
        self.gen = torch.Generator(device=model.device).manual_seed(seed)
        self.sdpa = model.config._attn_implementation == "sdpa"

    def load(self, state: Mapping[str, Any], version: int) -> None:
        """New weights, between forward passes."""
        self.model.load_state_dict(dict(state), strict=False)
        self.version = version

    def load_adapter(self, adapter: Adapter) -> None:
        """A new adapter, or a new version of one, between forward passes."""
        self.adapters.load(adapter)

    def remove_adapter(self, name: str) -> None:
        """Unload an adapter no row uses any more (the front waits for that), and its KV."""
        self.adapters.remove(name)
        self.prefix.drop_space(name)

    def version_of(self, adapter: str | None) -> int:
        """The version a row naming ``adapter`` is served by: the adapter's, or the base's."""
        return self.version if adapter is None else self.adapters.version(adapter)

    @torch.inference_mode()
    def run(self, batch: list[Row], hooks: DecodeHooks) -> None:
        """Decode ``batch`` and every row that joins it, until no row is left; ``batch`` holds
        the rows decoding (joining rows are appended, finished ones leave)."""
        t0 = time.perf_counter()
        rows = self.prefill(batch)
        sampler = self.sampler(rows.reqs)
        while True:
            hooks.boundary()
            going, tok = self.sample(rows, sampler, hooks)
            changed = len(going) < len(rows.reqs)
            if changed:
                self.remember(rows, going)
                self.retire(batch, rows, going)
            if going:
                if changed:
                    rows.keep(going)
                    tok = tok[going]
                self.forward(rows, tok)
            joining = hooks.joining(len(going))
            if joining:
                self.stats["joins"] += bool(going)  # into running rows, not a fresh start
                batch.extend(joining)
                new = self.prefill(joining)
                if going:
                    rows.join(new)
                else:
                    rows = new
                changed = True
            elif not going:
                break
            if changed:
                sampler = self.sampler(rows.reqs)
            t0 = self.busy_since(t0)  # per step, not per batch: rows join a batch for minutes
        self.stats["batches"] += 1
        self.busy_since(t0)

    def retire(self, batch: list[Row], rows: Rows, going: list[int]) -> None:
        """Count the rows leaving and drop them from ``batch``: as they leave, not when the
        batch ends, since on an engine that is never idle (a pool's) rows join one batch for
        hours, and the batch's list would hold every row it ever ran and its counts stand still."""
        stay = set(going)
        gone = [req for i, req in enumerate(rows.reqs) if i not in stay]
        self.stats["tokens"] += sum(len(r.token_ids) for r in gone)
        self.stats["rows"] += len(gone)
        batch[:] = [rows.reqs[i] for i in going]  # the batch list is ``rows.reqs``, in order

    def sample(self, rows: Rows, sampler: RowSampler, hooks: DecodeHooks) -> tuple[list[int], torch.Tensor]:
        """Sample every row's next token, record it and hand it out; returns the rows that go
        on and the tokens they feed back."""
        tok, lp, alts = sampler(rows.logits, [r.token_ids for r in rows.reqs] if sampler.needs_outputs else ())
        going: list[int] = []
        for i, (t, logp) in enumerate(zip(tok.tolist(), lp.tolist())):
            req = rows.reqs[i]
            if req.aborted:
                hooks.aborted(req)
                continue
            limit = req.params.max_new_tokens
            stop = t == self.eos_id or t in req.params.stop_token_ids
            reason = "stop" if stop else "length" if len(req.token_ids) + 1 >= limit else None
            self.record(req, t, logp)
            if alts is not None and req.params.top_logprobs:
                req.top.append(alts[i])
            hooks.emitted(req, t, logp, reason)
            if reason is None:
                going.append(i)
        return going, tok

    def record(self, req: Row, token: int, logprob: float) -> None:
        """One sampled token into ``req``, with the weights version it was sampled on."""
        add_span(req.spans, len(req.token_ids), self.version_of(req.adapter))
        if len(req.spans) == 2 and req.spans[1][0] == len(req.token_ids):
            self.stats["weight_changes_mid_request"] += 1
        req.token_ids.append(token)
        req.logprobs.append(logprob)

    def prefill(self, reqs: list[Row]) -> Rows:
        """Prefill of ``reqs``, each past the longest kept prefix of its prompt (all but its
        last token at most: that one's logits start the decoding): their cache and their
        first tokens' logits.

        Identical prompts are computed once and their row copied: a GRPO group's G episodes
        open with the same prompt and arrive together, and that first-turn prefill was most
        of the engine's prefill work (vLLM shares it the same way, through its prefix cache)."""
        slots: dict[tuple[str | None, tuple[int, ...]], int] = {}
        row_of = [slots.setdefault((r.adapter, tuple(r.prompt_ids)), len(slots)) for r in reqs]
        prompts = [list(p) for _, p in slots]
        spaces = [a for a, _ in slots]
        reuse = [self.prefix.lookup(p, self.version_of(a), len(p) - 1, space=a) for a, p in zip(spaces, prompts)]
        for r, slot in zip(reqs, row_of):
            r.kv_version = reuse[slot].version
        out, mask, pos = self._extend(prompts, reuse, keep=1, adapters=spaces)
        self.stats["prefill_tokens"] += sum(len(p) - hit.n for p, hit in zip(prompts, reuse))
        cache, logits, next_pos = out.past_key_values, out.logits[:, -1], pos[:, -1:] + 1
        if len(prompts) < len(reqs):
            index = torch.tensor(row_of, device=mask.device)
            select_rows(cache, index)
            mask, next_pos, logits = mask[index], next_pos[index], logits[index]
        return Rows(list(reqs), cache, mask, next_pos, logits)

    def _extend(self, prompts: list[list[int]], reuse: list[Hit], keep: int,
                adapters: list[str | None]) -> tuple[Any, torch.Tensor, torch.Tensor]:
        """One forward pass over each prompt's tokens past its reused prefix (``reuse[i]``: its
        length r and KV), row i with adapter ``adapters[i]``; the output (logits of the last
        ``keep`` positions), the cache's padding mask and the new tokens' positions.

        Row i is laid out ``[left padding | r reused | padding | the s new tokens]``: the reused
        KV left-padded to the longest reuse R, the new tokens right-aligned in a block as wide
        as the longest s, masked columns in between (positions come from the ids, not the
        columns, so a gap changes nothing). Without reuse this is a plain left-padded prefill."""
        dev = self.cfg.device
        n, width = len(prompts), max(hit.n for hit in reuse)
        new = max(len(p) - hit.n for p, hit in zip(prompts, reuse))
        ids = torch.full((n, new), self.pad_id, dtype=torch.long)
        att = torch.zeros((n, width + new), dtype=torch.long)
        pos = torch.zeros((n, new), dtype=torch.long)
        for i, (p, (r, _, _)) in enumerate(zip(prompts, reuse)):
            s = len(p) - r
            ids[i, new - s:] = torch.tensor(p[r:])
            att[i, width - r:width] = 1
            att[i, width + new - s:] = 1
            pos[i, new - s:] = torch.arange(r, len(p))
        ids, att, pos = ids.to(dev), att.to(dev), pos.to(dev)
        past = self._past(reuse, width) if width else growing_cache(self.model.config)
        with self.adapters.route(adapters, dev):
            out = self.model(input_ids=ids, attention_mask=att, position_ids=pos, past_key_values=past,
                             use_cache=True, logits_to_keep=keep)
        return out, att.bool(), pos

    def _past(self, reuse: list[Hit], width: int) -> Any:
        """A batch cache (``kv_cache.growing_cache``) of the reused prefixes, each left-padded
        to ``width`` columns."""
        like = next(kv for r, kv, _ in reuse if r)
        cache = growing_cache(self.model.config)
        for layer, (k0, _) in enumerate(like):
            blank = k0.new_zeros((k0.shape[0], width, k0.shape[2]))
            keys = [F.pad(kv[layer][0], (0, 0, width - r, 0)) if r else blank for r, kv, _ in reuse]
            values = [F.pad(kv[layer][1], (0, 0, width - r, 0)) if r else blank for r, kv, _ in reuse]
            cache.update(torch.stack(keys).to(self.cfg.device), torch.stack(values).to(self.cfg.device), layer)
        return cache

    def remember(self, rows: Rows, going: list[int]) -> None:
        """Keep the KV of the rows leaving: their prompt and every token fed forward (all but
        the last one sampled), labelled with the oldest version that computed any of it."""
        stay = set(going)
        for i, req in enumerate(rows.reqs):
            if i not in stay and not req.aborted:
                self._keep_row(req.prompt_ids + req.token_ids[:-1], rows.cache, rows.mask, i, req.kv_version,
                               req.adapter)

    def _keep_row(self, ids: list[int], cache: Any, mask: torch.Tensor, row: int, version: int,
                  space: str | None) -> None:
        """Hand row ``row`` of a batch cache (its real columns, copied) to the prefix cache."""
        if (self.prefix.max_bytes <= 0 or len(ids) < self.prefix.block
                or not self.prefix.young_enough(version, space)):
            return  # (a row's KV too old to keep is not copied out only to be refused)
        cols = mask[row].nonzero()[:, 0]
        if len(cols) == len(ids):  # the row's real columns are exactly these tokens
            kv = [(layer.keys[row][:, cols], layer.values[row][:, cols]) for layer in cache.layers]
            self.prefix.add(ids, kv, version, now=self.version_of(space), space=space)

    def forward(self, rows: Rows, tokens: torch.Tensor) -> None:
        """One decoding step: each row's sampled token in, its next-token logits out."""
        mask = rows.grow()
        with self.adapters.route([r.adapter for r in rows.reqs], self.cfg.device):
            out = self.model(input_ids=tokens.unsqueeze(-1), attention_mask=mask[:, None, None] if self.sdpa else mask,
                             position_ids=rows.next_pos, past_key_values=rows.cache, use_cache=True)
        self.stats["forwards"] += 1  # decode steps and their rows: how full batches run
        self.stats["forward_rows"] += len(rows.reqs)
        rows.next_pos = rows.next_pos + 1
        rows.logits = out.logits[:, -1]

    def sampler(self, reqs: list[Row]) -> RowSampler:
        return RowSampler([r.params for r in reqs], self.gen,
                          self.cfg.device, [r.generator for r in reqs])

    @torch.inference_mode()
    def score(self, items: list[Any]) -> list[tuple[int, list[float]]]:
        """Prompt log-probs (the weights version, and each token's log-prob from ``first`` on)
        of ``items`` (each with ``ids``, ``first`` and ``adapter``): one forward over their
        tokens past their kept prefixes (never past ``first - 1``: a kept prefix has keys and
        values, not logits)."""
        # loads run on this thread too: none lands under the pass
        versions = [self.version_of(it.adapter) for it in items]
        # exact: a log-prob over another version's keys is not this version's log-prob
        reuse = [self.prefix.lookup(it.ids, v, it.first - 1, exact=True, space=it.adapter)
                 for it, v in zip(items, versions)]
        keep = max(len(it.ids) - it.first + 1 for it in items)
        out, mask, _ = self._extend([it.ids for it in items], reuse, keep, [it.adapter for it in items])
        for i, (it, (reused, _, _)) in enumerate(zip(items, reuse)):
            # A scorer's next row may extend this one (IG's next boundary): keep what this row
            # computed before its scored tokens, unless the cache already held (nearly) all of it
            if it.first - 1 - reused >= self.prefix.block:
                self._keep_row(it.ids, out.past_key_values, mask, i, versions[i], it.adapter)
        logp = torch.log_softmax(out.logits.float(), dim=-1)  # the last ``keep`` positions
        results = []
        for i, it in enumerate(items):
            n = len(it.ids)  # position p's logits are at kept column keep - n + p
            cols = torch.arange(it.first - 1, n - 1, device=logp.device) + keep - n
            targets = torch.tensor(it.ids[it.first:], device=logp.device)
            results.append((versions[i], logp[i, cols].gather(-1, targets[:, None])[:, 0].tolist()))
        return results

    def busy_since(self, t0: float) -> float:
        """Count the time since ``t0`` as decoding; returns now."""
        now = time.perf_counter()
        self.stats["decode_s"] += now - t0
        return now
