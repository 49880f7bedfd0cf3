"""Environments in their own Ray actors: the same episodes as inline, and a crash fails only
the episodes the crashed actor held."""

from __future__ import annotations

import asyncio
import time

import pytest

pytestmark = pytest.mark.slow


class _NoPorts:
    """run_group needs no replay or reward."""


def _worker(cfg, policy: str, env_ports):
    from rollout.engines import local_client
    from rollout.worker import RolloutWorker

    return RolloutWorker(0, cfg.rollout, cfg.env, local_client(cfg.rollout.engine, policy), 0, _NoPorts(),
                         env_ports)


def test_episodes_run_in_env_actors_and_survive_a_crash(tiny_run_config, tiny_policy, ray_cluster) -> None:
    import ray

    from cluster.actors import start_env_hosts
    from envs.base import exact_match
    from rollout.engines.base import SamplingParams
    from rollout.ports import ActorEnvPort
    from rollout.remote_env import RemoteEnvironment

    policy, source = tiny_policy
    cfg = tiny_run_config(["rollout.env_actors.count=2", "rollout.env_actors.num_cpus=0.1",
                           "rollout.max_new_tokens=32"])
    hosts = start_env_hosts(cfg)
    ports = [ActorEnvPort(h) for h in hosts]
    worker = _worker(cfg, policy, ports)
    task = source.tasks("train")[0]
    params = SamplingParams(temperature=1.0, max_new_tokens=32)

    group = asyncio.run(worker.run_group(task, 4, params))
    turns = sum(len(t.turns) for t in group.trajectories)
    assert all(t.error is None and t.turns for t in group.trajectories)
    stats = ray.get([h.stats.remote() for h in hosts])
    assert [s["opened"] for s in stats] == [2, 2]  # round-robin over the two actors
    assert sum(s["steps"] for s in stats) == turns  # every turn stepped remotely
    deadline = time.monotonic() + 10  # closes are fire-and-forget: they land shortly after
    while sum(s["open"] for s in stats) and time.monotonic() < deadline:
        time.sleep(0.05)
        stats = ray.get([h.stats.remote() for h in hosts])
    assert sum(s["open"] for s in stats) == 0  # every episode closed
    for traj in group.trajectories:
        assert traj.success == exact_match(traj.answer, task.gold_answers)

    # The same scripted episode, remote and local, sees identical observations.
    demo = source.demonstration(task)
    async def play(env):
        obs = [await env.reset(task)]
        for msg in (m for m in demo if m["role"] == "assistant"):
            obs.append((await env.step(msg["content"])).observation)
        env.close()
        return [(o.anchor, o.messages) for o in obs]
    assert asyncio.run(play(RemoteEnvironment(ports[0]))) == asyncio.run(play(source.make_env()))

    # A crash: the actor is killed with an episode open; that episode fails, Ray restarts the
    # actor, and new episodes on it run normally.
    env = RemoteEnvironment(ports[0])
    asyncio.run(env.reset(task))
    ray.kill(hosts[0], no_restart=False)
    deadline = time.monotonic() + 60
    while True:  # the kill lands asynchronously: wait for the restarted incarnation
        assert time.monotonic() < deadline, "the environment actor did not restart"
        try:
            if ray.get(hosts[0].stats.remote(), timeout=30)["opened"] == 0:
                break
        except ray.exceptions.RayActorError:
            pass
        time.sleep(0.1)
    from envs.host import UnknownEpisodeError

    with pytest.raises(UnknownEpisodeError, match="not open"):
        asyncio.run(env.step(demo[0]["content"]))
    again = asyncio.run(worker.run_group(task, 4, params))
    assert all(t.error is None for t in again.trajectories)
    for h in hosts:
        ray.kill(h)
