"""The ReplayStore contract, run against every backend: in-process and Redis.

Expected numbers are derived by hand in comments from replay/admission.py's rule::

    capacity = max(0, min(max_concurrent - running,
                          (eta + version + 1) * B - (accepted - evicted + running)))
"""

from __future__ import annotations

from typing import Callable, Iterator

import pytest
from redis_fixture import make_group, new_run_id, redis_server  # noqa: F401 (fixture)

from replay.base import ReplayStore
from replay.record import GroupRecord
from replay.config import ReplayConfig

MakeStore = Callable[..., ReplayStore]


@pytest.fixture(params=["inproc", "redis"])
def make_store(request: pytest.FixtureRequest) -> Iterator[MakeStore]:
    """``make_store(batch_groups, **config)`` builds a fresh, empty store of the backend."""
    made: list[ReplayStore] = []

    def make(batch_groups: int = 2, **overrides: object) -> ReplayStore:
        if request.param == "inproc":
            from replay.memory import InProcessReplayStore

            store: ReplayStore = InProcessReplayStore(ReplayConfig(**overrides), batch_groups)
        else:
            from replay.redis_store import RedisReplayStore

            url = request.getfixturevalue("redis_server").url
            cfg = ReplayConfig(type="redis", url=url, **overrides)
            store = RedisReplayStore(cfg, batch_groups, run_id=new_run_id())
        made.append(store)
        return store

    yield make
    for store in made:
        store.close()


def nbytes(group_id: str, **kw: object) -> int:
    """What ``bytes`` and ``capacity_bytes`` count: the length of the group's replay record
    (replay/codec.py, uncompressed), which is what the Redis backend holds."""
    return GroupRecord.of(make_group(group_id, **kw)).nbytes


def ids(claim) -> list[str]:
    return [g.group_id for g in claim.groups]


# -- admission ----------------------------------------------------------------------------
def test_admission_rule_numbers(make_store: MakeStore) -> None:
    store = make_store(batch_groups=4, eta=1, max_concurrent_groups=6)
    # running 0, version 0, accepted 0: min(6 - 0, (1+0+1)*4 - 0) = min(6, 8) = 6
    assert store.reserve(10) == 6
    # running 6: min(0, 8 - 6) = 0
    assert store.reserve(1) == 0
    store.release(2)
    # running 4: min(6 - 4, 8 - 4) = 2
    assert store.reserve(10) == 2
    for i in range(6):
        assert store.put(make_group(f"g{i}")).accepted
    # each put ended a reservation: running 6 - 6 = 0, accepted 6: min(6, 8 - 6) = 2
    assert store.stats().running == 0
    assert store.reserve(10) == 2
    store.ack(store.claim(4).claim_id, new_version=1)
    # running 2, version 1, accepted 6: min(6 - 2, (1+1+1)*4 - (6+2)) = min(4, 4) = 4
    assert store.reserve(10) == 4
    store.release(100)  # never below zero
    assert store.stats().running == 0


def test_full_keeps_reservation_stale_ends_it(make_store: MakeStore) -> None:
    store = make_store(batch_groups=4, capacity_groups=1, eta=0)
    assert store.reserve(3) == 3  # min(64 - 0, (0+0+1)*4 - 0) = 4 >= 3
    assert store.put(make_group("a")).accepted  # running 3 -> 2
    assert store.put(make_group("b")).status == "full"  # will be retried: still running 2
    assert store.stats().running == 2
    store.ack(store.claim(1).claim_id, new_version=1)
    assert store.put(make_group("c", version=0)).status == "stale"  # finished: running 1
    assert store.stats().running == 1


def test_an_evicted_group_gives_its_admission_place_back(make_store: MakeStore) -> None:
    store = make_store(batch_groups=2, eta=1)
    assert store.reserve(10) == 4  # min(64, (1+0+1)*2 - 0) = 4
    for gid in "abcd":
        assert store.put(make_group(gid, version=0)).accepted
    store.ack(store.claim(2).claim_id, new_version=1)  # a, b trained
    # version 1, accepted 4, evicted 0: (1+1+1)*2 - 4 = 2
    assert store.reserve(10) == 2
    store.release(2)
    store.ack(store.claim(1).claim_id, new_version=2)  # c trained; d (version 0) now stale
    assert store.claim(1) is None  # d evicted on the way: staleness 2 > eta 1
    assert store.stats().evicted == {"stale": 1}
    # version 2, accepted 4, one of them evicted: (1+2+1)*2 - (4 - 1) = 5; counting d as
    # still to be trained would grant 4 and keep every later batch a group short
    assert store.reserve(10) == 5
    # a live group evicted untrained took no reservation: it gives nothing back
    live = make_store(batch_groups=1, eta=0)
    assert live.put(make_group("L", version=0), scheduled=False).accepted
    assert live.reserve(1) == 1  # (0+0+1)*1 - 0
    assert live.put(make_group("S", version=0)).accepted
    live.ack(live.claim(1).claim_id, new_version=1)  # S trained; L (version 0) now stale
    assert live.claim(1, live=(1, 1)) is None and live.stats().evicted == {"stale": 1}
    assert live.reserve(10) == 1  # (0+1+1)*1 - 1, as if L had never been put


# -- staleness ----------------------------------------------------------------------------
def test_staleness_eviction_refusal_and_histogram(make_store: MakeStore) -> None:
    store = make_store(eta=1)
    for gid in "abcd":
        store.put(make_group(gid, version=0))
    first = store.claim(2)
    assert ids(first) == ["a", "b"] and first.staleness == [0, 0]
    store.ack(first.claim_id, new_version=2)
    # c, d: staleness 2 - 0 = 2 > eta 1 -> evicted on the way, leaving 0 < 2 ready
    assert store.claim(2) is None
    s = store.stats()
    assert (s.ready, s.bytes, s.evicted) == (0, 0, {"stale": 2})
    assert store.put(make_group("e", version=0)).status == "stale"  # 2 - 0 > 1
    assert store.put(make_group("f", version=1)).accepted  # 2 - 1 = 1 = eta: still fresh
    assert store.put(make_group("h", version=2)).accepted
    second = store.claim(2)
    assert ids(second) == ["f", "h"] and second.staleness == [1, 0]
    s = store.stats()
    assert s.staleness_hist == {0: 3, 1: 1}
    assert s.refused == {"stale": 1} and s.evicted == {"stale": 2}
    assert (s.accepted, s.trained) == (6, 2)  # a b c d f h accepted; a b trained


# -- capacity -----------------------------------------------------------------------------
def test_capacity_groups_counts_claimed_until_acked(make_store: MakeStore) -> None:
    store = make_store(capacity_groups=2)
    assert store.put(make_group("a")).accepted and store.put(make_group("b")).accepted
    full = store.put(make_group("c"))
    assert full.status == "full" and "2 groups" in full.detail
    claim = store.claim(1)
    assert store.put(make_group("c")).status == "full"  # a is claimed, still held
    store.ack(claim.claim_id, new_version=0)
    assert store.put(make_group("c")).accepted
    assert store.stats().refused == {"full": 2}


def test_capacity_bytes(make_store: MakeStore) -> None:
    size = nbytes("g0", tokens=40)  # all g<i> groups have the same size
    assert size * 2 >= 1024, "capacity_bytes must be >= 1024: make the groups bigger"
    store = make_store(capacity_bytes=size * 2 + size // 2)
    assert store.put(make_group("g0", tokens=40)).accepted
    assert store.put(make_group("g1", tokens=40)).accepted
    assert store.put(make_group("g2", tokens=40)).status == "full"  # 3 * size > 2.5 * size
    assert store.stats().bytes == 2 * size


def test_put_many_decides_each_group_on_its_own(make_store: MakeStore) -> None:
    # One call (Redis: one transaction) for four groups: the first two fill the store, the
    # third is refused full, the fourth repeats the first: each gets its own answer, in order.
    store = make_store(capacity_groups=2)
    assert store.reserve(3) == 3
    results = store.put_many([make_group("a"), make_group("b"), make_group("c"), make_group("a")])
    assert [r.status for r in results] == ["accepted", "accepted", "full", "duplicate"]
    s = store.stats()
    assert (s.accepted, s.running, s.refused) == (2, 1, {"full": 1, "duplicate": 1})
    assert ids(store.claim(2)) == ["a", "b"]
    assert store.put_many([]) == []


# -- duplicates ---------------------------------------------------------------------------
def test_duplicate_refused_while_held_and_after_training(make_store: MakeStore) -> None:
    store = make_store()
    assert store.put(make_group("a")).accepted
    assert store.put(make_group("a")).status == "duplicate"
    store.put(make_group("b"))
    store.ack(store.claim(2).claim_id, new_version=1)
    assert store.put(make_group("a", version=1)).status == "duplicate"
    s = store.stats()
    assert (s.accepted, s.trained, s.refused) == (2, 2, {"duplicate": 2})


def test_refused_group_may_be_offered_again(make_store: MakeStore) -> None:
    store = make_store(capacity_groups=1)
    store.put(make_group("a"))
    assert store.put(make_group("b")).status == "full"
    store.ack(store.claim(1).claim_id, new_version=0)
    assert store.put(make_group("b")).accepted  # refusals do not mark an id as seen


# -- claim / ack / recover ----------------------------------------------------------------
def test_claim_oldest_first_none_while_short(make_store: MakeStore) -> None:
    store = make_store()
    for gid in "abc":
        store.put(make_group(gid))
    assert ids(store.claim(2)) == ["a", "b"]
    assert store.claim(2) is None  # only c is ready: never a partial batch
    assert store.stats().ready == 1


def test_ack_unknown_or_twice_raises(make_store: MakeStore) -> None:
    store = make_store()
    store.put(make_group("a"))
    claim = store.claim(1)
    with pytest.raises(KeyError):
        store.ack("c999", new_version=1)
    store.ack(claim.claim_id, new_version=1)
    with pytest.raises(KeyError):
        store.ack(claim.claim_id, new_version=2)
    assert store.version() == 1


def test_ack_never_lowers_version(make_store: MakeStore) -> None:
    store = make_store()
    for gid in "ab":
        store.put(make_group(gid))
    first, second = store.claim(1), store.claim(1)
    store.ack(second.claim_id, new_version=3)
    store.ack(first.claim_id, new_version=2)  # acks may come out of order
    assert store.version() == 3


def test_recover_redelivers_only_unacknowledged(make_store: MakeStore) -> None:
    store = make_store()
    for gid in "abcde":
        store.put(make_group(gid))
    lost, done = store.claim(2), store.claim(2)
    store.ack(done.claim_id, new_version=1)
    assert store.recover() == 2
    assert store.recover() == 0
    with pytest.raises(KeyError):
        store.ack(lost.claim_id, new_version=1)  # recovered claims are gone
    again = store.claim(3)
    assert sorted(ids(again)) == ["a", "b", "e"]
    store.ack(again.claim_id, new_version=2)
    s = store.stats()
    assert (s.trained, s.ready, s.claimed, s.bytes) == (5, 0, 0, 0)


def test_recover_keeps_claim_order_at_the_front(make_store: MakeStore) -> None:
    store = make_store()
    for gid in "abcde":
        store.put(make_group(gid))
    store.claim(2), store.claim(2)  # [a, b] then [c, d], neither acknowledged
    assert store.recover() == 4
    assert ids(store.claim(5)) == ["a", "b", "c", "d", "e"]


def test_acknowledged_groups_are_retained_until_a_checkpoint_commits_them(make_store: MakeStore) -> None:
    store = make_store()
    for gid in "abcd":
        store.put(make_group(gid))
    store.ack(store.claim(2).claim_id, new_version=1)
    store.ack(store.claim(2).claim_id, new_version=2)
    s = store.stats()
    assert (s.trained, s.retained, s.bytes, s.ready, s.claimed) == (4, 4, 0, 0, 0)
    assert store.commit(1) == 2  # checkpoint of version 1 holds [a, b]'s update only
    assert store.commit(1) == 0
    assert store.stats().retained == 2
    assert store.commit(5) == 2
    assert (store.stats().retained, store.stats().trained) == (0, 4)


def test_ack_with_commit_forgets_at_once_what_a_learner_without_checkpoints_trained(
        make_store: MakeStore) -> None:
    store = make_store()
    for gid in "abcd":
        store.put(make_group(gid))
    store.ack(store.claim(2).claim_id, new_version=1)  # retained: a checkpoint may follow
    store.ack(store.claim(2).claim_id, new_version=2, commit=True)  # no checkpoint: both go
    s = store.stats()
    assert (s.version, s.trained, s.retained, s.bytes, s.ready, s.claimed) == (2, 4, 0, 0, 0, 0)
    assert store.commit(2) == 0
    assert store.recover(checkpoint_version=2) == 0  # nothing left to deliver again


def test_recover_to_a_checkpoint_redelivers_what_the_lost_updates_trained(make_store: MakeStore) -> None:
    # Claims: [a b] acked -> v1, [c d] acked -> v2, [e f] acked -> v3, [g] claimed, never acked.
    # The learner dies; its last checkpoint is v1. [a b] stays trained (committed), [c d] [e f]
    # (updates lost with the learner) and [g] come back, in claim order, and the version is 1.
    store = make_store(batch_groups=2, eta=4)
    for gid in "abcdefgh":
        store.put(make_group(gid))
    for version in (1, 2, 3):
        store.ack(store.claim(2).claim_id, new_version=version)
    store.claim(1)
    assert store.recover(checkpoint_version=1) == 5
    s = store.stats()
    size = nbytes("a")
    assert (s.version, s.trained, s.retained, s.ready, s.claimed) == (1, 2, 0, 6, 0)
    assert s.bytes == 6 * size
    assert ids(store.claim(6)) == ["c", "d", "e", "f", "g", "h"]
    assert store.recover(checkpoint_version=1) == 6  # idempotent: nothing was acknowledged since


# -- counters -----------------------------------------------------------------------------
def test_stats_counters_through_a_step(make_store: MakeStore) -> None:
    store = make_store(batch_groups=2)
    assert store.reserve(3) == 3
    for gid in "abc":
        store.put(make_group(gid))
    store.release(0)
    claim = store.claim(2)
    s = store.stats()
    size = nbytes("a")  # one-letter ids: all three groups have the same size
    assert (s.version, s.ready, s.claimed, s.running) == (0, 1, 2, 0)
    assert (s.accepted, s.trained, s.bytes) == (3, 0, 3 * size)
    store.ack(claim.claim_id, new_version=1)
    s = store.stats()
    assert (s.version, s.ready, s.claimed, s.trained, s.bytes) == (1, 1, 0, 2, size)
    assert store.size() == 1 and s.staleness_hist == {0: 2}
    assert s.refused == {} and s.evicted == {}


def test_bytes_are_encoded_record_bytes(make_store: MakeStore) -> None:
    # The rule changed from "the group's JSON in UTF-8" to "its binary record": Redis holds
    # the record, and counting JSON would mean encoding every group a second time. Text is
    # still counted in UTF-8 bytes: "é€" is 2 characters, 5 bytes, and a string under 32
    # bytes has a 1-byte msgpack header either way, so each of make_group's 2 turns adds 5.
    store = make_store()
    store.put(make_group("a", text="é€"))
    assert store.stats().bytes == nbytes("a", text="é€") == nbytes("a") + 2 * 5


# -- live groups (unscheduled puts) -------------------------------------------------------
def test_live_puts_take_no_reservation_and_have_their_own_bound(make_store: MakeStore) -> None:
    store = make_store(batch_groups=2, live_capacity_groups=2, capacity_groups=10)
    assert store.reserve(1) == 1
    assert store.live_room() == 2
    assert store.put(make_group("L1"), scheduled=False).accepted
    assert store.put(make_group("L2"), scheduled=False).accepted
    assert store.live_room() == 0
    full = store.put(make_group("L3"), scheduled=False)
    assert full.status == "live_full" and "2 live groups held" in full.detail
    s = store.stats()
    # the producer's reservation is untouched; live counts apart from the admission counter
    assert (s.running, s.accepted, s.live_accepted, s.live_ready, s.live_held) == (1, 0, 2, 2, 2)
    assert s.ready == 2 and s.refused == {"live_full": 1}
    assert store.put(make_group("S1")).accepted  # a scheduled put still has room
    assert store.stats().running == 0


def test_claim_composes_live_and_scheduled_groups(make_store: MakeStore) -> None:
    store = make_store(batch_groups=3, live_capacity_groups=4)
    for gid in ("S1", "S2", "S3"):
        store.put(make_group(gid))
    store.put(make_group("L1"), scheduled=False)
    assert ids(store.claim(2)) == ["S1", "S2"]  # by default no live group is claimed
    assert store.claim(2, live=(2, 2)) is None  # one live group ready, two wanted
    mixed = store.claim(2, live=(1, 2))  # as many live as ready within 1..2, the rest scheduled
    assert ids(mixed) == ["L1", "S3"]
    assert store.live_room() == 3  # L1 is claimed, still held
    store.ack(mixed.claim_id, new_version=1)
    s = store.stats()
    assert (s.live_trained, s.trained, s.live_held, store.live_room()) == (1, 2, 0, 4)
    with pytest.raises(ValueError, match="fewest <= most"):
        store.claim(2, live=(2, 1))


def test_recover_requeues_live_groups_as_live_and_evicts_stale_ones(make_store: MakeStore) -> None:
    store = make_store(batch_groups=1, eta=1)
    store.put(make_group("L0", version=0), scheduled=False)
    store.put(make_group("L1", version=0), scheduled=False)
    lost = store.claim(1, live=(1, 1))
    assert store.recover() == 1
    assert ids(store.claim(2, live=(2, 2))) == [lost.groups[0].group_id, "L1"]
    store.recover()
    first = store.claim(1, live=(1, 1))
    store.ack(first.claim_id, new_version=2)  # L1, at version 0, is now 2 behind: stale
    assert store.claim(1, live=(1, 1)) is None
    s = store.stats()
    assert s.evicted == {"stale": 1} and s.live_ready == 0 and s.live_held == 0
    # rewinding to the checkpoint at version 0 puts the trained live group back in the live queue
    assert store.recover(checkpoint_version=0) == 1
    assert ids(store.claim(1, live=(1, 1))) == ["L0"] and store.stats().live_trained == 0
