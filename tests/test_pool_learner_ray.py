"""A pool's learner on Ray (``cluster.pool_learner``): runs on a pool declared with a
``learner`` start no learner of their own and are trained by the pool's one process.

- two runs with different data and settings train at once through the pool's learner; each
  run's learner is a ``TenantLearner`` whose process loads no torch; each ends with its steps,
  versions and checkpoints of its own, every group trained once, and its slot freed;
- the pool's learner killed mid-run: Ray starts it again, the run's learner is replaced from the
  run's last checkpoint and attaches again, and the run ends with every group trained once.
(The fused steps' equality with separate training: tests/test_pool_learner.py.)
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Any

import pytest

POOL = "shared"


def _start_pool(engine_pools: Any, policy: str, **learner: Any) -> Any:
    import ray

    from cluster.config import PoolConfig

    cfg = PoolConfig(model=policy, engine={"type": "hf", "count": 1, "num_cpus": 0.2}, max_adapters=3,
                     learner={"num_cpus": 0.3, "coalesce_s": 0.3, "torch_threads": 1, **learner})
    pool = engine_pools(POOL, cfg, policy)
    ray.get(pool.start.remote())
    return pool


def _run_cfg(tiny_run_config, tmp_path: Path, name: str, *extra: str) -> Any:
    return tiny_run_config([
        f"output_dir={tmp_path}", f"name={name}", "rollout.group_size=2", "learner.batch_groups=2",
        "rollout.groups_in_flight=2", "rollout.max_new_tokens=24", "eval.num_tasks=2", "eval.samples_per_task=1",
        "progress=none", "replay.eta=1", f"rollout.pool={POOL}", "learner.on_pool=true",
        "learner.num_cpus=0.2", "rollout.num_cpus=0.1", "cluster.reward_num_cpus=0.05",
        "cluster.replay_num_cpus=0.05", *extra])


def _trained_once(run_dir: Path) -> list[str]:
    """The group ids the run's trained-groups log holds, checked unique."""
    ids = [g for line in (run_dir / "trained_groups.jsonl").read_text().splitlines()
           for g in json.loads(line)["group_ids"]]
    assert len(ids) == len(set(ids))
    return ids


def _loads_torch(pid: int) -> bool:
    return "libtorch" in Path(f"/proc/{pid}/maps").read_text()


@pytest.mark.slow
def test_two_runs_train_through_the_pools_one_learner(tiny_run_config, tiny_policy, engine_pools, tmp_path) -> None:
    import ray

    from cluster.driver import train
    from learner.lora import is_lora_checkpoint

    pool = _start_pool(engine_pools, tiny_policy[0])
    cfgs = [_run_cfg(tiny_run_config, tmp_path, "alpha", "train.steps=4", "learner.lora={rank: 4, alpha: 8}",
                     "learner.lr=1e-2", "learner.checkpoint_every=2"),
            _run_cfg(tiny_run_config, tmp_path, "beta", "train.steps=3", "learner.lora={rank: 8, alpha: 8}",
                     "learner.lr=5e-3", "env.seed=7", "learner.estimator={type: grpo, scale_by_std: false}")]
    results: dict[str, Any] = {}
    threads = [threading.Thread(target=lambda c=c: results.__setitem__(c.name, train(c, on_stage=lambda s: None)))
               for c in cfgs]
    for t in threads:
        t.start()
    # while it trains: alpha's learner is the pool's tenant actor, a process without torch
    placement = tmp_path / "alpha" / "placement.json"
    deadline = time.monotonic() + 300
    while not placement.exists() and time.monotonic() < deadline:
        time.sleep(0.5)
    (learner,) = json.loads(placement.read_text())["learner"]
    assert not _loads_torch(learner["pid"])
    for t in threads:
        t.join(timeout=900)
    alpha, beta = results["alpha"], results["beta"]
    assert (alpha.steps, beta.steps) == (4, 3) and not alpha.interrupted and not beta.interrupted
    for result, steps in ((alpha, 4), (beta, 3)):
        rows = [json.loads(line) for line in (result.run_dir / "metrics.jsonl").read_text().splitlines()]
        assert [r["version"] for r in rows] == list(range(1, steps + 1))  # its own versions
        assert all(r["samples"] == 4 and 1 <= r["pool/tenants_in_step"] <= 2 for r in rows)
        assert len(_trained_once(result.run_dir)) == 2 * steps
        assert result.checkpoint == str(result.run_dir / "checkpoints" / f"step_{steps:06d}")
        assert is_lora_checkpoint(result.checkpoint)  # its adapter, as turnrl eval and models merge read it
        assert json.loads((result.run_dir / "state.json").read_text())["step"] == steps
        assert set(result.eval) >= {"before", "after"}
    stats = ray.get(pool.stats.remote())
    assert stats["runs"] == [] and stats["learner"]["tenants"] == []  # both slots freed as the runs ended
    assert stats["learner"]["rounds"] <= 7


@pytest.mark.slow
def test_the_pools_learner_killed_mid_run_is_restarted_and_the_run_resumes(tiny_run_config, tiny_policy,
                                                                             engine_pools, tmp_path) -> None:
    import ray

    from cluster.driver import train
    from cluster.pool_learner import pool_learner_name
    from cluster.pool import POOL_NAMESPACE

    pool = _start_pool(engine_pools, tiny_policy[0])  # held: the pool lives as long as a handle to it does
    cfg = _run_cfg(tiny_run_config, tmp_path, "gamma", "train.steps=6", "learner.lora={rank: 4, alpha: 8}",
                   "learner.lr=1e-2", "learner.checkpoint_every=2")
    said: list[str] = []
    killed: list[int] = []

    def kill_after_step_3() -> None:
        metrics = tmp_path / "gamma" / "metrics.jsonl"
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            if metrics.exists() and len(metrics.read_text().splitlines()) >= 3:
                host = ray.get_actor(pool_learner_name(POOL), namespace=POOL_NAMESPACE)
                ray.kill(host, no_restart=False)  # a crash: Ray starts it again
                killed.append(len(metrics.read_text().splitlines()))
                return
            time.sleep(0.1)

    killer = threading.Thread(target=kill_after_step_3)
    killer.start()
    result = train(cfg, on_stage=said.append)
    killer.join()
    assert killed and result.steps == 6 and not result.interrupted
    restarted = [s for s in said if "restarted from step" in s]
    assert len(restarted) == 1 and "learner rank 0 died" in restarted[0]
    ids = _trained_once(result.run_dir)  # steps after the checkpoint were trained again, each group once
    assert len(ids) == 12
    assert json.loads((result.run_dir / "state.json").read_text())["step"] == 6
    assert ray.get(pool.stats.remote())["learner"]["tenants"] == []
