"""No live session is lost, and none is dropped uncounted: every way a session closes -- ``/end``
after feedback, idle after feedback (``close_after_feedback_s``), the feedback timeout, eviction
by ``max_sessions``, the run stopping -- submits, scores or drops its segments and counts them
by cause. The real ``LiveService`` over a real HF engine (a random tiny model: the tokens do
not matter here), a real reward service and the in-process replay store; the session clock is
a settable one so the sweeps are exact."""

from __future__ import annotations

import asyncio
import json

import pytest

from cluster.live import LocalLivePorts, local_reward_service
from gateway.config import LiveConfig
from gateway.service import LiveService
from replay.config import ReplayConfig
from replay.memory import InProcessReplayStore
from rollout.config import HFEngineConfig
from rollout.engines import local_client
from tests.gateway_fixtures import random_policy  # noqa: F401 - a fixture


@pytest.fixture(scope="module")
def engine(random_policy):
    return local_client(HFEngineConfig(), random_policy)


class Clock:
    """The session recorder's clock, moved by hand."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _service(engine, cfg: LiveConfig, rewards_cfg=None, judges=(), record_path=None, scorable=False):
    store = InProcessReplayStore(ReplayConfig(), batch_groups=1)
    ports = LocalLivePorts(local_reward_service(store, rewards_cfg, judges), store)
    svc = LiveService(cfg, engine, ports, scorable_without_feedback=scorable, record_path=record_path)
    svc.recorder.clock = clock = Clock()
    return svc, store, ports, clock


async def _ask(svc: LiveService, sid: str) -> dict:
    call = await svc.open_call({"model": "turnrl-policy", "max_tokens": 3,
                                "messages": [{"role": "user", "content": f"hello {sid}"}]}, sid)
    return await svc.complete(call)


def _live_sessions(store: InProcessReplayStore) -> list[str]:
    """Session ids of the live groups in replay, oldest first (claimed and acknowledged)."""
    n = store.stats().live_ready
    if n == 0:
        return []
    claim = store.claim(n, live=(n, n))
    store.ack(claim.claim_id, 1)
    return [g.trajectories[0].live.session_id for g in claim.groups]


def test_eviction_submits_a_session_with_feedback_and_counts_one_without(engine) -> None:
    # max_sessions 2: the third session evicts the least recently active one ("a", which has
    # feedback: submitted and recorded), the fourth evicts "b" (no feedback, no PRM or judge
    # to score it without: dropped, counted). Before the fix the evicted session vanished.
    async def go():
        svc, store, ports, clock = _service(engine, LiveConfig(enabled=True, max_sessions=2))
        await _ask(svc, "a")
        svc.feedback("a", {"outcome": 1.0})
        clock.now = 1.0
        await _ask(svc, "b")
        clock.now = 2.0
        await _ask(svc, "c")
        clock.now = 3.0
        await _ask(svc, "d")
        await svc.drain()
        stats = svc.stats()
        sessions = _live_sessions(store)
        await ports.close()
        return stats, sessions

    stats, sessions = asyncio.run(go())
    assert stats["sessions_open"] == 2
    assert stats["closed"] == {"ended": 0, "feedback_idle": 0, "timed_out": 0, "evicted": 2, "run_ended": 0}
    assert stats["episodes"]["recorded"] == 1 and stats["episodes"]["dropped_unscorable"] == 1
    assert stats["feedback"]["timed_out"] == 1  # "b" closed without feedback
    assert sessions == ["a"]


def test_an_end_or_feedback_after_the_close_is_answered_not_lost(engine) -> None:
    # A client's /end racing close_after_feedback_s (measured by bench/live_load.py: 18 of 1,519
    # sessions at 256 concurrent got 404): the closed session's /end gets the same answer again;
    # feedback after the close is a 409 naming the cause, never silently dropped.
    from gateway.errors import SessionClosed

    async def go():
        svc, store, ports, clock = _service(engine, LiveConfig(enabled=True, close_after_feedback_s=2))
        await _ask(svc, "s")
        svc.feedback("s", {"outcome": 1.0})
        clock.now = 2.0
        assert await svc.sweep() == 1
        ended = svc.end("s")
        with pytest.raises(SessionClosed, match="closed \\(feedback_idle\\) and submitted"):
            svc.feedback("s", {"outcome": 0.0})
        await svc.drain()
        stats = svc.stats()
        await ports.close()
        return ended, stats

    ended, stats = asyncio.run(go())
    assert ended == {"session_id": "s", "turns": 1, "submitted": True, "closed": "feedback_idle"}
    assert stats["closed"]["feedback_idle"] == 1 and stats["episodes"]["recorded"] == 1
    assert stats["feedback"]["invalid"] == 1


def test_sessions_close_after_feedback_when_idle_and_time_out_without(engine, tmp_path) -> None:
    # close_after_feedback_s 10: "fb" has feedback and no /end, so the sweep at t=10 (not at
    # t=9.9) closes and submits it; "quiet" has none and waits for feedback_timeout_s (600),
    # then is dropped (on_timeout: drop). A request after the close opens a new session under
    # the same id; the run stopping closes it (run_ended), kept in the record file.
    record = tmp_path / "live_sessions.jsonl"
    cfg = LiveConfig(enabled=True, close_after_feedback_s=10, feedback_timeout_s=600, on_timeout="drop")

    async def go():
        svc, store, ports, clock = _service(engine, cfg, record_path=record)
        await _ask(svc, "fb")
        await _ask(svc, "quiet")
        clock.now = 5.0
        svc.feedback("fb", {"outcome": 0.5})  # feedback restarts the idle clock
        clock.now = 14.9
        assert await svc.sweep() == 0
        clock.now = 15.0
        assert await svc.sweep() == 1
        first = _live_sessions(store)
        await _ask(svc, "fb")  # again: a new session under the same id
        clock.now = 599.0
        assert await svc.sweep() == 0
        clock.now = 600.0
        assert await svc.sweep() == 1  # "quiet"; the new "fb" was active at t=15
        closed_before_stop = dict(svc.stats()["closed"])
        assert await svc.close_all() == 1
        await svc.drain()
        stats = svc.stats()
        await ports.close()
        return first, closed_before_stop, stats

    first, before_stop, stats = asyncio.run(go())
    assert first == ["fb"]
    assert before_stop == {"ended": 0, "feedback_idle": 1, "timed_out": 1, "evicted": 0, "run_ended": 0}
    assert stats["closed"]["run_ended"] == 1 and stats["sessions_open"] == 0
    ep = stats["episodes"]
    assert (ep["recorded"], ep["dropped_no_feedback"], ep["dropped_run_ended"]) == (1, 1, 1)
    rows = [json.loads(line) for line in record.read_text().splitlines()]
    assert [(r["trajectory"]["live"]["session_id"], r["replay"]) for r in rows] == [
        ("fb", "accepted"), ("quiet", "dropped_no_feedback"), ("fb", "dropped_run_ended")]
    assert stats["recorder"]["sessions_opened"] == 3 and stats["recorder"]["sessions_closed"] == 3


def test_a_request_whose_session_closed_while_it_was_sampled_is_still_recorded(engine) -> None:
    # max_sessions 1: "x" is prepared, then "y" evicts it before x's completion is recorded.
    async def go():
        svc, store, ports, clock = _service(engine, LiveConfig(enabled=True, max_sessions=1))
        call = await svc.open_call({"model": "turnrl-policy", "max_tokens": 3,
                                    "messages": [{"role": "user", "content": "hello"}]}, "x")
        await _ask(svc, "y")
        out = await svc.complete(call)
        segments = svc.recorder.segments("x")
        stats = svc.stats()
        await ports.close()
        return out, segments, stats

    out, segments, stats = asyncio.run(go())
    assert out["choices"][0]["message"]["role"] == "assistant"
    assert len(segments) == 1 and len(segments[0].trajectory.turns) == 1
    assert stats["recorder"]["closed_in_flight"] == 1 and stats["closed"]["evicted"] == 1


def test_sources_that_cannot_apply_are_skipped_and_counted(engine, random_policy) -> None:
    # rewards.match and a judge configured. "fb" gets an outcome but no gold calls: match
    # cannot apply (skipped, counted, no match slot written). "nofb" times out without
    # feedback (on_timeout: score, a judge runs): outcome and match cannot apply; the judge
    # scores its turn.
    from rewards.config import JudgeConfig, MatchConfig, RewardsConfig
    from rewards.judge import JudgeWorker
    from rewards.service import LocalJudge

    judge_cfg = JudgeConfig(backend="callable", function="rewards.judge:format_judge")
    rewards_cfg = RewardsConfig(match=MatchConfig(), prm=judge_cfg)
    judges = [LocalJudge(JudgeWorker(judge_cfg, random_policy))]

    async def go():
        svc, store, ports, clock = _service(engine, LiveConfig(enabled=True, feedback_timeout_s=60),
                                            rewards_cfg, judges, scorable=True)
        await _ask(svc, "fb")
        await _ask(svc, "nofb")
        svc.feedback("fb", {"outcome": 1.0})
        svc.end("fb")
        clock.now = 60.0
        assert await svc.sweep() == 1
        await svc.drain()
        n = store.stats().live_ready
        claim = store.claim(n, live=(n, n))
        trajs = {g.trajectories[0].live.session_id: g.trajectories[0] for g in claim.groups}
        counts = ports.reward.stats()["skipped"]
        closed = svc.stats()["closed"]
        await ports.close()
        return trajs, counts, closed

    trajs, skipped, closed = asyncio.run(go())
    assert (closed["ended"], closed["timed_out"]) == (1, 1)
    assert skipped == {"match": 2, "outcome": 1}
    assert trajs["fb"].skipped_sources == ["match"]
    assert trajs["nofb"].skipped_sources == ["match", "outcome"]
    assert trajs["fb"].outcome == 1.0 and trajs["nofb"].outcome is None
    for traj in trajs.values():
        assert "match" not in traj.turns[0].rewards
        assert traj.turns[0].rewards["prm"] is not None  # the judge scored both
