"""The learner's advantage assembly (``learner.advantages.assemble``): failed scorers per
``on_missing``, the estimator's own drops in the loss mask, and live turns joined after the
scheduled ones. Pure numpy; no learner, Ray or model."""

from __future__ import annotations

import numpy as np
import pytest

from learner.advantages.assemble import batch_advantages, join_live
from learner.advantages.batch import AdvantageResult
from learner.advantages.config import A2TGPOConfig, IGPOConfig
from learner.losses.config import PPOLossConfig
from rewards.config import RewardsConfig
from rollout.trajectory import Trajectory, Turn


# -- on_missing --------------------------------------------------------------
def _hand_traj(tid: str, gid: str, ig: float | None, outcome: float) -> Trajectory:
    turns = [Turn(action_ids=[1], action_logprobs=[0.0], policy_version=0, rewards={"ig": ig}),
             Turn(action_ids=[2], action_logprobs=[0.0], policy_version=0, rewards={"outcome": outcome})]
    return Trajectory(trajectory_id=tid, task_id=gid, group_id=gid, prompt_ids=[0], turns=turns,
                      outcome=outcome)


@pytest.mark.parametrize("mode, expected_g1, mask_g1", [
    # Group 1: a (ig 0.5, outcome 1), b (ig None, outcome 0); IGPO joint pool, population std.
    # mask_turn: pool {0.5, 1, 0}, mean 0.5, std sqrt(0.5/3) = 0.408248 -> z = [0, 1.224745,
    #   -1.224745]; A_a = [0 + 1.224745, 1.224745], A_b = [masked 0, -1.224745].
    ("mask_turn", [1.224745, 1.224745, 0.0, -1.224745], [1, 1, 0, 1]),
    # zero: pool {0.5, 1, 0, 0}, mean 0.375, std sqrt(0.171875) = 0.414578 -> z = [0.301511,
    #   1.507557, -0.904534, -0.904534]; A_a = [1.809068, 1.507557], A_b = [-1.809068, -0.904534].
    ("zero", [1.809068, 1.507557, -1.809068, -0.904534], [1, 1, 1, 1]),
    # skip_group: the whole group is dropped.
    ("skip_group", [0.0, 0.0, 0.0, 0.0], [0, 0, 0, 0]),
])
def test_learner_on_missing_modes(mode, expected_g1, mask_g1) -> None:
    trajs = [_hand_traj("a", "g1", 0.5, 1.0), _hand_traj("b", "g1", None, 0.0),
             _hand_traj("c", "g2", 0.2, 1.0), _hand_traj("d", "g2", 0.4, 0.0)]
    res, mask = batch_advantages(trajs, IGPOConfig(), on_missing=mode)
    # Group 2 is complete, identical in every mode: pool {0.2, 1, 0.4, 0}, mean 0.4,
    # std sqrt(0.14) = 0.374166 -> z = [-0.534522, 1.603567, 0, -1.069045];
    # A_c = [1.069045, 1.603567], A_d = [-1.069045, -1.069045].
    expected = expected_g1 + [1.069045, 1.603567, -1.069045, -1.069045]
    np.testing.assert_allclose(res.advantages, expected, atol=1e-5)
    assert mask.astype(int).tolist() == mask_g1 + [1, 1, 1, 1]


def test_learner_on_missing_from_the_run_config() -> None:
    """The learner passes the run's ``rewards.trained_weights()`` and ``rewards.on_missing``."""
    trajs = [_hand_traj("a", "g1", 0.5, 1.0), _hand_traj("b", "g1", None, 0.0)]
    rewards = RewardsConfig(on_missing="skip_group")
    _, mask = batch_advantages(trajs, IGPOConfig(), rewards.trained_weights(), rewards.on_missing)
    assert not mask.any()
    with pytest.raises(ValueError, match="mask_turn, skip_group, zero"):
        batch_advantages(trajs, IGPOConfig(), on_missing="drop")



def test_learner_drops_turns_the_estimator_drops() -> None:
    """MatchTIR sums a rollout's turn rewards, so one failed match masks the whole rollout in
    the estimator; the learner's loss mask must follow it, not only the failed turn."""
    from learner.advantages.config import MatchTIRConfig

    def traj(tid: str, match: float | None, outcome: float) -> Trajectory:
        turns = [Turn(action_ids=[1], action_logprobs=[0.0], policy_version=0, rewards={"match": match}),
                 Turn(action_ids=[2], action_logprobs=[0.0], policy_version=0, rewards={"outcome": outcome})]
        return Trajectory(trajectory_id=tid, task_id="g", group_id="g", prompt_ids=[0], turns=turns,
                          outcome=outcome)

    trajs = [traj("a", 1.0, 1.0), traj("b", None, 0.0), traj("c", 0.5, 0.0)]
    res, mask = batch_advantages(trajs, MatchTIRConfig(), on_missing="mask_turn")
    assert mask.astype(int).tolist() == [1, 1, 0, 0, 1, 1]  # b's answer turn leaves the loss too
    assert res.advantages[2:4].tolist() == [0.0, 0.0]


def test_learner_trains_a_batch_whose_rollouts_all_answered_in_their_first_turn() -> None:
    """IG goes on turns 1..T-1 only, so a batch of one-turn rollouts carries no IG at all; the
    learner must train it on its outcomes, not stop the run for a missing ``ig`` column (seen
    in test_survival: a tiny policy answered at once in every rollout of a batch)."""
    trajs = [Trajectory(trajectory_id=tid, task_id="g", group_id="g", prompt_ids=[0], outcome=outcome,
                        turns=[Turn(action_ids=[1], action_logprobs=[0.0], policy_version=0)])
             for tid, outcome in (("a", 1.0), ("b", 0.0))]
    for estimator in (IGPOConfig(), A2TGPOConfig()):
        res, mask = batch_advantages(trajs, estimator, on_missing="mask_turn")
        # One pool {1, 0}: mean 0.5, population std 0.5 -> z = +-1, the final turns' advantages.
        np.testing.assert_allclose(res.advantages, [1.0, -1.0], atol=1e-5)
        assert mask.tolist() == [True, True]


def test_join_live_puts_live_turns_after_scheduled_with_the_loss_clips() -> None:
    sched = (AdvantageResult(np.array([1.0, -1.0]), np.array([0.1, 0.3]), np.array([0.2, 0.4])),
             np.array([True, False]))
    live = (AdvantageResult(np.array([0.5])), np.array([True]))
    res, mask = join_live(sched, live, PPOLossConfig(clip_low=0.15, clip_high=0.25))
    assert res.advantages.tolist() == [1.0, -1.0, 0.5]
    assert res.clip_low.tolist() == [0.1, 0.3, 0.15]
    assert res.clip_high.tolist() == [0.2, 0.4, 0.25]
    assert mask.tolist() == [True, False, True]
    # Without per-turn clips nothing of the loss is read (trajectory balance has no clips).
    res, _ = join_live((AdvantageResult(np.array([1.0])), np.array([True])), live, loss=None)
    assert res.clip_low is None and res.advantages.tolist() == [1.0, 0.5]
