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

Entries hold the KV of one weights version: the first lookup or entry of a newer version drops
them all (another version's keys are not these weights' keys). An entry another one extends
(the same episode's earlier turn) is dropped when the longer one arrives: every lookup it could
answer, the longer answers at least as well. At most ``max_bytes`` of KV are held, least
recently used out first.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass

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


class PrefixCache:
    """KV of finished sequences keyed by their tokens; lookups by longest common prefix."""

    def __init__(self, max_bytes: int, block: int = 16) -> None:
        self.max_bytes, self.block = max_bytes, block
        self._entries: OrderedDict[int, _Entry] = OrderedDict()  # oldest use first
        self._index: dict[int, set[int]] = {}
        """Block key -> the entries holding that chain of full blocks."""
        self._version: int | None = None
        self._next_key = 0
        self.nbytes = 0
        self.stats = {"prefix_hits": 0.0, "prefix_reused_tokens": 0.0, "prefix_evicted": 0.0}

    def __len__(self) -> int:
        return len(self._entries)

    def lookup(self, ids: list[int], version: int, limit: int) -> tuple[int, list[LayerKV]]:
        """The longest held prefix of ``ids`` computed by ``version``, at most ``limit`` tokens
        and at least one block: its length and each layer's KV of it (views; empty when none)."""
        self._on_version(version)
        query = ids[:limit]
        found: set[int] = set()
        depth = 0
        for key in _block_keys(query, self.block):
            hit = self._index.get(key)
            if not hit:
                break
            found, depth = hit, depth + 1
        best, best_key = 0, None
        for key in found:
            n = _common_prefix(self._entries[key].ids, query, depth * self.block)
            if n > best:
                best, best_key = n, key
        if best_key is None:
            return 0, []
        self._entries.move_to_end(best_key)
        self.stats["prefix_hits"] += 1
        self.stats["prefix_reused_tokens"] += best
        return best, [(k[:, :best], v[:, :best]) for k, v in self._entries[best_key].kv]

    def add(self, ids: list[int], kv: list[LayerKV], version: int) -> None:
        """Hold ``kv`` (each ``[kv_heads, len(ids), head_dim]``, copied by the caller) for
        ``ids``; entries it extends go, then the least recently used while over budget."""
        self._on_version(version)
        nbytes = sum(k.nbytes + v.nbytes for k, v in kv)
        if len(ids) < self.block or nbytes > self.max_bytes:
            return
        blocks = list(_block_keys(ids, self.block))
        extended = {key for b in blocks for key in self._index.get(b, ())}
        for key in extended:
            held = self._entries[key].ids
            if len(held) <= len(ids) and held == ids[:len(held)]:
                self._drop(key)
        key, self._next_key = self._next_key, self._next_key + 1
        self._entries[key] = _Entry(list(ids), kv, blocks, nbytes)
        for b in blocks:
            self._index.setdefault(b, set()).add(key)
        self.nbytes += nbytes
        while self.nbytes > self.max_bytes:
            self._drop(next(iter(self._entries)))
            self.stats["prefix_evicted"] += 1

    def _on_version(self, version: int) -> None:
        if version != self._version:
            self._entries.clear()
            self._index.clear()
            self.nbytes, self._version = 0, version

    def _drop(self, key: int) -> None:
        entry = self._entries.pop(key)
        self.nbytes -= entry.nbytes
        for b in entry.blocks:
            held = self._index[b]
            held.discard(key)
            if not held:
                del self._index[b]


def _block_keys(ids: list[int], block: int) -> Iterator[int]:
    """The key of each full block of ``ids``, chained: equal keys, equal tokens up to there
    (but for hash collisions, which lookups check for)."""
    key = 0
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
