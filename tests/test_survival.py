"""Runs that survive the loss of a component: kill -9 actors' processes during a run; the run
finishes its step budget without a manual step and trains no group twice. The test prints
the time from each kill until the next training step was logged (docs/cluster.md reports
them: ``pytest -s tests/test_survival.py``)."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import psutil
import pytest

pytestmark = pytest.mark.slow


def _actor_pids(title: str) -> list[int]:
    """Processes of live Ray actors of class ``title`` (Ray titles them ``ray::<Class>...``)."""
    return [p.pid for p in psutil.process_iter(["cmdline"])
            if (p.info["cmdline"] or [""])[0].startswith(f"ray::{title}")]


def _wait(predicate, timeout: float, what: str) -> float:
    t0 = time.monotonic()
    while not predicate():
        if time.monotonic() - t0 > timeout:
            raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(0.05)
    return time.monotonic() - t0


def _steps_logged(run_dir: Path) -> int:
    path = run_dir / "metrics.jsonl"
    return len(path.read_text().splitlines()) if path.exists() else 0


@dataclass
class Victim:
    """What to kill -9: ``pids()`` lists the live processes of its kind (a new one appearing
    means it was restarted), ``pick(run_dir)`` the one to kill (default: the first)."""

    name: str
    pids: Callable[[], list[int]]
    pick: Callable[[Path], int] | None = None


def actor(title: str, role: str | None = None) -> Victim:
    """A Ray actor of class ``title``; with ``role``, the first actor of that role in
    placement.json."""
    pick = (lambda d: json.loads((d / "placement.json").read_text())[role][0]["pid"]) if role else None
    return Victim(title, lambda: _actor_pids(title), pick)


def redis_server(run_dir: Path) -> Victim:
    """The run's embedded redis-server, as its server.json names it."""
    def pids() -> list[int]:
        pid = json.loads((run_dir / "redis" / "server.json").read_text())["pid"]
        return [pid] if psutil.pid_exists(pid) else []
    return Victim("redis-server", pids)


def _run_killing(cfg, kills: list[Victim]) -> tuple[object, dict[str, tuple[float, float]], Path, list[str]]:
    """Train ``cfg`` in a thread; after step k (k = 1, 2, ...) is logged, kill -9 the k-th
    victim, waiting for a new process of its kind and the next logged step before the next
    kill. Returns (run result, seconds from each kill to a new process and to the next logged
    step, run dir, the driver's stage messages)."""
    from cluster.driver import train

    run_dir = Path(cfg.output_dir) / cfg.name
    out: dict[str, object] = {}
    stages: list[str] = []
    recovery: dict[str, tuple[float, float]] = {}
    thread = threading.Thread(target=lambda: out.update(result=train(cfg, on_stage=stages.append)))
    thread.start()
    try:
        for step, victim in enumerate(kills, start=1):
            _wait(lambda: _steps_logged(run_dir) >= step or not thread.is_alive(), 300, f"step {step}")
            assert thread.is_alive(), f"the run ended before killing {victim.name} (its error is in the log above)"
            before = victim.pids()
            assert before, f"no {victim.name} process to kill"
            pid = victim.pick(run_dir) if victim.pick else before[0]
            assert pid in before
            killed_at, t_kill = _steps_logged(run_dir), time.monotonic()
            os.kill(pid, signal.SIGKILL)
            restart_s = _wait(lambda: any(p not in before for p in victim.pids()), 120, f"{victim.name} to restart")
            _wait(lambda: _steps_logged(run_dir) > killed_at or not thread.is_alive(), 300, "a step")
            recovery[victim.name] = (restart_s, time.monotonic() - t_kill)
    finally:
        thread.join(timeout=600)
    assert "result" in out, "the run raised (its error is in the log above)"
    return out["result"], recovery, run_dir, stages


def _trained_once(run_dir: Path, steps: int) -> list[str]:
    trained = [json.loads(line) for line in (run_dir / "trained_groups.jsonl").read_text().splitlines()]
    ids = [g for t in trained for g in t["group_ids"]]
    assert [t["step"] for t in trained] == list(range(1, steps + 1))
    assert len(ids) == len(set(ids)), "a group was trained twice"
    return ids


def _config(tiny_run_config, tmp_path, name: str, extra: list[str]):
    return tiny_run_config([f"output_dir={tmp_path}", f"name={name}", "train.steps=4", "rollout.group_size=2",
                            "learner.batch_groups=2", "rollout.max_new_tokens=32", "eval.num_tasks=0",
                            "progress=none", "learner.num_cpus=0.5", *extra])


def test_a_run_survives_kill_9_of_each_component_in_turn(tiny_run_config, tiny_policy, ray_cluster,
                                                         tmp_path) -> None:
    """One run with Redis replay and every restartable component (IG scorer, environment
    actor, two rollout actors, checkpoints every step), killed one after another, a step apart:

    - the scorer's in-flight batch gets missing rewards (handled by ``rewards.on_missing``);
    - the environment actor's open episodes end with an error;
    - the reward front's groups are dropped by their producers (``rollout/dropped_groups``),
      their reservations released;
    - rollout actor 0's reservations come back through replay's ledger, its in-flight groups
      counted lost (``rollout/lost_groups``);
    - redis-server is started again on its port from its append-only file (every write was
      fsynced before its reply) while every client re-sends what it was doing;
    - the learner restarts from its step checkpoint inside the run, versions moving forward.

    The run trains all its steps, every group that reached replay once or still held there at
    the end, and no group twice."""
    steps = 8
    cfg = _config(tiny_run_config, tmp_path, "survive", [
        f"train.steps={steps}", "rewards.ig={}", "learner.estimator.type=igpo", "rewards.service.scorer_num_cpus=0.2",
        "rollout.env_actors.count=1", "rollout.env_actors.num_cpus=0.1", "rollout.num_workers=2",
        "rollout.num_cpus=0.1", "learner.checkpoint_every=1", "replay.type=redis", "replay.url=embedded"])
    kills = [actor("ModelScorer"), actor("EnvHost"), actor("RewardService"), actor("RolloutWorker", "rollout"),
             redis_server(Path(cfg.output_dir) / cfg.name), actor("LearnerWorker")]
    result, recovery, run_dir, stages = _run_killing(cfg, kills)
    print("".join(f"\n  {s}" for s in stages if "restarted" in s or "died" in s))
    for title, (restart_s, step_s) in recovery.items():
        print(f"  kill -9 {title}: a new process {restart_s:.1f}s later, the next step {step_s:.1f}s later")
    assert result.steps == steps and not result.interrupted
    trained = _trained_once(run_dir, steps)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    versions = [r["version"] for r in rows]
    assert versions == sorted(set(versions)), "versions only move forward across the learner's restart"
    last = rows[-1]
    print(f"  dropped with the reward front: {last['rollout/dropped_groups']:.0f}; lost with rollout actor 0: "
          f"{last['rollout/lost_groups']:.0f}; reservations held at the end: {last['replay/running']:.0f}")
    assert last["replay/running"] <= 2 * cfg.rollout.groups_in_flight  # nothing leaked
    assert any("learner rank 0 died" in s and "restarted from step" in s for s in stages)
    assert any("rollout worker 0 died" in s for s in stages)
    _replay_accounts_for_every_group(cfg, run_dir, trained)


def _replay_accounts_for_every_group(cfg, run_dir: Path, trained: list[str]) -> None:
    """Every group replay accepted was trained once (those of trained_groups.jsonl), evicted
    with a counted reason, or is still held there (the store is reopened from its AOF)."""
    from replay.redis_store import RedisReplayStore

    run_id = json.loads((run_dir / "run.json").read_text())["run_id"]
    store = RedisReplayStore(cfg.replay, cfg.learner.batch_groups, run_dir=run_dir, run_id=run_id)
    try:
        s = store.stats()
    finally:
        store.close()
    print(f"  replay: {s}")
    assert s.accepted == len(trained) + sum(s.evicted.values()) + s.ready + s.claimed


def test_replay_gives_back_a_dead_producers_reservations(tmp_path) -> None:
    from replay.config import ReplayConfig
    from replay.host import ReplayHost
    from rollout.trajectory import Group, Trajectory, Turn

    host = ReplayHost(ReplayConfig(), batch_groups=8, run_dir=str(tmp_path), run_id="ledger")

    def group(gid: str, producer: str) -> Group:
        traj = Trajectory(trajectory_id=gid, task_id="t", group_id=gid, prompt_ids=[1],
                          turns=[Turn(action_ids=[2], action_logprobs=[-1.0], policy_version=0)],
                          outcome=1.0, metadata={"producer": producer})
        return Group(group_id=gid, task_id="t", trajectories=[traj])

    assert host.reserve(3, "a") == 3 and host.reserve(2, "b") == 2
    assert host.stats().running == 5
    assert host.put(group("g1", "a")).accepted  # uses one of a's reservations
    host.release(1, "a")  # a gave one back itself
    assert host.release_producer("a") == 1  # a died holding one more
    assert host.stats().running == 2 and host.release_producer("a") == 0
    assert host.release_producer("b") == 2 and host.stats().running == 0
