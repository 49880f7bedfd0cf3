"""The replay host's waiting claim and the reward side's coalesced puts.

``ReplayHost.claim_wait`` holds a learner's claim until puts make the batch (no polling);
``PutCoalescer`` sends the puts that arrive while one is in flight as one ``put_many``.
"""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
from redis_fixture import make_group

from cluster.reward_service import ReplayPut
from replay.client import PutCoalescer, wait_claim
from replay.config import ReplayConfig
from replay.host import ACTOR_THREADS, ReplayHost
from replay.memory import InProcessReplayStore
from replay.record import GroupRecord


def test_a_waiting_claim_is_woken_by_the_put_that_completes_the_batch(tmp_path) -> None:
    host = ReplayHost(ReplayConfig(), 2, str(tmp_path), "wake")
    host.put(make_group("a"))
    timer = threading.Timer(0.3, lambda: host.put(make_group("b")))
    timer.start()
    t0 = time.monotonic()
    claim = host.claim_wait(2, None, wait_s=30.0)
    waited = time.monotonic() - t0
    timer.join()
    assert [g.group_id for g in claim.groups] == ["a", "b"]
    assert waited < 15.0, f"waited {waited:.1f}s: the put did not wake the claim"


def test_a_waiting_claim_gives_none_when_the_wait_ends(tmp_path) -> None:
    host = ReplayHost(ReplayConfig(), 2, str(tmp_path), "empty")
    host.put(make_group("a"))
    t0 = time.monotonic()
    assert host.claim_wait(2, None, wait_s=0.4) is None
    assert time.monotonic() - t0 >= 0.4
    assert host.stats().ready == 1  # nothing claimed by the failed wait


def test_wait_claim_checks_for_a_stop_between_slices() -> None:
    asked: list[float] = []

    def claim(n: int, wait_s: float) -> None:
        asked.append(wait_s)
        time.sleep(0.01)
        return None

    stops = iter([False, False, True])
    assert wait_claim(claim, 2, timeout_s=600, should_stop=lambda: next(stops)) is None
    assert asked == [0.5, 0.5]  # slices of 0.5 s, not one call for the whole timeout


def test_the_replay_actor_lets_puts_in_while_a_claim_waits(ray_cluster, tmp_path) -> None:
    ray = ray_cluster
    host = ray.remote(ReplayHost).options(num_cpus=0, max_concurrency=ACTOR_THREADS).remote(
        ReplayConfig(), 1, str(tmp_path), "actor")
    waiting = host.claim_wait.remote(1, None, 60.0)
    time.sleep(0.5)
    assert ray.get(host.put.remote(make_group("a")), timeout=30).accepted  # not queued behind the claim
    claim = ray.get(waiting, timeout=30)
    assert [g.group_id for g in claim.groups] == ["a"]
    ray.kill(host)


def test_groups_travel_to_and_from_the_replay_actor_as_records(ray_cluster, tmp_path) -> None:
    """The reward side encodes (``ReplayPut``), the actor stores and hands back the bytes
    without decoding them, and the claimer decodes them once, into the groups put."""
    ray = ray_cluster
    host = ray.remote(ReplayHost).options(num_cpus=0, max_concurrency=ACTOR_THREADS).remote(
        ReplayConfig(), 2, str(tmp_path), "records")
    groups = [make_group("a", tokens=40), make_group("b", tokens=40)]
    groups[0].trajectories[0].producer = "rollout-0"
    assert ray.get(host.reserve.remote(2, "rollout-0")) == 2
    results = asyncio.run(ReplayPut(host)(groups))
    assert [r.status for r in results] == ["accepted", "accepted"]
    claim = ray.get(host.claim.remote(2), timeout=30)
    assert "groups" not in vars(claim)  # nothing decoded on the way
    assert claim.payloads == [GroupRecord.of(g).payload for g in groups]
    assert claim.groups == groups
    # the record's producer was read: a's put used one of rollout-0's two reservations
    assert ray.get(host.release_producer.remote("rollout-0")) == 1
    ray.kill(host)


def test_puts_arriving_during_a_call_go_together_in_the_next() -> None:
    store = InProcessReplayStore(ReplayConfig(capacity_groups=6), 1)
    calls: list[list[str]] = []

    async def put_many(groups):
        calls.append([g.group_id for g in groups])
        await asyncio.sleep(0.05)  # the round trip, during which more puts arrive
        return store.put_many(groups)

    async def main():
        put = PutCoalescer(put_many)
        first = asyncio.ensure_future(put(make_group("g0")))
        await asyncio.sleep(0.01)  # its call is in flight
        return await asyncio.gather(first, *[put(make_group(f"g{i}")) for i in range(1, 8)])

    results = asyncio.run(main())
    assert calls == [["g0"], [f"g{i}" for i in range(1, 8)]]
    assert [r.status for r in results] == ["accepted"] * 6 + ["full"] * 2  # each its own answer
    assert store.stats().accepted == 6


def test_a_failed_call_fails_every_put_in_it_and_the_next_call_goes_on() -> None:
    calls: list[int] = []

    async def put_many(groups):
        calls.append(len(groups))
        await asyncio.sleep(0.01)
        if len(calls) == 1:
            raise ConnectionError("replay actor died")
        return InProcessReplayStore(ReplayConfig(), 1).put_many(groups)

    async def main():
        put = PutCoalescer(put_many)
        first = asyncio.ensure_future(put(make_group("a")))
        await asyncio.sleep(0)  # the first call is in flight
        rest = [asyncio.ensure_future(put(make_group(g))) for g in ("b", "c")]
        with pytest.raises(ConnectionError, match="replay actor died"):
            await first
        return await asyncio.gather(*rest)

    assert [r.status for r in asyncio.run(main())] == ["accepted", "accepted"]
    assert calls == [1, 2]


def test_a_dead_processs_waiting_admission_is_refused_once_its_producer_is_released(tmp_path) -> None:
    """A rollout worker killed while its admission request waits here for room: the driver
    gives its reservations back (``release_producer``), which frees room, and the dead
    process's request, still waiting, must not be granted it (nobody would ever use or give
    back that grant: with eta 1 and batches of 2 a grant of 4 admits nothing more, and the
    run stops; test_multinode's hang). The restarted worker asks under a new token."""
    host = ReplayHost(ReplayConfig(eta=1, max_concurrent_groups=16), 2, str(tmp_path), "fence")
    dead, new = "rollout-0#deadbeef", "rollout-0#0a1b2c3d"
    assert host.reserve(4, dead) == 4  # (eta + version + 1) * batch = 4: all the room there is
    answer: list[int] = []
    waiting = threading.Thread(target=lambda: answer.append(host.reserve_wait(4, dead, wait_s=3.0)))
    waiting.start()
    time.sleep(0.3)  # its request waits for room
    assert host.release_producer("rollout-0") == 4  # the groups it lost
    waiting.join(timeout=10)
    assert answer == [0] and host.stats().running == 0
    host.release(2, dead)  # its failed groups' give-back, late: already given back, not again
    assert host.reserve(4, new) == 4 and host.stats().running == 4
    assert host.release_producer("rollout-0") == 4  # the new process's, when it dies in turn


def test_each_process_of_a_producer_names_itself_apart() -> None:
    """Ray starts a restarted actor from the same pickled arguments: the token is drawn in the
    process, so the new process's reservations are not the dead one's."""
    import pickle

    from rollout.ports import ActorPorts, producer_name

    ports = ActorPorts(None, None, "rollout-3")
    first, again = ports.producer, pickle.loads(pickle.dumps(ports)).producer
    assert first == ports.producer  # one name for the life of the process
    assert first != again and producer_name(first) == producer_name(again) == "rollout-3"
    assert ActorPorts(None, None).producer is None  # no ledger entry for an unnamed producer
