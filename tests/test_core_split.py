"""``cluster.cpu_affinity``: a run that starts its own Ray puts Ray's daemons and the actors
without a core setting of their own (reward, environments, replay) on the cores named, while the
learner keeps its own; refused where it cannot hold (Ray already running, a joined cluster).
``cluster.services_cpu_affinity`` moves the run's services (replay host, weight sync, reward
front) off those cores."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ENV = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", "RAY_AUTH_MODE": "disabled"}
ENV.pop("RAY_ADDRESS", None)


@pytest.mark.slow
@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="a core split needs two cores")
def test_a_local_cluster_runs_its_glue_on_the_cores_named(tiny_policy, policy_cache, tmp_path) -> None:
    from tests.conftest import TINY_OVERRIDES

    overrides = [*TINY_OVERRIDES, f"policy.cache_dir={policy_cache}", f"output_dir={tmp_path}", "name=split",
                 "train.steps=1", "rollout.group_size=2", "learner.batch_groups=2", "rollout.max_new_tokens=16",
                 "eval.num_tasks=0", "progress=none", "rollout.env_actors.count=1", "rollout.env_actors.num_cpus=0.1", "cluster.reward_num_cpus=0.15",
                 "cluster.cpu_affinity=[0]",
                 "rollout.engine.cpu_affinity=[0]", "rollout.cpu_affinity=[0]", "learner.cpu_affinity=[1]"]
    done = subprocess.run([sys.executable, "-m", "cluster.cli", "train", *[a for o in overrides for a in ("--set", o)]],
                          env=ENV, capture_output=True, text=True, timeout=600, cwd=Path(__file__).parents[1])
    assert done.returncode == 0, done.stderr[-4000:]
    placement = json.loads((tmp_path / "split" / "placement.json").read_text())
    cpus = {role: [a["cpus"] for a in actors] for role, actors in placement.items()}
    assert cpus["learner"] == [[1]]
    assert all(c == [0] for role in ("replay", "weights", "reward", "env", "engine", "rollout") for c in cpus[role]), cpus
    assert cpus["env"], "the run had an environment actor to check"


@pytest.mark.slow
@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="a core split needs two cores")
def test_the_services_run_on_their_own_cores(tiny_policy, tiny_run_config, ray_cluster, tmp_path) -> None:
    """Replay host, weight sync and reward front on the services' cores; the environment
    actors (no core setting of their own) stay where the cluster put them."""
    from cluster.actors import start_actors

    cfg = tiny_run_config(["rollout.env_actors.count=1", "rollout.env_actors.num_cpus=0.1", "cluster.reward_num_cpus=0.15",
                           "cluster.services_cpu_affinity=[1]", "rollout.cpu_affinity=[0]"])
    actors = start_actors(cfg, tiny_policy[0], str(tmp_path), "services")
    try:
        placement = json.loads((tmp_path / "placement.json").read_text())
    finally:
        actors.release()
    cpus = {role: [a["cpus"] for a in found] for role, found in placement.items()}
    assert cpus["replay"] == cpus["weights"] == cpus["reward"] == [[1]], cpus
    assert cpus["rollout"] == [[0]] and cpus["env"] == [sorted(os.sched_getaffinity(0))], cpus


def test_cpu_affinity_is_refused_where_the_run_does_not_start_ray(tiny_run_config, ray_cluster) -> None:
    from cluster.actors import init_ray

    cfg = tiny_run_config(["cluster.cpu_affinity=[0]"])
    with pytest.raises(ValueError, match=r"cluster\.cpu_affinity=\[0\] pins a local cluster .* Ray already runs"):
        init_ray(cfg)
