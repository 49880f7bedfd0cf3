"""A real two-node Ray cluster on this machine (a head, and a second raylet with its own
temp dir and a custom resource): `turnrl train` places the rollout actors on the second node
through `rollout.resources`, and the run trains."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import psutil
import pytest

from learner.deepspeed_setup import free_port
from tests.conftest import TINY_OVERRIDES

pytestmark = pytest.mark.slow

RAY = str(Path(sys.executable).with_name("ray"))
ENV = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", "RAY_AUTH_MODE": "disabled"}


def _ray_start(*args: str) -> None:
    subprocess.run([RAY, "start", "--node-ip-address=127.0.0.1", "--disable-usage-stats", *args],
                   env=ENV, check=True, capture_output=True, timeout=120)


def _kill_nodes(temp_dirs: list[str]) -> None:
    """Every process of these nodes (never `ray stop`, which would end the suite's own cluster
    too): the ones naming a node's temp dir, and their children."""
    roots = [p for p in psutil.process_iter(["cmdline"])
             if any(d in arg for d in temp_dirs for arg in (p.info["cmdline"] or []))]
    procs = {q.pid: q for p in roots for q in [p, *p.children(recursive=True)]}
    for proc in procs.values():
        try:
            proc.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(list(procs.values()), timeout=15)


@pytest.fixture
def two_nodes():
    """(address, {resource: node id}): a head with 3 CPUs and a worker node with 2 CPUs and
    the custom resource ``rollout_node``, each with its own temp dir (short: Unix sockets)."""
    dirs = [tempfile.mkdtemp(prefix="rh", dir="/tmp"), tempfile.mkdtemp(prefix="rw", dir="/tmp")]
    port = free_port()
    address = f"127.0.0.1:{port}"
    try:
        _ray_start("--head", f"--port={port}", "--num-cpus=3", '--resources={"head_node": 1}',
                   f"--temp-dir={dirs[0]}", "--include-dashboard=false")
        _ray_start(f"--address={address}", "--num-cpus=2", '--resources={"rollout_node": 2}',
                   f"--temp-dir={dirs[1]}")
        probe = ("import json, ray; ray.init(address=%r, logging_level='ERROR'); "
                 "print(json.dumps({r: n['NodeID'] for n in ray.nodes() if n['Alive'] "
                 "for r in ('head_node', 'rollout_node') if r in n['Resources']}))" % address)
        nodes = json.loads(subprocess.run([sys.executable, "-c", probe], env=ENV, check=True, capture_output=True,
                                          text=True, timeout=120).stdout.strip().splitlines()[-1])
        assert set(nodes) == {"head_node", "rollout_node"} and nodes["head_node"] != nodes["rollout_node"]
        yield address, nodes
    finally:
        _kill_nodes(dirs)
        for d in dirs:
            shutil.rmtree(d, ignore_errors=True)


def test_rollout_actors_run_on_the_node_with_their_resource(two_nodes, tiny_policy, policy_cache, tmp_path) -> None:
    address, nodes = two_nodes
    overrides = [*TINY_OVERRIDES, f"policy.cache_dir={policy_cache}", f"output_dir={tmp_path}", "name=twonode",
                 f"cluster.address={address}", "train.steps=2", "rollout.num_workers=2", "rollout.num_cpus=0.5",
                 "rollout.resources={rollout_node: 1}", "rollout.group_size=2", "learner.batch_groups=2",
                 "rollout.max_new_tokens=32", "eval.num_tasks=0", "progress=none", "learner.num_cpus=0.5",
                 "learner.resources={head_node: 1}"]
    proc = subprocess.run([sys.executable, "-m", "cluster.cli", "train", *[a for o in overrides for a in ("--set", o)]],
                          env=ENV, capture_output=True, text=True, timeout=600, cwd=Path(__file__).parents[1])
    assert proc.returncode == 0, proc.stderr[-4000:]
    run_dir = tmp_path / "twonode"
    placement = json.loads((run_dir / "placement.json").read_text())
    assert [a["node_id"] for a in placement["rollout"]] == [nodes["rollout_node"]] * 2
    assert [a["node_id"] for a in placement["learner"]] == [nodes["head_node"]]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["version"] for r in rows] == [1, 2] and all(r["samples"] == 4 for r in rows)
    assert json.loads((run_dir / "result.json").read_text())["steps"] == 2
