"""Crash and resume, end to end: `turnrl train` on a real Redis with append-only persistence.

Mid-run, redis-server and the learner actor are killed with SIGKILL (the driver then stops,
reporting the learner's death). Redis restarts from its AOF, `turnrl train --resume` continues
the run from its last checkpoint, and the group ids prove exactly-once training: every group the
store ever accepted was trained exactly once by the final model's lineage, or is still ready.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import redis
from redis_fixture import requires_redis

from tests.kills import cmdline, own_processes

from replay.redis_server import RedisServer, free_port

pytestmark = [pytest.mark.slow, requires_redis]

# two steps between a checkpoint's first successor and the next checkpoint: the kill must land
# in that window, and tiny-model steps take well under a second
STEPS, CHECKPOINT_EVERY = 9, 4


def _turnrl(config: Path, *extra: str) -> subprocess.Popen[str]:
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", "RAY_AUTH_MODE": "disabled",
           "RAY_ADDRESS": ""}
    return subprocess.Popen([sys.executable, "-m", "cluster.cli", "train", str(config), *extra],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                            cwd=Path(__file__).resolve().parents[1])


def _trained(run_dir: Path) -> list[dict]:
    path = run_dir / "trained_groups.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.endswith("}")]


def _learner_process() -> psutil.Process | None:
    """The Ray worker hosting this run's learner actor (its process title names the class)."""
    for proc in own_processes():
        if "ray::LearnerWorker" in " ".join(cmdline(proc)):
            return proc
    return None


def _kill_learner_after_checkpoint(proc: subprocess.Popen[str], run_dir: Path) -> None:
    """SIGKILL the learner as soon as it trained a step past its last checkpoint. The process
    is looked up beforehand: scanning every process between seeing the step and the kill
    let the learner reach its next checkpoint first."""
    deadline, learner = time.monotonic() + 400, None
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"the run ended early:\n{proc.stdout.read()}"
        learner = learner or _learner_process()
        state = run_dir / "state.json"
        done = _trained(run_dir)
        if learner and state.exists() and done and done[-1]["step"] > json.loads(state.read_text())["step"]:
            try:
                learner.send_signal(signal.SIGKILL)
                return
            except psutil.NoSuchProcess:  # a stale match (another run's ended worker): look again
                learner = None
        time.sleep(0.02)
    raise AssertionError(f"the run never trained past its first checkpoint (learner process: {learner})")


def test_sigkill_redis_and_learner_then_resume_trains_every_group_once(
    tiny_run_config, tiny_policy, tmp_path: Path
) -> None:
    server = RedisServer(tmp_path / "redis", port=free_port(), appendonly=True, appendfsync="always")
    server.start()
    cfg = tiny_run_config([
        f"output_dir={tmp_path / 'runs'}", "name=crash", f"train.steps={STEPS}",
        "rollout.group_size=2", "learner.batch_groups=2", "rollout.groups_in_flight=2",
        "rollout.max_new_tokens=32", "eval.num_tasks=0", "progress=log",
        f"learner.checkpoint_every={CHECKPOINT_EVERY}", "replay.type=redis", f"replay.url={server.url}",
        "replay.eta=2", "learner.max_restarts=0",  # the crash-and-resume path (no in-job restart)
        "replay.retry_s=5",  # the first run ends with its Redis gone: its last calls give up sooner
    ])
    config = tmp_path / "run.yaml"
    config.write_text(cfg.model_dump_json(by_alias=True))  # JSON is YAML
    run_dir = tmp_path / "runs" / "crash"

    first = _turnrl(config)
    try:
        _kill_learner_after_checkpoint(first, run_dir)
        server.kill()  # SIGKILL, no shutdown save: only the AOF survives
        out, _ = first.communicate(timeout=180)
    finally:
        if first.poll() is None:
            first.kill()
    assert first.returncode != 0, out
    assert "learner" in out.lower(), out  # the driver names what died
    state = json.loads((run_dir / "state.json").read_text())
    before = _trained(run_dir)
    lost_steps = [row for row in before if row["step"] > state["step"]]
    assert lost_steps, "the kill should land after a checkpoint, before the next"

    server.start()  # same port and data directory: replays the AOF
    try:
        second = _turnrl(config, "--resume")
        out, _ = second.communicate(timeout=400)
        assert second.returncode == 0, out
        assert f"resumed at step {state['step']}" in out, out

        after = _trained(run_dir)
        assert [row["step"] for row in after] == list(range(1, STEPS + 1))
        assert [row["version"] for row in after] == list(range(1, STEPS + 1))
        trained = [gid for row in after for gid in row["group_ids"]]
        assert len(trained) == len(set(trained)), "a group was trained twice"
        # what the lost updates had trained was delivered again and trained by the resumed run
        assert {g for row in lost_steps for g in row["group_ids"]} <= set(trained)

        run_id = json.loads((run_dir / "run.json").read_text())["run_id"]
        client = redis.Redis.from_url(server.url)
        prefix = f"{cfg.replay.key_prefix}:{{{run_id}}}:"
        accepted = {g.decode() for g in client.smembers(prefix + "seen")}
        ready = [g.decode() for g in client.lrange(prefix + "ready", 0, -1)]
        assert set(trained).isdisjoint(ready)
        stats = {k.decode(): int(v) for k, v in client.hgetall(prefix + "stats").items()}
        evicted = {k.decode(): int(v) for k, v in client.hgetall(prefix + "evicted").items()}
        # The only way out untrained is a counted stale eviction (ids are not kept for those).
        assert set(trained) | set(ready) <= accepted
        assert len(accepted - set(trained) - set(ready)) == sum(evicted.values()), (stats, evicted)
        assert client.hlen(prefix + "claims") == 0 and client.hlen(prefix + "acked") == 0
        assert stats["trained"] == len(trained) and stats["version"] == STEPS
    finally:
        server.stop()
