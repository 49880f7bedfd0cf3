"""The order a run's actors are killed in: callers before what they call, replay last."""

from __future__ import annotations

from types import SimpleNamespace

from cluster.actors import RunActors


def test_callers_are_killed_before_what_they_call_and_replay_last() -> None:
    # The weight sync after the learner, whose publish may be calling it; replay goes last so
    # its host closes an embedded redis-server cleanly (release()).
    actors = RunActors(replay="replay", weights="weights", reward="reward", rollouts=["rollout0", "rollout1"],
                       learner=SimpleNamespace(ranks=["rank0", "rank1"]), envs=["env0"],
                       engines=["engine0", "engine1"], engine_client=None, gateway="gateway")
    order = actors.all()
    assert order == ["gateway", "rollout0", "rollout1", "engine0", "engine1", "rank0", "rank1",
                     "reward", "env0", "weights", "replay"]
    no_gateway = RunActors(replay="replay", weights="weights", reward="reward", rollouts=[],
                           learner=SimpleNamespace(ranks=["rank0"]), envs=[], engines=["engine0"],
                           engine_client=None)
    assert no_gateway.all() == ["engine0", "rank0", "reward", "weights", "replay"]
