"""The reward service: per-source turn rewards, IG weight following with versions, missing
rewards flagged (never zero) and masked by the learner, and the service end to end on Ray
with a real replay actor and weight sync.

Episodes are real: gold and wrong actions played through the built-in search-QA environment
with the tiny policy's tokenizer (``rewards.prm_data.play_labelled``).
"""

from __future__ import annotations

import asyncio
import math
from rollout.engines.transport import InMemoryWeights, ObjectStoreWeights
from types import SimpleNamespace

import pytest
import torch

from rewards.combine import combined_turn_reward
from rewards.config import IGConfig, MatchConfig, RewardsConfig
from rewards.service import LocalScorer, RewardService
from rollout.trajectory import Group, Trajectory, Turn


# -- fixtures -----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def policy(tiny_policy):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path, source = tiny_policy
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa")
    return SimpleNamespace(path=path, source=source, tok=AutoTokenizer.from_pretrained(path),
                           model=model.eval())


def episode(policy, task_index: int, wrong_first: bool, version: int = 0) -> Trajectory:
    """Gold actions of train task ``task_index``; optionally another task's first action
    first (a wrong search). Every turn carries ``version`` as its behaviour version."""
    from rewards.prm_data import gold_actions, play_labelled

    tasks = policy.source.tasks("train")
    gold = gold_actions(policy.source, tasks[task_index])
    wrong = gold_actions(policy.source, tasks[task_index + 1])[0]
    actions = ([wrong] if wrong_first else []) + gold
    traj = asyncio.run(play_labelled(policy.source, tasks[task_index], policy.tok, actions))
    for turn in traj.turns:
        turn.policy_version = version
    return traj


def group_of(gid: str, *trajs: Trajectory) -> Group:
    for t in trajs:
        t.group_id = gid
    return Group(group_id=gid, task_id=trajs[0].task_id, trajectories=list(trajs))


def perturbed_state(model, seed: int) -> dict[str, torch.Tensor]:
    """The weights plus noise; tied tensors (embedding and lm_head) stay tied."""
    g = torch.Generator().manual_seed(seed)
    noisy: dict[int, torch.Tensor] = {}
    return {k: noisy.setdefault(v.data_ptr(), v + 0.05 * torch.randn(v.shape, generator=g))
            for k, v in model.state_dict().items()}


def direct_ig(policy, traj: Trajectory, state: dict | None = None) -> list[float]:
    """IG from a separate IGScorer on a model holding ``state`` (per-turn reference path)."""
    from rewards.ig_scorer import IGScorer

    model = policy.model
    if state is not None:
        model = type(model)(model.config)
        model.load_state_dict(state, strict=False)
    [res] = IGScorer(model.eval(), policy.tok, IGConfig()).score_per_turn([traj])
    return res.ig


# -- in-process service --------------------------------------------------------------------
def test_outcome_match_ig_each_in_its_own_slot(policy) -> None:
    from rewards.scorer import ModelScorer

    cfg = RewardsConfig(ig=IGConfig(), match=MatchConfig(), weights={"ig": 0.5})
    scorer = ModelScorer(cfg, policy.path)
    service = RewardService(cfg, None, [LocalScorer(scorer)])
    good, wrong = episode(policy, 1, False), episode(policy, 1, True)
    asyncio.run(service.score_group(group_of("g", good, wrong)))
    # MatchTIR, hungarian: the wrong search has similarity 2/3 to each gold search (same tool
    # and key, wrong value) but the gold searches take the gold calls (1.0 each), leaving it
    # unmatched -> 0. The answer turn gets the answer F1 (1.0: the gold answer).
    n_gold = len(good.turns) - 1
    assert [t.rewards["match"] for t in wrong.turns] == [0.0] + [1.0] * n_gold + [1.0]
    assert [t.rewards["match"] for t in good.turns] == [1.0] * (n_gold + 1)
    assert [t.rewards.get("outcome") for t in good.turns] == [None] * n_gold + [1.0]
    for traj in (good, wrong):
        ig = [t.rewards["ig"] for t in traj.turns[:-1]]
        assert ig == pytest.approx(direct_ig(policy, traj), abs=1e-5)
        assert "ig" not in traj.turns[-1].rewards  # the answer turn gets the outcome instead
        assert all(t.reward_versions["ig"] == 0 for t in traj.turns[:-1])
        # the sources configured for training (env is always scored, but only trained on
        # where an estimator reads it or rewards.weights names it)
        assert traj.reward_errors == []
    # the sources configured for training (env is always scored, but only trained on where an
    # estimator reads it or rewards.weights names it): what the learner is built with
    assert cfg.trained_weights() == {"outcome": 1.0, "ig": 0.5, "match": 1.0}
    assert all(t.metadata == {} for t in (good, wrong))  # nothing stamped in the data
    # env stays what the environment said (0 per search, 1 for the correct answer)
    assert [t.rewards["env"] for t in good.turns] == [0.0] * n_gold + [1.0]
    turn0 = wrong.turns[0].rewards  # weighted sum: 1*env (no weight: 1) + 0.5*ig + 1*match
    assert combined_turn_reward(turn0, cfg.trained_weights()) == pytest.approx(
        turn0["env"] + 0.5 * turn0["ig"] + turn0["match"])
    stats = service.stats()
    assert stats["batches"] == 1 and stats["mean_batch_trajectories"] == 2.0
    assert stats["missing"] == {} and stats["ig_version_mismatch"] == 0


def test_ig_follows_pushed_weights_and_counts_mismatch(policy) -> None:
    from rewards.scorer import ModelScorer

    cfg = RewardsConfig(ig=IGConfig(keep_versions=2))
    scorer = ModelScorer(cfg, policy.path)
    service = RewardService(cfg, None, [LocalScorer(scorer)])
    v1 = perturbed_state(policy.model, 1)
    assert scorer.update_weights(1, InMemoryWeights(v1)) == 1  # the weight sync's push
    old, new = episode(policy, 2, True, version=0), episode(policy, 2, True, version=1)

    async def both() -> None:  # one batch: each trajectory gets its own behaviour version
        await asyncio.gather(service.score_group(group_of("a", old)),
                             service.score_group(group_of("b", new)))

    asyncio.run(both())
    assert [t.rewards["ig"] for t in old.turns[:-1]] == pytest.approx(direct_ig(policy, old), abs=1e-5)
    assert [t.rewards["ig"] for t in new.turns[:-1]] == pytest.approx(direct_ig(policy, new, v1), abs=1e-5)
    assert {t.reward_versions["ig"] for t in new.turns[:-1]} == {1}
    assert service.stats()["ig_version_mismatch"] == 0
    # v2 published: keep_versions=2 holds {1, 2}; a v0 group is scored with the newest (v2)
    # and each of its IG values counts as a version mismatch.
    v2 = perturbed_state(policy.model, 2)
    assert scorer.update_weights(2, InMemoryWeights(v2)) == 2
    stale = episode(policy, 2, True, version=0)
    asyncio.run(service.score_group(group_of("c", stale)))
    assert {t.reward_versions["ig"] for t in stale.turns[:-1]} == {2}
    assert [t.rewards["ig"] for t in stale.turns[:-1]] == pytest.approx(
        direct_ig(policy, stale, v2), abs=1e-5)
    assert service.stats()["ig_version_mismatch"] == len(stale.turns) - 1
    assert scorer.stats()["ig_held_versions"] == [1, 2]


def test_scorer_errors_are_missing_and_flagged(policy) -> None:
    from rewards.scorer import ModelScorer

    cfg = RewardsConfig(ig=IGConfig(), match=MatchConfig())
    service = RewardService(cfg, None, [LocalScorer(ModelScorer(cfg, policy.path))])
    bad = episode(policy, 3, True)
    bad.gold_answers, bad.gold_tool_calls = None, None  # a task without gold labels
    good = episode(policy, 3, False)
    asyncio.run(service.score_group(group_of("g", bad, good)))
    assert all(t.rewards["ig"] is None for t in bad.turns[:-1])
    assert all(t.rewards["match"] is None for t in bad.turns)
    errors = {f["source"]: f["error"] for f in bad.reward_errors}
    assert errors == {"ig": "IG needs gold_answers", "match": "no gold_tool_calls to match against"}
    assert all(isinstance(t.rewards["ig"], float) for t in good.turns[:-1])  # the batch survived
    assert service.stats()["missing"] == {"ig": len(bad.turns) - 1, "match": len(bad.turns)}


# -- end to end on Ray ---------------------------------------------------------------------
def _a_failed_start_gives_back_what_it_started(ray, tiny_run_config, policy_path: str, tmp_path) -> None:
    """A run's start that fails after replay and the engine began (the scorers cannot fit)
    stops them again: a caller that carries on (the run service, a bench) keeps its CPUs."""
    import time

    from cluster.actors import start_actors

    free = ray.available_resources().get("CPU", 0.0)
    with pytest.raises(RuntimeError, match="needs 2.25 Ray CPUs with 1 reward scorer"):
        start_actors(tiny_run_config(["rewards.ig={}"]), policy_path, str(tmp_path / "failed"), "failed-start")

    def named_replay_alive() -> bool:
        try:
            ray.get_actor("replay-failed-start")
        except ValueError:
            return False
        return True

    deadline = time.monotonic() + 60  # once Ray has reaped the killed processes
    while (named_replay_alive() or ray.available_resources().get("CPU", 0.0) < free) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not named_replay_alive()
    assert ray.available_resources().get("CPU", 0.0) == pytest.approx(free)  # the engine's too


@pytest.mark.slow
def test_service_on_ray_scores_and_puts_into_replay(ray_cluster, policy, tiny_run_config, tmp_path) -> None:
    ray = ray_cluster
    from cluster.reward_service import check_cpus, start_reward_service, start_scorers
    from cluster.weight_sync import ActorWeightTarget
    from learner.weights import WeightSync
    from replay.host import ACTOR_THREADS, ReplayHost
    from rewards.prm import ProcessRewardModel, prm_input

    cfg = tiny_run_config([
        "rewards.ig={}", "rewards.match={}", "rewards.service.batch_wait_ms=100",
        "learner.num_cpus=0.5",  # the run's actors plus the scorer must fit the 2-CPU cluster
        f"rewards.prm={{type: model, path: '{policy.path}', transform: clip, clip_shift: 0.5}}"])
    with pytest.raises(RuntimeError, match="needs 2.25 Ray CPUs with 1 reward scorer"):
        check_cpus(tiny_run_config(), 1, 0)  # 0.5 rollout + 1 learner + 0.25 x 3 > 2
    _a_failed_start_gives_back_what_it_started(ray, tiny_run_config, policy.path, tmp_path)
    replay = ray.remote(ReplayHost).options(num_cpus=0.1, max_concurrency=ACTOR_THREADS).remote(cfg.replay, 1, str(tmp_path), "t")
    scorers = start_scorers(cfg, policy.path)
    reward = start_reward_service(cfg, replay, policy.path, scorers=scorers)
    sync = ray.remote(WeightSync).options(num_cpus=0).remote([], [ActorWeightTarget(s, True) for s in scorers])
    g1 = group_of("g1", episode(policy, 4, False), episode(policy, 4, True))
    g2 = group_of("g2", episode(policy, 5, True), episode(policy, 5, False))
    puts = ray.get([reward.submit.remote(g1), reward.submit.remote(g2)])
    assert [p.status for p in puts] == ["accepted", "accepted"]
    v1 = perturbed_state(policy.model, 3)
    ray.get(sync.publish.remote(1, ObjectStoreWeights.put(v1)))  # pushed to the scorers
    g3 = group_of("g3", episode(policy, 6, True, version=1))
    assert ray.get(reward.submit.remote(g3)).status == "accepted"
    stats = ray.get(reward.stats.remote())
    claim = ray.get(replay.claim.remote(3))
    got = {t.trajectory_id: t for g in claim.groups for t in g.trajectories}
    prm = ProcessRewardModel.load(policy.path, "reward_tokens")
    for sent in [*g1.trajectories, *g2.trajectories, *g3.trajectories]:
        traj = got[sent.trajectory_id]
        version = sent.turns[0].policy_version
        assert [t.rewards["ig"] for t in traj.turns[:-1]] == pytest.approx(
            direct_ig(policy, sent, v1 if version else None), abs=1e-5)
        assert {t.reward_versions["ig"] for t in traj.turns[:-1]} == {version}
        # PRM read at each turn's end, then clip: min(P(good) - 0.5, 0).
        [raw] = prm.score([prm_input(sent)], 16384)
        assert [t.rewards["prm"] for t in traj.turns] == pytest.approx(
            [min(p - 0.5, 0.0) for p in raw], abs=1e-5)
        assert traj.reward_details["prm"]["raw"] == pytest.approx(raw, abs=1e-5)
        assert traj.turns[-1].rewards["outcome"] == 1.0 and traj.turns[-1].rewards["match"] == 1.0
    assert stats["put"] == {"accepted": 3} and stats["ig_version_mismatch"] == 0
    assert stats["missing"] == {} and stats["queue_groups"] == 0 and stats["batches"] <= 3
    assert not math.isnan(stats["mean_batch_trajectories"])
    for actor in (reward, replay, sync, *scorers):
        ray.kill(actor)


def test_close_stops_the_background_tasks() -> None:
    # A loop stopped with the batcher and judge loops pending leaves coroutines that complain
    # when they are collected (the gateway's loop, a test harness's).
    async def run() -> tuple[int, int, float | None]:
        service = RewardService(RewardsConfig(), None)
        traj = Trajectory(trajectory_id="t", task_id="t", group_id="g", prompt_ids=[1], outcome=None,
                          turns=[Turn(action_ids=[2], action_logprobs=[-0.5], policy_version=0)])
        scored = await service.score_group(Group(group_id="g", task_id="t", trajectories=[traj]))
        running = len(asyncio.all_tasks()) - 1  # all but this one
        await service.close()
        return running, len(asyncio.all_tasks()) - 1, scored.trajectories[0].turns[0].rewards.get("ig")

    running, left, ig = asyncio.run(run())
    assert running == 1 and left == 0 and ig is None  # the batcher ran; close ended it
