"""Runs that survive the loss of a component: kill -9 an actor's process during a run; the run
finishes its step budget without a manual step and trains no group twice. Each test prints
the time from the kill until the next training step was logged (docs/cluster.md reports
them: ``pytest -s tests/test_survival.py``)."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path

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


def _run_killing(cfg, title: str, after_step: int = 1, role: str | None = None) -> tuple[object, float, Path]:
    """Train ``cfg`` in a thread; once step ``after_step`` is logged, kill -9 one actor of
    class ``title`` (with ``role``, the first actor of that role in placement.json); returns
    (run result, seconds from the kill until the next step was logged, run dir)."""
    from cluster.driver import train

    run_dir = Path(cfg.output_dir) / cfg.name
    out: dict[str, object] = {}
    stages: list[str] = []
    thread = threading.Thread(target=lambda: out.update(result=train(cfg, on_stage=stages.append)))
    thread.start()
    try:
        _wait(lambda: _steps_logged(run_dir) >= after_step or not thread.is_alive(), 300, f"step {after_step}")
        assert thread.is_alive(), "the run ended before the kill (its error is in the log above)"
        before = _actor_pids(title)
        assert before, f"no ray::{title} process to kill"
        victim = json.loads((run_dir / "placement.json").read_text())[role][0]["pid"] if role else before[0]
        assert victim in before
        killed_at, t_kill = _steps_logged(run_dir), time.monotonic()
        os.kill(victim, signal.SIGKILL)
        _wait(lambda: any(p not in before for p in _actor_pids(title)), 120, f"{title} to restart")
        _wait(lambda: _steps_logged(run_dir) > killed_at or not thread.is_alive(), 300, "a step")
        recovered = time.monotonic() - t_kill
    finally:
        thread.join(timeout=600)
    assert "result" in out, "the run raised (its error is in the log above)"
    print("".join(f"\n  {s}" for s in stages if "restarted" in s))
    return out["result"], recovered, run_dir


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


def test_a_killed_scorer_comes_back_and_the_run_finishes(tiny_run_config, tiny_policy, ray_cluster,
                                                         tmp_path) -> None:
    cfg = _config(tiny_run_config, tmp_path, "scorer", ["rewards.ig={}", "learner.estimator.type=igpo",
                                                        "rewards.service.scorer_num_cpus=0.2"])
    result, back, run_dir = _run_killing(cfg, "ModelScorer")
    print(f"scorer killed: next step {back:.1f}s later")
    assert result.steps == 4
    _trained_once(run_dir, 4)


def test_a_killed_environment_actor_fails_its_episodes_only(tiny_run_config, tiny_policy, ray_cluster,
                                                            tmp_path) -> None:
    cfg = _config(tiny_run_config, tmp_path, "envhost", ["rollout.env_actors.count=1",
                                                         "rollout.env_actors.num_cpus=0.1"])
    result, back, run_dir = _run_killing(cfg, "EnvHost")
    print(f"environment actor killed: next step {back:.1f}s later")
    assert result.steps == 4
    _trained_once(run_dir, 4)


def test_a_killed_learner_restarts_from_its_checkpoint_inside_the_run(tiny_run_config, tiny_policy, ray_cluster,
                                                                       tmp_path) -> None:
    # Checkpoints every step; the learner is killed once step 2 is logged, so at most the step
    # it was in is lost: replay delivers that step's groups again and the log (cut back to the
    # checkpoint) lists every trained group once.
    cfg = _config(tiny_run_config, tmp_path, "learner", ["learner.checkpoint_every=1"])
    result, back, run_dir = _run_killing(cfg, "LearnerWorker", after_step=2)
    print(f"learner killed: next step {back:.1f}s later")
    assert result.steps == 4 and not result.interrupted
    _trained_once(run_dir, 4)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    versions = [r["version"] for r in rows]
    assert versions == sorted(set(versions)), "versions only move forward across the restart"
    assert json.loads((run_dir / "state.json").read_text())["step"] == 4


def test_a_killed_reward_front_comes_back_and_its_groups_are_counted(tiny_run_config, tiny_policy, ray_cluster,
                                                                      tmp_path) -> None:
    # The front held whatever groups it was scoring or putting: their producers count them
    # dropped (rollout/dropped_groups) and give their reservations back, so admission keeps
    # granting and the run trains its 4 steps on groups that did reach replay.
    cfg = _config(tiny_run_config, tmp_path, "front", [])
    result, back, run_dir = _run_killing(cfg, "RewardService")
    print(f"reward front killed: next step {back:.1f}s later")
    assert result.steps == 4
    _trained_once(run_dir, 4)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    dropped = rows[-1]["rollout/dropped_groups"]
    print(f"  groups dropped with the front: {dropped:.0f}")
    assert dropped >= 0 and rows[-1]["replay/running"] <= cfg.rollout.groups_in_flight  # no leaked slots


def test_a_killed_rollout_actor_restarts_and_its_reservations_come_back(tiny_run_config, tiny_policy,
                                                                        ray_cluster, tmp_path) -> None:
    # Two rollout actors; one dies with groups in flight. Replay's ledger gives back exactly
    # the reservations it held (rollout/lost_groups counts them), Ray restarts it and the
    # driver starts its loop again; the run trains its 4 steps, no group twice.
    cfg = _config(tiny_run_config, tmp_path, "rollout", ["rollout.num_workers=2", "rollout.num_cpus=0.1"])
    result, back, run_dir = _run_killing(cfg, "RolloutWorker", role="rollout")  # worker 0: admitted first
    print(f"rollout actor killed: next step {back:.1f}s later")
    assert result.steps == 4
    _trained_once(run_dir, 4)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    lost = rows[-1]["rollout/lost_groups"]
    print(f"  groups lost with the actor: {lost:.0f}; running per step {[r['replay/running'] for r in rows]}")
    assert 0 <= lost <= cfg.rollout.groups_in_flight
    assert rows[-1]["replay/running"] <= 2 * cfg.rollout.groups_in_flight  # no leaked reservations


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
