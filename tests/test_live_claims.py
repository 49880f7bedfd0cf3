"""Live training never dies for want of traffic (a run with no live session ready keeps
training): how the learner claims a ``train.source: mixed`` batch (``learner.ports.claim_batch``)
from a real in-process replay store through the learner's own ports. By default (``learner.live_shortfall:
train_rollouts``) a batch is the rollout share plus the sessions that are ready; ``wait``
keeps the fixed mix and waits for it."""

from __future__ import annotations

import time

from redis_fixture import make_group

from learner.config import LearnerConfig
from learner.ports import LocalLearnerPorts, claim_batch
from replay.client import wait_claim
from replay.config import ReplayConfig
from replay.memory import InProcessReplayStore


def _ports(rollout: list[str], live: list[str]) -> LocalLearnerPorts:
    store = InProcessReplayStore(ReplayConfig(live_capacity_groups=8), batch_groups=2)
    for gid in rollout:
        store.put(make_group(gid))
    for gid in live:
        store.put(make_group(gid), scheduled=False)
    return LocalLearnerPorts(store)


def _ids(claim) -> list[str]:
    return [g.group_id for g in claim.groups]


def test_the_default_trains_rollout_groups_when_no_session_is_ready() -> None:
    assert LearnerConfig().live_shortfall == "train_rollouts"
    # a batch of 3 with a live share of 2: the rollout share (1 group) is the batch's floor
    ports = _ports(["S1", "S2"], [])
    assert _ids(claim_batch(ports, 3, 2, False, 0.0)) == ["S1"]
    ports.store.put(make_group("L1"), scheduled=False)
    assert _ids(claim_batch(ports, 3, 2, False, 0.0)) == ["L1", "S2"]  # what is ready of the share
    ports = _ports(["S1", "S2"], ["L1", "L2", "L3"])
    assert _ids(claim_batch(ports, 3, 2, False, 0.0)) == ["L1", "L2", "S1"]  # never more than the share


def test_sessions_alone_make_no_batch_and_a_rollout_only_run_is_unchanged() -> None:
    ports = _ports([], ["L1", "L2"])
    assert claim_batch(ports, 3, 2, False, 0.0) is None  # the rollout share is always needed
    assert ports.store.stats().live_ready == 2  # nothing was taken
    ports = _ports(["S1", "S2"], ["L1"])
    assert _ids(claim_batch(ports, 2, 0, False, 0.0)) == ["S1", "S2"]  # train.source: rollout
    assert claim_batch(_ports([], ["L1"]), 2, 2, False, 0.0) is None  # train.source: live: all live


def test_wait_keeps_the_fixed_mix_and_times_out_without_traffic() -> None:
    ports = _ports(["S1", "S2"], [])
    t0 = time.monotonic()
    got = wait_claim(lambda n, wait_s: claim_batch(ports, n, 1, True, wait_s), 2, timeout_s=0.6)
    assert got is None and time.monotonic() - t0 >= 0.6
    ports.store.put(make_group("L1"), scheduled=False)
    assert _ids(claim_batch(ports, 2, 1, True, 0.0)) == ["L1", "S1"]
