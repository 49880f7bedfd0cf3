"""Async admission in waves (``rollout.admission``): an actor starts its next groups only when
all of its previous ones have ended, and waits in replay for room instead of polling.

The worker runs the tiny policy on an in-process engine against a real ``ReplayHost``; a
learner coroutine claims and acknowledges batches, which is what makes room.
"""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from replay.config import ReplayConfig
from replay.host import ReplayHost
from rollout.trajectory import Group


class HostPorts:
    """Rollout ports on a ``ReplayHost`` in this process, counting at every reservation how
    many granted groups were still in flight (granted, not yet put or released).
    ``hold_first_s``: the first group's submit takes that long (a busy reward service), so it
    is still in flight while the others end, however closely the episodes keep step."""

    def __init__(self, host: ReplayHost, hold_first_s: float = 0.0) -> None:
        self.host, self.granted, self.done = host, 0, 0
        self.hold_first_s = hold_first_s
        self.in_flight_at_reserve: list[int] = []

    async def reserve(self, n: int, wait_s: float = 0.0) -> int:
        self.in_flight_at_reserve.append(self.granted - self.done)
        got = await asyncio.to_thread(self.host.reserve_wait, n, None, wait_s)
        self.granted += got
        return got

    async def release(self, n: int) -> None:
        self.host.release(n)
        self.done += n

    async def submit(self, group: Group) -> None:
        if self.hold_first_s:
            hold, self.hold_first_s = self.hold_first_s, 0.0
            await asyncio.sleep(hold)
        self.host.put(group)
        self.done += 1


async def _train_while_producing(worker, host: ReplayHost, steps: int) -> list[int]:
    """Claim and acknowledge ``steps`` batches of 2 while ``worker.run()`` produces; returns
    the versions of the claimed groups."""
    producing = asyncio.create_task(worker.run())
    versions: list[int] = []
    for version in range(1, steps + 1):
        claim = None
        while claim is None:
            assert not producing.done(), producing.result()
            claim = await asyncio.to_thread(host.claim_wait, 2, None, 0.5)
        versions += [g.min_version() for g in claim.groups]
        host.ack(claim.claim_id, version)
    worker.stop()
    await producing
    return versions


@pytest.mark.slow
@pytest.mark.parametrize("admission", ["waves", "continuous"])
def test_waves_start_only_when_the_last_wave_has_ended(admission, tiny_run_config, tiny_policy, tmp_path) -> None:
    from rollout.engines import local_client
    from rollout.worker import RolloutWorker

    policy, _ = tiny_policy
    cfg = tiny_run_config([f"rollout.admission={admission}", "rollout.groups_in_flight=4", "rollout.group_size=2",
                           "rollout.max_new_tokens=16"])
    # eta 8: no group goes stale (the engine stays on v0) and only groups_in_flight limits
    host = ReplayHost(ReplayConfig(eta=8), 2, str(tmp_path), "waves")
    ports = HostPorts(host, hold_first_s=3.0)
    worker = RolloutWorker(0, cfg.rollout, cfg.env, local_client(cfg.rollout.engine, policy), 0, ports)

    versions = asyncio.run(_train_while_producing(worker, host, steps=4))

    assert len(versions) == 8 and versions == [0] * 8  # no weights published: every group on v0
    asked = ports.in_flight_at_reserve
    if admission == "waves":
        assert set(asked) == {0}, f"a wave was started with groups of the last one in flight: {asked}"
    else:
        assert max(asked) > 0, asked  # continuous admission tops up while a group is still in flight


@pytest.mark.slow
def test_a_producer_waits_for_room_in_replay_without_polling(tiny_run_config, tiny_policy, tmp_path) -> None:
    """Replay full (eta 0, batches of 1: one group admitted until a learner acknowledges it):
    a continuous producer's admission request waits in replay, asked again once a second at
    most (it used to ask every 50 ms), and stopping leaves no reservation held."""
    from rollout.engines import local_client
    from rollout.worker import ADMISSION_WAIT_S, RolloutWorker

    policy, _ = tiny_policy
    cfg = tiny_run_config(["rollout.groups_in_flight=2", "rollout.group_size=2", "rollout.max_new_tokens=16"])
    host = ReplayHost(ReplayConfig(eta=0), 1, str(tmp_path), "full")
    ports = HostPorts(host)
    worker = RolloutWorker(0, cfg.rollout, cfg.env, local_client(cfg.rollout.engine, policy), 0, ports)
    seconds = 4.0

    async def produce_then_stop() -> int:
        """Requests made over ``seconds`` once the one admitted group is in replay."""
        producing = asyncio.create_task(worker.run())
        deadline = time.monotonic() + 120
        while host.stats().ready < 1:  # however slow the machine, the window opens once replay is full
            assert not producing.done(), producing.result()
            assert time.monotonic() < deadline, "the admitted group never reached replay"
            await asyncio.sleep(0.05)
        before = len(ports.in_flight_at_reserve)
        await asyncio.sleep(seconds)
        asked = len(ports.in_flight_at_reserve) - before
        worker.stop()
        await producing
        return asked

    asked = asyncio.run(produce_then_stop())
    assert asked <= seconds / ADMISSION_WAIT_S + 1, asked  # polling every 50 ms asked ~80 times
    assert ports.granted == ports.done == 1  # the one group admitted was put
    assert host.stats().running == 0 and host.stats().ready == 1


def test_a_waiting_reservation_is_woken_by_the_ack_that_makes_room(tmp_path) -> None:
    from redis_fixture import make_group

    host = ReplayHost(ReplayConfig(eta=0), 1, str(tmp_path), "room")
    assert host.reserve(5) == 1  # (eta + version + 1) * B = 1 group may run
    assert host.reserve_wait(1, None, wait_s=0.3) == 0  # the wait ends with nothing granted
    host.put(make_group("a"))
    claim = host.claim(1)
    timer = threading.Timer(0.3, lambda: host.ack(claim.claim_id, 1))
    timer.start()
    t0 = time.monotonic()
    granted = host.reserve_wait(5, None, wait_s=30.0)
    waited = time.monotonic() - t0
    timer.join()
    assert granted == 1  # version 1 lets one more group run
    assert waited < 15.0, f"waited {waited:.1f}s: the ack did not wake the reservation"
