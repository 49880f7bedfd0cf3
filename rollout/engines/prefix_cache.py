"""The HF engine's prefix cache: the KV of finished requests, reused by requests that extend them.

A multi-turn episode sends the whole conversation so far as each turn's prompt, and its previous
turn's request already computed the keys and values of all of it but the newest observation; an
IG scorer asks for the log-probs of an answer template appended to a context the engine has just
generated from. Both would prefill thousands of tokens to use a few new ones. An entry here is
one finished row's KV (its prompt and sampled tokens, less the last one, which was never fed
forward); a new request reuses the longest entry its tokens start with and prefills only the rest.

Entries are tagged with the weights version that computed them, and a request reuses only an
entry of the version serving now (another version's keys are not these weights' keys); an entry
of an older version is dropped when met. An entry another one extends (the same episode's earlier
turn) is dropped when the longer one arrives: every lookup it could answer, the longer answers at
least as well. The cache holds at most ``max_bytes`` of KV, least recently used out first.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch

LayerKV = tuple[torch.Tensor, torch.Tensor]
"""One layer's keys and values of one sequence, each ``[kv_heads, tokens, head_dim]``."""


@dataclass
class _Entry:
    ids: torch.Tensor
    """The token ids whose KV this is, ``[tokens]``."""
    kv: list[LayerKV]
    version: int
    nbytes: int


class PrefixCache:
    """KV of finished sequences keyed by their tokens; lookups by longest common prefix."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._entries: OrderedDict[int, _Entry] = OrderedDict()  # oldest use first
        self._next_key = 0
        self.nbytes = 0
        self.stats = {"prefix_hits": 0.0, "prefix_reused_tokens": 0.0, "prefix_evicted": 0.0}

    def __len__(self) -> int:
        return len(self._entries)

    def lookup(self, ids: list[int], version: int, limit: int) -> tuple[int, list[LayerKV]]:
        """The longest held prefix of ``ids`` computed by ``version``, at most ``limit`` tokens:
        its length and each layer's KV of it (views; empty when nothing matches)."""
        if limit <= 0 or not self._entries:
            return 0, []
        query = torch.tensor(ids[:limit])
        best, best_key = 0, None
        for key, entry in list(self._entries.items()):
            if entry.version != version:
                self._drop(key)
                continue
            n = _common_prefix(entry.ids, query)
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
        if not ids or self.max_bytes <= 0:
            return
        tensor = torch.tensor(ids)
        nbytes = sum(k.nbytes + v.nbytes for k, v in kv)
        if nbytes > self.max_bytes:
            return
        for key, entry in list(self._entries.items()):
            n = len(entry.ids)
            if entry.version != version or (n <= len(tensor) and _common_prefix(entry.ids, tensor[:n]) == n):
                self._drop(key)
        self._entries[self._next_key] = _Entry(tensor, kv, version, nbytes)
        self._next_key += 1
        self.nbytes += nbytes
        while self.nbytes > self.max_bytes:
            self._drop(next(iter(self._entries)))
            self.stats["prefix_evicted"] += 1

    def _drop(self, key: int) -> None:
        self.nbytes -= self._entries.pop(key).nbytes


def _common_prefix(a: torch.Tensor, b: torch.Tensor) -> int:
    """How many leading tokens ``a`` and ``b`` share."""
    n = min(len(a), len(b))
    if n == 0 or a[0] != b[0]:
        return 0
    differs = (a[:n] != b[:n]).nonzero()
    return int(differs[0, 0]) if len(differs) else n
