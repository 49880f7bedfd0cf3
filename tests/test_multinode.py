"""A real two-node Ray cluster on this machine (a head, and a second raylet with its own
temp dir and a custom resource): `turnrl train` places the rollout actors on the second node
through `rollout.resources`, and the run trains. Then the second node dies (every process of
it, raylet included, kill -9) and a replacement joins with the same resource, as KubeRay
replaces a worker pod: the rollout actors are restarted there and the run finishes its steps,
training no group twice."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import pytest

from learner.deepspeed_setup import free_port
from tests.conftest import TINY_OVERRIDES
from tests.kills import assert_replay_accounts, trained_once
from tests.redis_fixture import requires_redis

pytestmark = [pytest.mark.slow, requires_redis]  # the run's replay is embedded Redis

RAY = str(Path(sys.executable).with_name("ray"))
ENV = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", "RAY_AUTH_MODE": "disabled"}
# The head (GCS) declares a silent node dead after ~3 missed 0.5 s health checks rather than
# Ray's default ~15-30 s; only the detection delay changes, not what happens after it.
HEAD_ENV = {**ENV, "RAY_health_check_period_ms": "500", "RAY_health_check_timeout_ms": "500",
            "RAY_health_check_failure_threshold": "3"}


def _ray_start(*args: str, env: dict[str, str] = ENV) -> None:
    subprocess.run([RAY, "start", "--node-ip-address=127.0.0.1", "--disable-usage-stats", *args],
                   env=env, check=True, capture_output=True, timeout=120)


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


class Nodes:
    """A head (3 CPUs, resource ``head_node``) and worker nodes (2 CPUs, ``rollout_node``), each
    with its own temp dir (short paths: Unix sockets)."""

    def __init__(self) -> None:
        self.dirs: list[str] = []
        self.address = f"127.0.0.1:{free_port()}"
        port = self.address.rsplit(":", 1)[1]
        _ray_start("--head", f"--port={port}", "--num-cpus=3", '--resources={"head_node": 10}',
                   f"--temp-dir={self._dir('rh')}", "--include-dashboard=false", env=HEAD_ENV)
        self.head = self._node_with("head_node")

    def _dir(self, prefix: str) -> str:
        self.dirs.append(tempfile.mkdtemp(prefix=prefix, dir="/tmp"))
        return self.dirs[-1]

    def add_worker(self) -> tuple[str, str]:
        """(node id, temp dir) of a new worker node."""
        before = self._alive()
        temp = self._dir("rw")
        _ray_start(f"--address={self.address}", "--num-cpus=2", '--resources={"rollout_node": 2}',
                   f"--temp-dir={temp}")
        (node,) = set(self._alive()) - set(before)
        return node, temp

    def _alive(self) -> list[str]:
        return [n for r, n in self._probe() if r == "any"]

    def _node_with(self, resource: str) -> str:
        return next(n for r, n in self._probe() if r == resource)

    def _probe(self) -> list[tuple[str, str]]:
        probe = ("import json, ray; ray.init(address=%r, logging_level='ERROR'); "
                 "print(json.dumps([[r, n['NodeID']] for n in ray.nodes() if n['Alive'] "
                 "for r in ['any', *n['Resources']]]))" % self.address)
        out = subprocess.run([sys.executable, "-c", probe], env=ENV, check=True, capture_output=True, text=True,
                             timeout=120).stdout
        # Ray may print its own lines on stdout too: the answer is the line that is a JSON list
        line = next(x for x in reversed(out.splitlines()) if x.startswith("[["))
        return [tuple(pair) for pair in json.loads(line)]

    def close(self) -> None:
        _kill_nodes(self.dirs)
        for d in self.dirs:
            shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def nodes():
    cluster = Nodes()
    try:
        yield cluster
    finally:
        cluster.close()


def _rows(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _rollout_nodes(run_dir: Path) -> list[str | None]:
    """Where placement.json (rewritten after every restart) says the rollout actors run."""
    try:
        return [a["node_id"] for a in json.loads((run_dir / "placement.json").read_text())["rollout"]]
    except (OSError, ValueError):  # being replaced right now
        return []


def _wait(predicate, timeout_s: float, what: str, proc: subprocess.Popen, log: Path) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert proc.poll() is None, f"the run ended while waiting for {what}: {log.read_text()[-4000:]}"
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def test_rollout_actors_run_on_their_node_and_survive_its_death(nodes, tiny_policy, policy_cache,
                                                               tmp_path) -> None:
    worker, worker_dir = nodes.add_worker()
    steps = 4
    overrides = [*TINY_OVERRIDES, f"policy.cache_dir={policy_cache}", f"output_dir={tmp_path}", "name=twonode",
                 f"cluster.address={nodes.address}", f"train.steps={steps}", "rollout.num_workers=2",
                 "rollout.num_cpus=0.5", "rollout.resources={rollout_node: 1}", "rollout.group_size=2",
                 "learner.batch_groups=2", "rollout.max_new_tokens=32", "eval.num_tasks=0", "progress=none",
                 "learner.num_cpus=0.5", "learner.resources={head_node: 1}",
                 "rollout.engine.resources={head_node: 1}", "cluster.service_resources={head_node: 0.01}",
                 "replay.type=redis", "replay.url=embedded"]
    run_dir = tmp_path / "twonode"
    out, err = tmp_path / "stdout.log", tmp_path / "stderr.log"  # files: a full pipe would stall the run
    with out.open("w") as stdout, err.open("w") as stderr:
        proc = subprocess.Popen([sys.executable, "-m", "cluster.cli", "train",
                                 *[a for o in overrides for a in ("--set", o)]],
                                env=ENV, stdout=stdout, stderr=stderr, cwd=Path(__file__).parents[1])
    try:
        _wait(lambda: len(_rows(run_dir)) >= 1, 600, "step 1", proc, err)
        assert _rollout_nodes(run_dir) == [worker] * 2
        placement = json.loads((run_dir / "placement.json").read_text())
        on_head = [a["node_id"] for role in ("learner", "engine", "replay", "reward") for a in placement[role]]
        assert set(on_head) == {nodes.head}
        killed_at, t_kill = len(_rows(run_dir)), time.monotonic()
        _kill_nodes([worker_dir])  # raylet, object store and rollout actors: the node is gone
        replacement, _ = nodes.add_worker()
        _wait(lambda: len(_rows(run_dir)) > killed_at, 300, "a step after the node died", proc, err)
        next_step_s = time.monotonic() - t_kill
        _wait(lambda: _rollout_nodes(run_dir) == [replacement] * 2, 300, "rollouts on the new node", proc, err)
        back_s = time.monotonic() - t_kill
        proc.wait(timeout=600)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err.read_text()[-4000:]
    stdout = out.read_text()
    print("".join(f"\n  {line}" for line in stdout.splitlines() if " died " in line))
    print(f"  worker node killed: next step {next_step_s:.1f}s later, both rollout actors running on the "
          f"replacement node {back_s:.1f}s later (its start included)")
    assert _rollout_nodes(run_dir) == [replacement] * 2
    assert [a["node_id"] for a in json.loads((run_dir / "placement.json").read_text())["learner"]] == [nodes.head]
    rows = _rows(run_dir)
    assert [r["step"] for r in rows] == list(range(1, steps + 1)) and all(r["samples"] == 4 for r in rows)
    result = json.loads((run_dir / "result.json").read_text())
    assert result["steps"] == steps
    assert "rollout worker 0 died" in stdout and "rollout worker 1 died" in stdout, stdout
    assert len(trained_once(run_dir, steps)) == steps * 2
    assert_replay_accounts(result["replay"], trained_once(run_dir, steps))
