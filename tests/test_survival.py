"""Runs that survive the loss of a component: kill -9 actors' processes during a run; the run
finishes its step budget without a manual step and trains no group twice. The test prints
the time from each kill until the next training step was logged (docs/cluster.md reports
them: ``pytest -s tests/test_survival.py``)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from tests.kills import (actor, assert_replay_accounts, redis_server, run_killing, run_until_killed,
                         trained_once)
from tests.redis_fixture import requires_redis

pytestmark = pytest.mark.slow


def _config(tiny_run_config, tmp_path, name: str, extra: list[str]):
    return tiny_run_config([f"output_dir={tmp_path}", f"name={name}", "train.steps=4", "rollout.group_size=2",
                            "learner.batch_groups=2", "rollout.max_new_tokens=32", "eval.num_tasks=0",
                            "progress=none", "learner.num_cpus=0.5", *extra])


@requires_redis
def test_a_run_survives_kill_9_of_each_component_in_turn(tiny_run_config, tiny_policy, ray_cluster,
                                                         tmp_path) -> None:
    """One run with Redis replay and every restartable component (IG scorer, environment
    actor, two rollout actors, the engine, replay host, weight sync, checkpoints every
    step), killed one after another, a step apart:

    - the scorer's in-flight batch gets missing rewards (handled by ``rewards.on_missing``);
    - the environment actor's open episodes end with an error;
    - the reward front's groups are dropped by their producers (``rollout/dropped_groups``),
      their reservations released;
    - rollout actor 0's reservations come back through replay's ledger, its in-flight groups
      counted lost (``rollout/lost_groups``);
    - the engine is started again by Ray and loads the weight sync's newest version before it
      serves (one back on the initial weights would make every group stale: no step would
      follow), its requests in flight ending their episodes with an error;
    - redis-server is started again on its port from its append-only file (every write was
      fsynced before its reply) while every client re-sends what it was doing;
    - the replay host is started again by Ray (callers' calls wait and are re-sent); it takes
      over the embedded redis-server (a clean restart on the same port) and finds the groups
      there;
    - the weight sync is started again by Ray and the learner publishes its current weights
      to it at once (a push in flight is re-sent by Ray, its acknowledgement run once by Redis);
    - the learner restarts from its step checkpoint inside the run, versions moving forward.

    The run trains all its steps, every group that reached replay once or still held there at
    the end, and no group twice."""
    # Steps to spare after the last kill (the learner's, after step 9): the async run trains on
    # while a kill waits for its victim's new process and the next step (a rollout actor's
    # restart took 31 s on a machine loaded 5x over its 2 cores, and the run ran 5 steps ahead
    # of the kills with 12 steps), and a run that has ended restarts nothing. The engine,
    # replay host, weight sync and learner killed are the run's own (placement.json), not the first
    # process of that class found on the machine.
    steps = 16
    cfg = _config(tiny_run_config, tmp_path, "survive", [
        f"train.steps={steps}", "rewards.ig={}", "learner.estimator.type=igpo", "rewards.service.scorer_num_cpus=0.2",
        "rollout.env_actors.count=1", "rollout.env_actors.num_cpus=0.1", "rollout.num_workers=2",
        "rollout.num_cpus=0.1", "learner.checkpoint_every=1", "replay.type=redis", "replay.url=embedded"])
    kills = [actor("ModelScorer"), actor("EnvHost"), actor("RewardService"), actor("RolloutWorker", "rollout"),
             actor("EngineServer", "engine"), redis_server(Path(cfg.output_dir) / cfg.name),
             actor("ReplayHost", "replay"), actor("WeightSync", "weights"), actor("LearnerWorker", "learner")]
    result, recovery, run_dir, stages = run_killing(cfg, kills)
    print("".join(f"\n  {s}" for s in stages if "restarted" in s or "died" in s))
    for title, (restart_s, step_s) in recovery.items():
        print(f"  kill -9 {title}: a new process {restart_s:.1f}s later, the next step {step_s:.1f}s later")
    assert result.steps == steps and not result.interrupted
    trained = trained_once(run_dir, steps)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    versions = [r["version"] for r in rows]
    assert versions == sorted(set(versions)), "versions only move forward across the learner's restart"
    last = rows[-1]
    print(f"  dropped with the reward front: {last['rollout/dropped_groups']:.0f}; lost with rollout actor 0: "
          f"{last['rollout/lost_groups']:.0f}; reservations held at the end: {last['replay/running']:.0f}")
    assert last["replay/running"] <= 2 * cfg.rollout.groups_in_flight  # nothing leaked
    # The replay host's and the weight sync's deaths spent none of the learner's restarts.
    assert sum(s.startswith("learner rank") for s in stages) == 1
    assert any("learner rank 0 died" in s and "restarted from step" in s for s in stages)
    assert any("rollout worker 0 died" in s for s in stages)
    assert any(s.startswith("replay host died") and "restarted" in s for s in stages)
    assert any(s.startswith("weight sync died") and "published version" in s for s in stages)
    _rates_match_their_counts(rows, result.timings["train_s"])
    _replay_accounts_for_every_group(cfg, run_dir, trained)


def _rates_match_their_counts(rows: list[dict], train_s: float) -> None:
    """Each step's generation rate is the tokens it reports over the seconds it reports, and
    those seconds run back to back from the training start (not from the run's start, and
    not one second for the first step)."""
    for r in rows:
        assert r["throughput/interval_s"] > 0 and float(r["throughput/gen_tokens"]).is_integer()  # a count
        assert r["throughput/gen_tokens_per_s"] == pytest.approx(r["throughput/gen_tokens"] / r["throughput/interval_s"])
    assert sum(r["throughput/gen_tokens"] for r in rows) > 0  # the rollouts' tokens reached the rates
    # the first step's interval runs from the training start, so it holds the learner's whole first
    # step (its wait for a batch included): never a token second, never counted from a later point
    assert rows[0]["throughput/interval_s"] >= rows[0]["time/step_s"] - 0.05
    assert sum(r["throughput/interval_s"] for r in rows) <= train_s


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
    assert_replay_accounts(dataclasses.asdict(s), trained)


def test_a_dead_in_process_replay_host_ends_the_run_naming_it(tiny_run_config, tiny_policy, ray_cluster,
                                                              tmp_path) -> None:
    """In-process replay holds its groups in the host's process, so a killed host is not
    restarted: the run ends with an error naming the replay host, not as a learner death
    (which would spend a learner restart and then end the run with the wrong name)."""
    from cluster.survival import ComponentDied

    cfg = _config(tiny_run_config, tmp_path, "replay-dies", ["train.steps=6"])
    error, stages = run_until_killed(cfg, actor("ReplayHost", "replay"), after_step=1)
    print("".join(f"\n  {s}" for s in stages))
    assert isinstance(error, ComponentDied), error
    assert str(error).startswith("replay host died") and "replay.type=memory" in str(error)
    assert not any(s.startswith("learner rank") for s in stages)


def test_a_replay_host_dying_after_a_step_ends_the_run_naming_it(tiny_run_config, tiny_policy, ray_cluster,
                                                                 tmp_path) -> None:
    """The race the test above can lose: the replay host dies after the learner's step claimed
    its batch, and the driver's own call for the step's rates is the first to meet the death.
    That call ends the run as the host's vigil would (named, with the way on), never with a
    bare actor error."""
    import os
    import signal

    from cluster.actors import start_actors
    from cluster.supervision import Supervisor
    from cluster.survival import ComponentDied

    cfg = tiny_run_config([])
    actors = start_actors(cfg, tiny_policy[0], str(tmp_path), "rates")
    try:
        supervisor = Supervisor(cfg, actors, [], None, print)
        last: dict = {}
        assert supervisor.rates(last)["replay/ready"] == 0
        os.kill(json.loads((tmp_path / "placement.json").read_text())["replay"][0]["pid"], signal.SIGKILL)
        with pytest.raises(ComponentDied, match=r"^replay host died .*replay\.type=memory"):
            supervisor.rates(last)
    finally:
        actors.release()


def test_a_dead_broadcast_engine_ends_the_run_naming_it(tiny_run_config, tiny_policy, ray_cluster,
                                                        tmp_path) -> None:
    """An engine on the broadcast weight transport is not restarted (a new process cannot join
    the weight group its peers formed with the learner): killed, the run ends with an error
    naming that engine, not the learner's broadcast failure alone."""
    from cluster.survival import ComponentDied

    cfg = _config(tiny_run_config, tmp_path, "engine-dies", [
        "train.steps=8", "rollout.weights.transport=broadcast", "rollout.weights.timeout_s=60",
        "rollout.engine.count=2", "rollout.engine.num_cpus=0.1"])
    error, stages = run_until_killed(cfg, actor("EngineServer", "engine"), after_step=1)
    print("".join(f"\n  {s}" for s in stages), f"\n  error: {error}")
    assert isinstance(error, ComponentDied), error
    assert str(error).startswith("engine 0 died") and "broadcast" in str(error)
    assert not any(s.startswith("learner rank") for s in stages)


def test_replay_gives_back_a_dead_producers_reservations(tmp_path) -> None:
    from replay.config import ReplayConfig
    from replay.host import ReplayHost
    from rollout.trajectory import Group, Trajectory, Turn

    host = ReplayHost(ReplayConfig(), batch_groups=8, run_dir=str(tmp_path), run_id="ledger")

    def group(gid: str, producer: str) -> Group:
        traj = Trajectory(trajectory_id=gid, task_id="t", group_id=gid, prompt_ids=[1],
                          turns=[Turn(action_ids=[2], action_logprobs=[-1.0], policy_version=0)],
                          outcome=1.0, producer=producer)
        return Group(group_id=gid, task_id="t", trajectories=[traj])

    assert host.reserve(3, "a") == 3 and host.reserve(2, "b") == 2
    assert host.stats().running == 5
    assert host.put(group("g1", "a")).accepted  # uses one of a's reservations
    host.release(1, "a")  # a gave one back itself
    assert host.release_producer("a") == 1  # a died holding one more
    assert host.stats().running == 2 and host.release_producer("a") == 0
    assert host.release_producer("b") == 2 and host.stats().running == 0


@requires_redis
def test_a_re_sent_acknowledgement_runs_once(tmp_path) -> None:
    """Ray re-sends the calls a replay host was running when it died to the host it starts
    again: an acknowledgement that already ran returns its first reply (the host's operation
    id is made from the claim id), instead of failing the learner's step as an unknown claim,
    and counts nothing twice."""
    from replay.config import ReplayConfig
    from replay.host import ReplayHost
    from replay.redis_server import RedisServer
    from tests.redis_fixture import make_group

    with RedisServer(tmp_path / "redis") as server:
        cfg = ReplayConfig(type="redis", url=server.url)
        first = ReplayHost(cfg, batch_groups=1, run_dir=str(tmp_path), run_id="resent")
        assert first.put(make_group("g1")).accepted
        claim = first.claim(1)
        first.ack(claim.claim_id, 1)
        first.close()
        again = ReplayHost(cfg, batch_groups=1, run_dir=str(tmp_path), run_id="resent")  # same Redis
        again.ack(claim.claim_id, 1)  # the call Ray re-sent
        s = again.stats()
        again.close()
    assert (s.trained, s.version, s.claimed) == (1, 1, 0)


def test_a_restart_is_waited_for_as_long_as_the_limit_with_notes(ray_cluster) -> None:
    """The wait for a restarted actor sees its first call queued until the new process runs
    (not an error), notes the wait in the log every WAITING_NOTE_S, and gives up only past the
    limit (rollout.restart_timeout_s), as TimeoutError: here a 2 s limit gives up on a restart
    that takes 6 s, and a second wait of 60 s sees it back."""
    import time

    from cluster import survival
    from cluster.survival import wait_restarted

    class SlowToRestart:  # defined here: Ray ships it by value (a test module is no import path)
        """Starts at once the first time; a restarted process takes 6 s to construct (a node
        still joining, a busy machine)."""

        def __init__(self) -> None:
            import time

            import ray

            if ray.get_runtime_context().was_current_actor_reconstructed:
                time.sleep(6.0)

        def stats(self) -> int:
            return 1

    ray = ray_cluster
    slow = ray.remote(SlowToRestart).options(num_cpus=0, max_restarts=1).remote()
    assert ray.get(slow.stats.remote()) == 1
    t0 = time.monotonic()
    ray.kill(slow, no_restart=False)
    while True:  # the kill has landed once the old process no longer answers
        try:
            ray.get(slow.stats.remote(), timeout=0.5)
        except (ray.exceptions.ActorUnavailableError, ray.exceptions.GetTimeoutError):
            break
        time.sleep(0.1)
    notes: list[float] = []
    old, survival.WAITING_NOTE_S = survival.WAITING_NOTE_S, 1.0
    try:
        t1 = time.monotonic()
        with pytest.raises(TimeoutError, match="not restarted within 2s"):
            wait_restarted(slow, 2.0, waiting=notes.append)
        assert 2.0 <= time.monotonic() - t1 < 6.0 and notes
        wait_restarted(slow, 60.0, waiting=notes.append)
        assert 5.0 <= time.monotonic() - t0 < 60.0 and ray.get(slow.stats.remote()) == 1
    finally:
        survival.WAITING_NOTE_S = old
        ray.kill(slow)
    assert len(notes) >= 3  # one a second while it waited, across both waits
