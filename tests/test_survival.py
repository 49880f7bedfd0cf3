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


def _run_killing(cfg, title: str, after_step: int = 1) -> tuple[object, float, Path]:
    """Train ``cfg`` in a thread; once step ``after_step`` is logged, kill -9 one actor of
    class ``title``; returns (run result, seconds from the kill until the next step was
    logged, run dir)."""
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
        killed_at, t_kill = _steps_logged(run_dir), time.monotonic()
        os.kill(before[0], signal.SIGKILL)
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
