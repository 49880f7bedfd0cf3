"""The HF engine's prefix cache: the KV of finished requests, reused by requests that extend them.

A multi-turn episode sends the whole conversation so far as each turn's prompt, and its previous
turn's request already computed the keys and values of all of it but the newest observation; an
IG scorer asks for the log-probs of an answer template appended to a context the engine has just
generated from. Both would prefill thousands of tokens to use a few new ones. An entry here is
one finished row's KV (its prompt and sampled tokens, less the last one, which was never fed
forward); a new request reuses the longest entry its tokens start with and prefills only the rest.

Lookups go by blocks, as vLLM's prefix cache does: every full block of ``block`` tokens of an
entry is indexed under a key chaining the blocks before it, so finding the entries that share
the most full blocks with a request costs one dict lookup a block, however many entries there
are; the candidates' tokens are then compared (keys may collide) and the match extended past
the last full block. A match shorter than one block is not worth a reuse and is not looked for.

Versions. An entry is labelled with the oldest weights version that computed any of its KV.
Another version's keys are not these weights' keys, so by default (``max_age`` 0) the first
lookup or entry of a newer version drops them all, and every episode in flight re-prefills its
whole context at its next turn. With ``max_age`` N a generation may reuse KV up to N versions
old (``rollout.engine.stale_kv_versions``), as a request in flight already continues on its
KV across an in-flight update; the log-probs the engine records are still those of the
distribution it sampled from. Exact lookups (prompt log-probs, IG's scorer) take only the
current version's entries.

Adapters. KV computed with a LoRA adapter (``rollout.engines.adapters``) is not the base
model's, nor another adapter's: each entry belongs to a space (the adapter's name; None for the
base model), lookups see only their own space's entries (the space seeds the block keys), and
versions are counted per space (an adapter's version is its own).

An entry another one extends (the same episode's earlier turn) is dropped when the longer one
arrives, unless it is fresher: every lookup it could answer, the longer answers at least as
well. At most ``max_bytes`` of KV are held, least recently used out first.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass
from typing import NamedTuple

import torch

LayerKV = tuple[torch.Tensor, torch.Tensor]
"""One layer's keys and values of one sequence, each ``[kv_heads, tokens, head_dim]``."""


@dataclass
class _Entry:
    ids: list[int]
    """The token ids whose KV this is."""
    kv: list[LayerKV]
    blocks: list[int]
    """The index keys of its full blocks."""
    nbytes: int
    version: int
    """The oldest weights version that computed any of its KV."""
    space: str | None
    """The adapter that computed it (None: the base model)."""


class Hit(NamedTuple):
    """A lookup's answer: how many leading tokens are reused, each layer's KV of them (views;
    empty when none) and the oldest version that computed it (the query's when none)."""

    n: int
    kv: list[LayerKV]
    version: int


class PrefixCache:
    """KV of finished sequences keyed by their tokens; lookups by longest common prefix."""

    def __init__(self, max_bytes: int, block: int = 16, max_age: int = 0) -> None:
        """``max_age``: how many versions older than the lookup's an entry may be and still
        answer a lookup that is not ``exact``."""
        self.max_bytes, self.block, self.max_age = max_bytes, block, max_age
        self._entries: OrderedDict[int, _Entry] = OrderedDict()  # oldest use first
        self._index: dict[int, set[int]] = {}
        """Block key -> the entries holding that chain of full blocks."""
        self._versions: dict[str | None, int] = {}
        """Space -> the newest version a lookup or entry of it named."""
        self._next_key = 0
        self.nbytes = 0
        self.stats = {"prefix_hits": 0.0, "prefix_reused_tokens": 0.0, "prefix_evicted": 0.0,
                      "prefix_stale_hits": 0.0, "prefix_stale_reused_tokens": 0.0}

    def __len__(self) -> int:
        return len(self._entries)

    def lookup(self, ids: list[int], version: int, limit: int, exact: bool = False,
               space: str | None = None) -> Hit:
        """The longest held prefix of ``ids`` that ``version`` may reuse (computed by it alone
        when ``exact``, else by it or up to ``max_age`` versions before), at most ``limit``
        tokens and at least one block, in ``space`` (an adapter's name; None: the base model)."""
        self._on_version(version, space)
        oldest = version if exact else version - self.max_age
        query = ids[:limit]
        found: set[int] = set()
        depth = 0
        for key in _block_keys(query, self.block, space):
            hit = {k for k in self._index.get(key, ())
                   if self._entries[k].version >= oldest and self._entries[k].space == space}
            if not hit:
                break
            found, depth = hit, depth + 1
        best, best_key = 0, None
        for key in found:
            n = _common_prefix(self._entries[key].ids, query, depth * self.block)
            if n > best:
                best, best_key = n, key
        if best_key is None:
            return Hit(0, [], version)
        entry = self._entries[best_key]
        self._entries.move_to_end(best_key)
        self.stats["prefix_hits"] += 1
        self.stats["prefix_reused_tokens"] += best
        if entry.version < version:
            self.stats["prefix_stale_hits"] += 1
            self.stats["prefix_stale_reused_tokens"] += best
        return Hit(best, [(k[:, :best], v[:, :best]) for k, v in entry.kv], entry.version)

    def add(self, ids: list[int], kv: list[LayerKV], version: int, now: int | None = None,
            space: str | None = None) -> None:
        """Hold ``kv`` (each ``[kv_heads, len(ids), head_dim]``, copied by the caller) for
        ``ids`` in ``space``, ``version`` the oldest that computed any of it; entries it extends
        go (unless fresher), then the least recently used while over budget. ``now``: the
        space's current version (``version`` when not given)."""
        self._on_version(version if now is None else now, space)
        nbytes = sum(k.nbytes + v.nbytes for k, v in kv)
        if len(ids) < self.block or nbytes > self.max_bytes or not self.young_enough(version, space):
            return
        blocks = list(_block_keys(ids, self.block, space))
        extended = {key for b in blocks for key in self._index.get(b, ())}
        for key in extended:
            held = self._entries[key]
            if (held.space == space and len(held.ids) <= len(ids) and held.version <= version
                    and held.ids == ids[:len(held.ids)]):
                self._drop(key)
        key, self._next_key = self._next_key, self._next_key + 1
        self._entries[key] = _Entry(list(ids), kv, blocks, nbytes, version, space)
        for b in blocks:
            self._index.setdefault(b, set()).add(key)
        self.nbytes += nbytes
        while self.nbytes > self.max_bytes:
            self._drop(next(iter(self._entries)))
            self.stats["prefix_evicted"] += 1

    def young_enough(self, version: int, space: str | None = None) -> bool:
        """Whether KV of ``version`` in ``space`` may still be held (callers ask before
        copying it out)."""
        return version >= self._oldest_kept(space)

    def _oldest_kept(self, space: str | None) -> int:
        newest = self._versions.get(space)
        return -1 if newest is None else newest - self.max_age

    def _on_version(self, version: int, space: str | None) -> None:
        """A lookup by a newer version of ``space``: that space's entries too old for it go."""
        newest = self._versions.get(space)
        if newest is None or version > newest:
            self._versions[space] = version
            oldest = self._oldest_kept(space)
            for key in [k for k, e in self._entries.items() if e.space == space and e.version < oldest]:
                self._drop(key)

    def drop_space(self, space: str) -> None:
        """Forget an adapter's entries (it was unloaded)."""
        self._versions.pop(space, None)
        for key in [k for k, e in self._entries.items() if e.space == space]:
            self._drop(key)

    def _drop(self, key: int) -> None:
        entry = self._entries.pop(key)
        self.nbytes -= entry.nbytes
        for b in entry.blocks:
            held = self._index[b]
            held.discard(key)
            if not held:
                del self._index[b]


def _block_keys(ids: list[int], block: int, space: str | None = None) -> Iterator[int]:
    """The key of each full block of ``ids`` in ``space``, chained: equal keys, equal space
    and tokens up to there (but for hash collisions, which lookups check for)."""
    key = 0 if space is None else hash(space)
    for start in range(0, len(ids) - block + 1, block):
        key = hash((key, *ids[start:start + block]))
        yield key


def _common_prefix(a: list[int], b: list[int], known: int) -> int:
    """How many leading tokens ``a`` and ``b`` share, given that their keys say ``known`` do
    (checked: keys can collide; 0 if they do not)."""
    if a[:known] != b[:known]:
        return 0
    n, end = known, min(len(a), len(b))
    while n < end and a[n] == b[n]:
        n += 1
    return n
