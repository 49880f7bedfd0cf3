"""The HF engine's prefix cache (``rollout.engines.prefix_cache``) on its own: longest-prefix
lookups by blocks, weights versions, entries an extension replaces, the byte budget (blocks of
2 tokens here, 16 in the engine)."""

from __future__ import annotations

import torch

from rollout.engines.prefix_cache import PrefixCache

LAYERS, HEADS, DIM = 2, 2, 4


def _kv(n: int, fill: float) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each layer's keys and values of ``n`` tokens, every value ``fill`` (to tell entries apart)."""
    return [(torch.full((HEADS, n, DIM), fill), torch.full((HEADS, n, DIM), -fill)) for _ in range(LAYERS)]


def _bytes(n: int) -> int:
    return LAYERS * 2 * HEADS * n * DIM * 4


def test_lookup_finds_the_longest_shared_prefix_within_the_limit() -> None:
    cache = PrefixCache(max_bytes=10**6, block=2)
    cache.add([1, 2, 3, 4, 5], _kv(5, 1.0), version=0)
    cache.add([1, 2, 9, 9], _kv(4, 2.0), version=0)
    n, kv, _ = cache.lookup([1, 2, 3, 4, 7, 8], version=0, limit=10)
    assert n == 4 and kv[0][0].shape == (HEADS, 4, DIM) and float(kv[0][0].max()) == 1.0
    assert float(kv[1][1].min()) == -1.0
    n, kv, _ = cache.lookup([1, 2, 3, 4, 5, 6], version=0, limit=3)  # at most ``limit`` tokens
    assert n == 3 and kv[0][0].shape[1] == 3
    assert cache.lookup([7, 1, 2], version=0, limit=3) == (0, [], 0)
    assert cache.stats["prefix_hits"] == 2 and cache.stats["prefix_reused_tokens"] == 7


def test_another_weights_version_reuses_nothing_and_its_entries_go() -> None:
    cache = PrefixCache(max_bytes=10**6, block=2)
    cache.add([1, 2, 3], _kv(3, 1.0), version=4)
    assert cache.lookup([1, 2, 3, 4], version=4, limit=3)[0] == 3
    assert cache.lookup([1, 2, 3, 4], version=5, limit=3) == (0, [], 5)
    assert len(cache) == 0 and cache.nbytes == 0


def test_a_match_shorter_than_a_block_is_not_reused() -> None:
    cache = PrefixCache(max_bytes=10**6, block=4)
    cache.add([1, 2, 3, 4, 5, 6], _kv(6, 1.0), version=0)
    cache.add([1, 2, 3], _kv(3, 1.0), version=0)  # shorter than a block: not held
    assert len(cache) == 1
    assert cache.lookup([1, 2, 3, 9], version=0, limit=4) == (0, [], 0)
    assert cache.lookup([1, 2, 3, 4, 5, 9], version=0, limit=6)[0] == 5


def test_an_extension_replaces_the_entry_it_extends() -> None:
    cache = PrefixCache(max_bytes=10**6, block=2)
    cache.add([1, 2, 3], _kv(3, 1.0), version=0)
    cache.add([5, 6], _kv(2, 3.0), version=0)
    cache.add([1, 2, 3, 4, 5], _kv(5, 2.0), version=0)  # the next turn of [1, 2, 3]
    assert len(cache) == 2 and cache.nbytes == _bytes(2) + _bytes(5)
    n, kv, _ = cache.lookup([1, 2, 3], version=0, limit=3)
    assert n == 3 and float(kv[0][0].max()) == 2.0


def test_the_least_recently_used_entries_leave_to_stay_within_the_budget() -> None:
    cache = PrefixCache(max_bytes=_bytes(10), block=2)
    cache.add([1, 1, 1, 1], _kv(4, 1.0), version=0)
    cache.add([2, 2, 2, 2], _kv(4, 2.0), version=0)
    assert cache.lookup([1, 1, 9], version=0, limit=2)[0] == 2  # [1, ...] used last
    cache.add([3, 3, 3, 3], _kv(4, 3.0), version=0)  # 12 tokens > 10: the oldest use goes
    assert cache.lookup([2, 2], version=0, limit=2) == (0, [], 0)
    assert cache.lookup([1, 1], version=0, limit=2)[0] == 2 and cache.lookup([3, 3], version=0, limit=2)[0] == 2
    assert cache.nbytes == _bytes(8) and cache.stats["prefix_evicted"] == 1
    cache.add(list(range(11)), _kv(11, 4.0), version=0)  # bigger than the whole budget: not held
    assert cache.nbytes == _bytes(8)


def test_a_generation_reuses_kv_up_to_max_age_versions_old_and_exact_lookups_never() -> None:
    cache = PrefixCache(max_bytes=10**6, block=2, max_age=2)
    cache.add([1, 2, 3, 4], _kv(4, 1.0), version=3)
    hit = cache.lookup([1, 2, 3, 4, 5], version=5, limit=4)  # two versions old: reused
    assert (hit.n, hit.version) == (4, 3) and float(hit.kv[0][0].max()) == 1.0
    assert cache.lookup([1, 2, 3, 4, 5], version=5, limit=4, exact=True) == (0, [], 5)
    assert cache.stats["prefix_stale_hits"] == 1 and cache.stats["prefix_stale_reused_tokens"] == 4
    cache.add([1, 2, 3, 4, 5, 6], _kv(6, 2.0), version=3, now=5)  # the next turn, on that old KV
    assert len(cache) == 1 and cache.lookup([1, 2, 3, 4, 5, 6, 7], version=5, limit=6).n == 6
    assert cache.lookup([1, 2, 9], version=6, limit=2) == (0, [], 6)  # three versions old: gone
    assert len(cache) == 0 and cache.nbytes == 0
    cache.add([1, 2, 3], _kv(3, 1.0), version=3, now=6)  # too old to keep
    assert len(cache) == 0


def test_an_older_extension_does_not_replace_a_fresher_entry() -> None:
    cache = PrefixCache(max_bytes=10**6, block=2, max_age=4)
    cache.add([1, 2, 3], _kv(3, 1.0), version=5)
    cache.add([1, 2, 3, 4, 5], _kv(5, 2.0), version=4, now=5)  # extends it on older KV
    assert len(cache) == 2
    exact = cache.lookup([1, 2, 3, 9], version=5, limit=3, exact=True)
    assert (exact.n, exact.version) == (3, 5) and float(exact.kv[0][0].max()) == 1.0
    assert cache.lookup([1, 2, 3, 4, 5, 9], version=5, limit=6)[::2] == (5, 4)
