"""Turn-level advantage estimators against hand-derived values, plus invariants and the tool.

Every expected number is derived in the comment above it from the semantics stated in
docs/advantages.md (the papers and the authors' code it cites); ``E`` is the default eps 1e-6
added to stds.
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from pydantic import TypeAdapter, ValidationError

from learner.advantages import (
    ESTIMATORS,
    TurnBatch,
    anchor_hash,
    compute_advantages,
    read_sources,
    required_fields,
    turn_batch_from_trajectories,
)
from learner.advantages.config import (
    A2TGPOConfig,
    EstimatorConfig,
    GiGPOConfig,
    GRPOConfig,
    HGPOConfig,
    IGPOConfig,
    MatchTIRConfig,
    PRMEstimatorConfig,
    RLOOConfig,
)
from learner.advantages.tool import main as tool_main

E = 1e-6
F = 1e-8  # IGPO's variance floor: std = sqrt(var + F) (the authors' corrected release)
E = 1e-6  # IGPO's epsilon on top: x / (sqrt(var + F) + E), their compute_grpo_outcome_advantage
NAN = float("nan")


def make(group, rollout, turn, outcome, mask=None, anchor=None, invalid=None, **rewards):
    """A TurnBatch from short lists; ``anchor`` as strings, hashed like production."""
    n = len(group)
    return TurnBatch(
        group_id=np.asarray(group), rollout_id=np.asarray(rollout),
        turn_index=np.asarray(turn), outcome=np.asarray(outcome, dtype=float),
        rewards={k: np.asarray(v, dtype=float) for k, v in rewards.items()},
        anchor=None if anchor is None else np.asarray([anchor_hash(a) for a in anchor]),
        mask=np.ones(n, bool) if mask is None else np.asarray(mask, bool),
        invalid=None if invalid is None else np.asarray(invalid, bool),
    )


def adv(batch, cfg):
    return compute_advantages(batch, cfg).advantages


def close(actual, expected, rel=1e-6):
    np.testing.assert_allclose(actual, expected, rtol=rel, atol=1e-9)


# ---------------------------------------------------------------- GRPO / Dr.GRPO / RLOO
# One group of four single-turn rollouts, outcomes 1, 0, 0, 1: mean 0.5.
FOUR = make([0, 0, 0, 0], [0, 1, 2, 3], [0, 0, 0, 0], [1, 0, 0, 1])


def test_grpo_unbiased_population_and_dr_grpo():
    # unbiased std = sqrt(4 * 0.25 / 3) = sqrt(1/3); A = +-0.5 / (sqrt(1/3) + E)
    a = 0.5 / (math.sqrt(1 / 3) + E)
    close(adv(FOUR, GRPOConfig()), [a, -a, -a, a])
    # population std = 0.5; A = +-0.5 / (0.5 + E)
    b = 0.5 / (0.5 + E)
    close(adv(FOUR, GRPOConfig(std="population")), [b, -b, -b, b])
    # Dr.GRPO: no division, A = R - mean = +-0.5
    close(adv(FOUR, GRPOConfig(scale_by_std=False)), [0.5, -0.5, -0.5, 0.5])


def test_grpo_pools_rollouts_not_turns_and_broadcasts_to_turns():
    # Rollout 0 has 3 turns (outcome 1), rollout 1 one turn (outcome 0). Per-rollout pool
    # [1, 0]: mean 0.5, unbiased std sqrt(0.5); pooling turns would give mean 0.75.
    b = make([0, 0, 0, 0], [0, 0, 0, 1], [0, 1, 2, 0], [1, 1, 1, 0])
    a = 0.5 / (math.sqrt(0.5) + E)
    close(adv(b, GRPOConfig()), [a, a, a, -a])


def test_grpo_statistics_over_step_rows():
    # verl-agent's multi-turn GRPO pools group statistics over step rows; ours pools rollouts
    # by default. Rollout a: 3 turns, outcome 1; rollout b: 1 turn, outcome 0.
    b = make([0] * 4, [0, 0, 0, 1], [0, 1, 2, 0], [1, 1, 1, 0])
    # per_rollout (default): pool [1, 0], unbiased std sqrt(.5) -> +-.5/(sqrt(.5)+E) = +-0.7071.
    e = 0.5 / (math.sqrt(0.5) + E)
    close(adv(b, GRPOConfig()), [e, e, e, -e])
    # per_step (verl-agent): pool of rows [1, 1, 1, 0]: mean .75, unbiased std
    # sqrt((3 * .0625 + .5625) / 3) = .5 -> a: .25/(.5+E) = 0.5, b: -.75/(.5+E) = -1.5.
    close(adv(b, GRPOConfig(stats="per_step")), [0.25 / (0.5 + E)] * 3 + [-0.75 / (0.5 + E)])
    # A masked row leaves the pool: a keeps 2 rows -> [1, 1, 0]: mean 2/3, std sqrt(1/3).
    m = make([0] * 4, [0, 0, 0, 1], [0, 1, 2, 0], [1, 1, 1, 0], mask=[True, False, True, True])
    s = math.sqrt(1 / 3) + E
    close(adv(m, GRPOConfig(stats="per_step")), [1 / 3 / s, 0.0, 1 / 3 / s, -2 / 3 / s])


def test_grpo_all_equal_and_singleton_give_exact_zero():
    # All-equal group (ties): numerator exactly 0, no NaN even though std = 0.
    b = make([0, 0, 0, 1], [0, 1, 2, 3], [0, 0, 0, 0], [0.7, 0.7, 0.7, 0.3])
    out = adv(b, GRPOConfig())
    assert np.all(out == 0.0)
    # Group 1 has one rollout: zero by default; raw = outcome over (1 + E) (verl's mean 0 std 1).
    out = adv(b, GRPOConfig(singleton="raw"))
    close(out, [0, 0, 0, 0.3 / (1 + E)])
    close(adv(b, GRPOConfig(singleton="raw", scale_by_std=False)), [0, 0, 0, 0.3])


def test_grpo_masked_turn_and_missing_outcome():
    # Rollout 2's outcome is missing: it leaves the pool, pool [1, 0] -> +-0.5/(sqrt(.5)+E).
    # Rollout 0's second turn is masked: 0 there, rollout still counted.
    b = make([0, 0, 0, 0], [0, 0, 1, 2], [0, 1, 0, 0], [1, 1, 0, NAN],
             mask=[True, False, True, True])
    res = compute_advantages(b, GRPOConfig())
    a = 0.5 / (math.sqrt(0.5) + E)
    close(res.advantages, [a, 0, -a, 0])
    assert res.mask.tolist() == [True, False, True, False]


def test_grpo_sums_to_zero_per_group():
    rng = np.random.default_rng(0)
    group, rollout, turn, outcome, mask = [], [], [], [], []
    for r in range(40):
        g, n_turns, out = r // 5, int(rng.integers(1, 5)), float(rng.normal())
        for t in range(n_turns):
            group.append(g), rollout.append(r), turn.append(t), outcome.append(out)
            mask.append(t > 0 or r % 7 != 0)  # some masked first turns
    b = make(group, rollout, turn, outcome, mask=mask)
    for cfg in (GRPOConfig(), GRPOConfig(scale_by_std=False), RLOOConfig()):
        res = compute_advantages(b, cfg)
        # One value per rollout that has a used turn; those values sum to 0 per group.
        _, first = np.unique(b.rollout_id[res.mask], return_index=True)
        values = res.advantages[res.mask][first]
        groups = b.group_id[res.mask][first]
        for g in np.unique(groups):
            assert abs(values[groups == g].sum()) < 1e-9


def test_rloo_hand_values():
    # Outcome 1: others [0, 0, 1] mean 1/3 -> 2/3. Outcome 0: others [1, 0, 1] -> -2/3.
    close(adv(FOUR, RLOOConfig()), [2 / 3, -2 / 3, -2 / 3, 2 / 3])
    # Ties and a singleton group: exact zeros; raw singleton keeps the outcome.
    b = make([0, 0, 1], [0, 1, 2], [0, 0, 0], [0.5, 0.5, 0.9])
    assert np.all(adv(b, RLOOConfig()) == 0.0)
    close(adv(b, RLOOConfig(singleton="raw")), [0, 0, 0.9])
    # A missing outcome leaves the pool: [1, 0, 0] -> 1 - 0 = 1, 0 - .5 = -.5.
    b = make([0, 0, 0, 0], [0, 1, 2, 3], [0, 0, 0, 0], [1, 0, 0, NAN])
    close(adv(b, RLOOConfig()), [1, -0.5, -0.5, 0])


# ---------------------------------------------------------------- IGPO
# Rollout a: IG 0.2, IG 0.4, answer (outcome 1). Rollout b: IG 0.0, answer (outcome 0).
# The final turns' own "ig" (99) must be ignored: the answer turn is scored by the outcome.
IG_BATCH = make([0] * 5, [0, 0, 0, 1, 1], [0, 1, 2, 0, 1], [1, 1, 1, 0, 0],
                ig=[0.2, 0.4, 99, 0.0, 99])


def test_igpo_joint_pool():
    # Joint pool [0.2, 0.4, 1, 0, 0]: mean 0.32, devs -.12 .08 .68 -.32 -.32,
    # population var = (.0144+.0064+.4624+.1024+.1024)/5 = .1376.
    s = math.sqrt(0.1376 + F) + E  # IGPO: sqrt(var + 1e-8) + 1e-6
    ra, rb = [-0.12 / s, 0.08 / s, 0.68 / s], [-0.32 / s, -0.32 / s]
    # gamma = 1: A_T = r_T, A_t = r_t + A_{t+1}.
    expected = [ra[0] + ra[1] + ra[2], ra[1] + ra[2], ra[2], rb[0] + rb[1], rb[1]]
    close(adv(IG_BATCH, IGPOConfig()), expected)


def test_igpo_separate_pools_gamma_and_weight():
    # IG pool [0.2, 0.4, 0.0]: mean 0.2, population std sqrt(.08/3) -> z 0, +q, -q.
    q = 0.2 / (math.sqrt(0.08 / 3 + F) + E)
    # Outcome pool [1, 0]: z +-0.5/(sqrt(0.25 + F) + E).
    o = 0.5 / (math.sqrt(0.25 + F) + E)
    # ig_weight 0.5 scales the IG z-scores; gamma 0.5 discounts.
    w, g = 0.5, 0.5
    a2 = o
    a1 = w * q + g * a2
    a0 = 0.0 + g * a1
    b1 = -o
    b0 = -w * q + g * b1
    cfg = IGPOConfig(normalisation="separate", gamma=g, ig_weight=w)
    close(adv(IG_BATCH, cfg), [a0, a1, a2, b0, b1])


def test_igpo_masked_and_missing_turns():
    # Turn (a, 1) masked; turn (b, 0) has a missing IG (NaN): both leave the pool and
    # contribute 0 to earlier sums. Pool [0.2, 1, 0]: mean 0.4, devs -.2 .6 -.4,
    # population var (.04 + .36 + .16) / 3.
    b = make([0] * 5, [0, 0, 0, 1, 1], [0, 1, 2, 0, 1], [1, 1, 1, 0, 0],
             mask=[True, False, True, True, True], ig=[0.2, 0.4, 99, NAN, 99])
    s = math.sqrt(0.56 / 3 + F) + E
    res = compute_advantages(b, IGPOConfig())
    close(res.advantages, [-0.2 / s + 0.6 / s, 0, 0.6 / s, 0, -0.4 / s])
    assert res.mask.tolist() == [True, False, True, False, True]


def test_igpo_all_equal_and_singleton():
    # All rewards 0: every pool is constant -> exact zeros, no NaN.
    b = make([0, 0, 0, 1], [0, 0, 1, 2], [0, 1, 0, 0], [0, 0, 0, 0.5], ig=[0, 0, 0, 0])
    assert np.all(adv(b, IGPOConfig()) == 0.0)
    # Group 1 is one single-turn rollout: pool of one -> 0 (std := 1 leaves x - x = 0).
    assert adv(b, IGPOConfig(normalisation="separate"))[3] == 0.0


def test_igpo_variance_floor_on_a_small_spread():
    # The IGPO authors' variance floor, std = sqrt(var + 1e-8), against the plain std on a pool
    # with a small spread. One group, two single-IG rollouts: IG 0.1 and 0.1001, answers 1 and 0,
    # separate pools. IG pool [0.1, 0.1001]: mean 0.10005, devs -+5e-5, population var 2.5e-9.
    #  authors (sqrt(var + 1e-8) + 1e-6): 5e-5 / (1.1180e-4 + 1e-6) = 0.4432 (the + 1e-6 is
    #    their epsilon: compute_grpo_outcome_advantage in their core_algos.py)
    #  plain sqrt(var) + 1e-6:            5e-5 / (5e-5 + 1e-6)     = 0.9804
    # Outcome pool [1, 0]: +-0.5/(sqrt(0.25 + 1e-8) + 1e-6); gamma 1 adds it to turn 0.
    b = make([0] * 4, [0, 0, 1, 1], [0, 1, 0, 1], [1, 1, 0, 0], ig=[0.1, NAN, 0.1001, NAN])
    o = 0.5 / (math.sqrt(0.25 + F) + E)
    ours = IGPOConfig(normalisation="separate")
    ig_z = compute_advantages(b, ours).advantages[[0, 2]] - np.array([o, -o])
    z = 5e-5 / (math.sqrt(2.5e-9 + F) + E)
    close(ig_z, [-z, z], rel=1e-6)
    assert round(z, 4) == 0.4432
    # The turn of IG 0.1001 gets +0.44 with the floor (default) and +0.98 without it.
    plain = IGPOConfig(normalisation="separate", var_floor=0.0)
    plain_z = compute_advantages(b, plain).advantages[[0, 2]] - np.array([0.5 / 0.500001] * 2) * [1, -1]
    close(plain_z, [-5e-5 / (5e-5 + 1e-6), 5e-5 / (5e-5 + 1e-6)], rel=1e-6)
    assert round(ig_z[1], 2) == 0.44 and round(plain_z[1], 2) == 0.98


# ---------------------------------------------------------------- A^2TGPO
# a: IG .3, IG .1, answer 1 | b: IG .1, answer 0 | c: IG .2, IG .5, answer 1
A2 = make([0] * 8, [0, 0, 0, 1, 1, 2, 2, 2], [0, 1, 2, 0, 1, 0, 1, 2], [1, 1, 1, 0, 0, 1, 1, 1],
          ig=[0.3, 0.1, NAN, 0.1, NAN, 0.2, 0.5, NAN])


def test_a2tgpo_turn_pools_sqrt_scaling_and_clip():
    # Turn-0 IG pool [.3, .1, .2]: mean .2, population std sqrt(.02/3) -> z +p, -p, 0.
    p = 0.1 / (math.sqrt(0.02 / 3) + E)
    # Turn-1 IG pool [.1 (a), .5 (c)] (b's turn 1 is its answer): z -u, +u, u = .2/(.2+E).
    u = 0.2 / (0.2 + E)
    # Outcome pool over the group [1, 0, 1]: mean 2/3, population std sqrt(2/9).
    s = math.sqrt(2 / 9) + E
    oa, ob = (1 / 3) / s, (-2 / 3) / s
    # gamma = 1, divided by sqrt(number of summed terms).
    expected = [(p - u + oa) / math.sqrt(3), (-u + oa) / math.sqrt(2), oa,
                (-p + ob) / math.sqrt(2), ob,
                (0 + u + oa) / math.sqrt(3), (u + oa) / math.sqrt(2), oa]
    res = compute_advantages(A2, A2TGPOConfig())
    close(res.advantages, expected)
    # Clip factor 1 + 0.3 * (2 * sigmoid(z) - 1) on each turn's normalised reward.
    z = np.array([p, -u, oa, -p, ob, 0.0, u, oa])
    factor = 1 + 0.3 * (2 / (1 + np.exp(-z)) - 1)
    close(res.clip_low, 0.2 * factor)
    close(res.clip_high, 0.2 * factor)
    assert res.clip_low[5] == pytest.approx(0.2)  # z = 0 keeps the base range


def test_a2tgpo_masked_turn_drops_from_pool_and_count():
    # Mask (c, 1): turn-1 IG pool is {a: .1} alone -> 0; c's turn 0 sums 2 terms (0 + oa).
    b = make(A2.group_id, A2.rollout_id, A2.turn_index, A2.outcome,
             mask=[True] * 6 + [False, True], ig=A2.rewards["ig"])
    p = 0.1 / (math.sqrt(0.02 / 3) + E)
    oa = (1 / 3) / (math.sqrt(2 / 9) + E)
    res = compute_advantages(b, A2TGPOConfig())
    close(res.advantages[[0, 1, 5, 6]], [(p + 0 + oa) / math.sqrt(3), oa / math.sqrt(2),
                                          oa / math.sqrt(2), 0.0])
    assert res.clip_low[6] == 0.2  # masked turn keeps the base range


def test_a2tgpo_outcome_in_turn_pool():
    # outcome_pool="turn": b's answer (0) joins the turn-1 pool [.1, 0, .5]: mean .2,
    # population std sqrt((.01 + .04 + .09) / 3); a's and c's answers (turn 2) form [1, 1]
    # -> constant -> 0.
    s = math.sqrt(0.14 / 3) + E
    res = compute_advantages(A2, A2TGPOConfig(outcome_pool="turn", sqrt_scaling=False))
    close(res.advantages[[1, 2, 4, 6]], [-0.1 / s, 0.0, -0.2 / s, 0.3 / s])


# ---------------------------------------------------------------- MatchTIR
# a: match .5, match 1, answer F1 1 | b: match 0, answer .5 | c: match 1, answer 0
MT = make([0] * 7, [0, 0, 0, 1, 1, 2, 2], [0, 1, 2, 0, 1, 0, 1], [1, 1, 1, .5, .5, 0, 0],
          match=[0.5, 1.0, NAN, 0.0, NAN, 1.0, NAN])


def test_matchtir_dual_level():
    # Trajectory sums [2.5, .5, 1]: mean 4/3, devs 7/6 -5/6 -1/3, unbiased var 13/12.
    st = math.sqrt(13 / 12) + E
    ta, tb, tc = (7 / 6) / st, (-5 / 6) / st, (-1 / 3) / st
    # G_t (gamma .9): a = [.5 + .9 * 1.9, 1 + .9 * 1, 1] = [2.21, 1.9, 1]; b = [.45, .5];
    # c = [1, 0]. Turn 0 pool [2.21, .45, 1]: mean 1.22, devs .99 -.77 -.22, unbiased var
    # 1.6214 / 2. Turn 1 pool [1.9, .5, 0]: mean .8, devs 1.1 -.3 -.8, var 1.94 / 2.
    s0, s1 = math.sqrt(1.6214 / 2) + E, math.sqrt(1.94 / 2) + E
    # Turn 2 pool {a: 1} is a singleton -> 0 (the default).
    expected = [(ta + 0.99 / s0) / 2, (ta + 1.1 / s1) / 2, (ta + 0) / 2,
                (tb - 0.77 / s0) / 2, (tb - 0.3 / s1) / 2,
                (tc - 0.22 / s0) / 2, (tc - 0.8 / s1) / 2]
    close(adv(MT, MatchTIRConfig()), expected)
    # The authors' code leaves a singleton's G_t un-normalised: G = 1 over (1 + E).
    assert adv(MT, MatchTIRConfig(singleton="raw"))[2] == pytest.approx((ta + 1 / (1 + E)) / 2)


def test_matchtir_missing_reward_masks_rollout():
    # b's match is missing: its sums are undefined, so all of b is masked. Left: a, c.
    # Sums [2.5, 1] -> +-.75 / (unbiased std .75*sqrt2 + E). Turn 0 G [2.21, 1] ->
    # +-.605 / (.605*sqrt2 + E); turn 1 G [1.9, 0] -> +-.95/(.95*sqrt2 + E).
    b = make(MT.group_id, MT.rollout_id, MT.turn_index, MT.outcome,
             match=[0.5, 1.0, NAN, NAN, NAN, 1.0, NAN])
    t = 0.75 / (0.75 * math.sqrt(2) + E)
    z0 = 0.605 / (0.605 * math.sqrt(2) + E)
    z1 = 0.95 / (0.95 * math.sqrt(2) + E)
    res = compute_advantages(b, MatchTIRConfig())
    close(res.advantages, [(t + z0) / 2, (t + z1) / 2, t / 2, 0, 0, (-t - z0) / 2,
                           (-t - z1) / 2])
    assert res.mask.tolist() == [True, True, True, False, False, True, True]


# ---------------------------------------------------------------- GiGPO
# a: anchors s0 s1 s2, env 0 0 1 | b: anchors s0 s0 s1 (looped back), env 0 0 0
GI_ANCHORS = ["s0", "s1", "s2", "s0", "s0", "s1"]
GI = make([0] * 6, [0, 0, 0, 1, 1, 1], [0, 1, 2, 0, 1, 2], [1, 1, 1, 0, 0, 0],
          anchor=GI_ANCHORS, env=[0, 0, 1, 0, 0, 0])


def test_gigpo_episode_plus_step():
    # Returns R (gamma .95): a = [.9025, .95, 1], b = [0, 0, 0]. Episode returns [1, 0]:
    # unbiased std sqrt(.5) -> A_E = +-e, e = .5/(sqrt(.5)+E).
    e = 0.5 / (math.sqrt(0.5) + E)
    # Step pool s0 = [.9025, 0, 0] = [x, 0, 0]: devs 2x/3 -x/3 -x/3, unbiased std x/sqrt3
    # -> z = 2/sqrt3, -1/sqrt3 (each over std + E). s1 = [.95, 0] -> +-.475/(.475 sqrt2 + E).
    # s2 = {a: 1} seen once -> 0.
    x = 0.9025
    sd0 = x / math.sqrt(3) + E
    z1 = 0.475 / (0.475 * math.sqrt(2) + E)
    expected = [e + (2 * x / 3) / sd0, e + z1, e, -e - (x / 3) / sd0, -e - (x / 3) / sd0,
                -e - z1]
    close(adv(GI, GiGPOConfig()), expected)
    # step_weight scales A_S only; mean_norm subtracts means only.
    close(adv(GI, GiGPOConfig(step_weight=0.0)), [e, e, e, -e, -e, -e])
    close(adv(GI, GiGPOConfig(mode="mean_norm")),
          [0.5 + 2 * x / 3, 0.5 + 0.475, 0.5, -0.5 - x / 3, -0.5 - x / 3, -0.5 - 0.475])


def test_gigpo_invalid_penalty_and_per_step_stats():
    # b's turn 1 invalid: env b = [0, -.1, 0] -> R_b = [-.095, -.1, 0], return -.1.
    b = make(GI.group_id, GI.rollout_id, GI.turn_index, GI.outcome,
             anchor=["s0", "s1", "s2", "s0", "s0", "s1"],
             invalid=[False, False, False, False, True, False], env=GI.rewards["env"])
    # Episode [1, -.1]: mean .45, devs +-.55, unbiased std .55 sqrt2 -> +-e.
    e = 0.55 / (0.55 * math.sqrt(2) + E)
    out = adv(b, GiGPOConfig(step_weight=0.0))
    close(out, [e, e, e, -e, -e, -e])
    # per_step: a with 3 steps (return 1) vs c with 1 step (return 0): pool [1, 1, 1, 0]:
    # mean .75, unbiased std .5 -> a: .25/(.5+E), c: -.75/(.5+E). per_rollout gives +-e2.
    c = make([0] * 4, [0, 0, 0, 1], [0, 1, 2, 0], [1, 1, 1, 0],
             anchor=["p", "q", "r", "s"], env=[0, 0, 1, 0])
    close(adv(c, GiGPOConfig(episode_stats="per_step")),
          [0.25 / (0.5 + E)] * 3 + [-0.75 / (0.5 + E)])
    e2 = 0.5 / (math.sqrt(0.5) + E)
    close(adv(c, GiGPOConfig()), [e2] * 3 + [-e2])


def test_gigpo_invalid_penalty_on_the_step_row():
    # verl-agent subtracts the invalid-action penalty from the invalid step's own row only.
    # GI with b's turn 1 invalid (penalty .1), mean_norm for plain numbers.
    b = make(GI.group_id, GI.rollout_id, GI.turn_index, GI.outcome,
             anchor=["s0", "s1", "s2", "s0", "s0", "s1"],
             invalid=[False, False, False, False, True, False], env=GI.rewards["env"])
    # env_reward (default): env b = [0, -.1, 0] -> R_b = [-.095, -.1, 0], episode [1, -.1],
    # mean .45 -> A_E a +.55, b -.55 on every row. Step pools: s0 {.9025, -.095, -.1} mean
    # .235833; s1 {.95, 0} mean .475; s2 {a: 1} alone -> 0. The penalty reached b0 (-.095).
    m0 = (0.9025 - 0.095 - 0.1) / 3
    close(adv(b, GiGPOConfig(mode="mean_norm")),
          [0.55 + 0.9025 - m0, 0.55 + 0.475, 0.55,
           -0.55 + (-0.095 - m0), -0.55 + (-0.1 - m0), -0.55 - 0.475])
    # step_row (verl-agent): returns stay unpenalised, a = [.9025, .95, 1], b = [0, 0, 0],
    # episodes [1, 0] mean .5; only b1's row loses .1, from its episode score (-.5 - .1) and
    # its step return (0 - .1). s0 {.9025, 0, -.1}: mean .2675; s1 {.95, 0}: mean .475.
    row = GiGPOConfig(mode="mean_norm", invalid_penalty_on="step_row")
    close(adv(b, row), [0.5 + 0.635, 0.5 + 0.475, 0.5, -0.5 - 0.2675, -0.6 - 0.3675, -0.975])
    # mean_std_norm, episode level only: the rollouts' stats (returns [1, 0], unbiased std
    # sqrt(.5)) standardise b1's score 0 - .1: -(.5 + .1) / (sqrt(.5) + E).
    s = math.sqrt(0.5) + E
    row_std = GiGPOConfig(step_weight=0.0, invalid_penalty_on="step_row")
    close(adv(b, row_std), [0.5 / s] * 3 + [-0.5 / s, -0.6 / s, -0.5 / s])
    # per_step stats put the penalised row into the pool: rows [1, 1, 1, 0, -.1, 0],
    # mean .48333, unbiased var (3 * .51667^2 + 2 * .48333^2 + .58333^2) / 5.
    rows = np.array([1, 1, 1, 0, -0.1, 0])
    sd = rows.std(ddof=1) + E
    per_step = GiGPOConfig(step_weight=0.0, invalid_penalty_on="step_row", episode_stats="per_step")
    close(adv(b, per_step), (rows - rows.mean()) / sd)


def test_gigpo_equals_grpo_when_no_anchor_repeats():
    rng = np.random.default_rng(1)
    group, rollout, turn, env, outcome, anchor = [], [], [], [], [], []
    for r in range(24):
        n = int(rng.integers(1, 5))
        final = float(rng.integers(0, 3)) / 2  # ties on purpose
        for t in range(n):
            group.append(r // 6), rollout.append(r), turn.append(t)
            env.append(final if t == n - 1 else 0.0)  # env sum == outcome
            outcome.append(final)
            anchor.append(f"obs-{r}-{t}")  # never repeats
    b = make(group, rollout, turn, outcome, anchor=anchor, env=env)
    for mode, scale in (("mean_std_norm", True), ("mean_norm", False)):
        gi = adv(b, GiGPOConfig(mode=mode, step_weight=1.0))
        close(gi, adv(b, GRPOConfig(scale_by_std=scale)), rel=1e-12)


def test_gigpo_missing_env_reward_masks_rollout():
    b = make(GI.group_id, GI.rollout_id, GI.turn_index, GI.outcome,
             anchor=["s0", "s1", "s2", "s0", "s0", "s1"], env=[0, 0, 1, 0, NAN, 0])
    # Only rollout a is left: a singleton group (A_E = 0) and every anchor seen once.
    res = compute_advantages(b, GiGPOConfig())
    assert np.all(res.advantages == 0.0)
    assert res.mask.tolist() == [True, True, True, False, False, False]


# ---------------------------------------------------------------- HGPO
# a: s0 s1 s2, env 0 0 1 | b: s0 s1 s2, env 0 0 0 | c: s0 s3 s2, env 0 0 1
HG = make([0] * 9, [0, 0, 0, 1, 1, 1, 2, 2, 2], [0, 1, 2] * 3, [1, 1, 1, 0, 0, 0, 1, 1, 1],
          anchor=["s0", "s1", "s2", "s0", "s1", "s2", "s0", "s3", "s2"],
          env=[0, 0, 1, 0, 0, 0, 0, 0, 1])


def test_hgpo_levels_and_weights():
    # R: a = c = [.9025, .95, 1], b = [0, 0, 0]. Population std.
    # Level 1: s0 {a,b,c} [x, 0, x] -> z = +h, -2h with h = (x/3)/(x*sqrt2/3 + E);
    #   s1 {a,b} [.95, 0] -> +-v; s3 {c} alone; s2 {a,b,c} [1, 0, 1] -> +k, -2k.
    x = 0.9025
    h = (x / 3) / (x * math.sqrt(2) / 3 + E)
    v = 0.475 / (0.475 + E)
    k = (1 / 3) / (math.sqrt(2) / 3 + E)
    # Level 2: (s0,s1) {a,b} -> +-v; (s1,s2) {a,b} [1, 0] -> +-o, o = .5/(.5+E);
    #   (s0,s3), (s3,s2) singletons. Level 3: (s0,s1,s2) {a,b} -> +-o; c alone.
    o = 0.5 / (0.5 + E)
    # Paper weights k^1 = 1:2:3 over the non-zero levels.
    expected = [h, (v + 2 * v) / 3, (k + 2 * o + 3 * o) / 6,
                -2 * h, (-v - 2 * v) / 3, (-2 * k - 2 * o - 3 * o) / 6,
                h, 0.0, k]
    close(adv(HG, HGPOConfig()), expected)
    # Code indexing (k+1)^1 = 2:3:4.
    close(adv(HG, HGPOConfig(weight_indexing="code"))[[1, 2]],
          [(2 * v + 3 * v) / 5, (2 * k + 3 * o + 4 * o) / 9])


def test_hgpo_with_no_history_is_gigpo_step_level():
    # K = 0 keeps only level 1 = GiGPO's (group, anchor) pools.
    gi = adv(GI, GiGPOConfig(std="population", step_weight=1.0)) - \
        adv(GI, GiGPOConfig(std="population", step_weight=0.0))
    close(adv(GI, HGPOConfig(history=0)), gi, rel=1e-12)


def test_hgpo_masked_turn_leaves_pools_keeps_history():
    # Mask (b, 1): level-1 s1 and level-2 (s0,s1) lose b -> a.t1 has no 2+ pool -> 0.
    # b's turn 2 still has history (s0,s1,s2), so level 3 {a,b} survives.
    b = make(HG.group_id, HG.rollout_id, HG.turn_index, HG.outcome,
             mask=[True] * 4 + [False] + [True] * 4,
             anchor=["s0", "s1", "s2", "s0", "s1", "s2", "s0", "s3", "s2"],
             env=HG.rewards["env"])
    k = (1 / 3) / (math.sqrt(2) / 3 + E)
    o = 0.5 / (0.5 + E)
    out = adv(b, HGPOConfig())
    assert out[1] == 0.0 and out[4] == 0.0
    close(out[[2, 5]], [(k + 2 * o + 3 * o) / 6, (-2 * k - 2 * o - 3 * o) / 6])


# ------------------------------------- configured sources: every reward source reaches the loss
# a: turns 0, 1 (PRM .8, .6), outcome 1 | b: turns 0, 1 (PRM .2, .4), outcome 0
PRM_BATCH = make([0] * 4, [0, 0, 1, 1], [0, 1, 0, 1], [1, 1, 0, 0], prm=[0.8, 0.6, 0.2, 0.4])


def test_prm_estimator_process_rewards_with_outcome_at_the_end():
    # PRM pool (all turns of the group) [.8, .6, .2, .4]: mean .5, devs .3 .1 -.3 -.1,
    # population var (.09 + .01 + .09 + .01) / 4 = .05 -> z = dev / (sqrt(.05) + E).
    s = math.sqrt(0.05) + E
    # Outcome pool [1, 0] on the final turns: +-.5 / (.5 + E).
    o = 0.5 / (0.5 + E)
    # gamma 1: A_1 = z_1 + o, A_0 = z_0 + A_1.
    a1, b1 = 0.1 / s + o, -0.1 / s - o
    close(adv(PRM_BATCH, PRMEstimatorConfig()), [0.3 / s + a1, a1, -0.3 / s + b1, b1])
    # Weights: prm .5 and outcome 2 scale their normalised terms.
    w = compute_advantages(PRM_BATCH, PRMEstimatorConfig(), {"outcome": 2.0, "prm": 0.5})
    a1, b1 = 0.05 / s + 2 * o, -0.05 / s - 2 * o
    close(w.advantages, [0.15 / s + a1, a1, -0.15 / s + b1, b1])
    # A missing PRM on a non-final turn masks that turn; a final turn keeps its outcome.
    m = make([0] * 4, [0, 0, 1, 1], [0, 1, 0, 1], [1, 1, 0, 0], prm=[NAN, NAN, 0.2, 0.4])
    res = compute_advantages(m, PRMEstimatorConfig())
    # PRM pool [.2, .4]: +-.1/(.1 + E); a: turn 0 masked, turn 1 = o; b: -o + .1/(.1+E) ...
    q = 0.1 / (0.1 + E)
    close(res.advantages, [0.0, o, -q + q - o, q - o])
    assert res.mask.tolist() == [False, True, True, True]


def test_igpo_adds_configured_prm_normalised_in_its_own_pool():
    # a: IG .2 then answer (outcome 1); b: IG 0 then answer (outcome 0); PRM on every turn.
    b = make([0] * 4, [0, 0, 1, 1], [0, 1, 0, 1], [1, 1, 0, 0], ig=[0.2, NAN, 0.0, NAN],
             prm=[0.9, 0.5, 0.1, 0.5])
    # Joint IG/outcome pool [.2, 1, 0, 0]: mean .3, devs -.1 .7 -.3 -.3, population var .17.
    s = math.sqrt(0.17 + F) + E
    # PRM pool [.9, .5, .1, .5]: mean .5, devs .4 0 -.4 0, population var .08, weight .5.
    p = math.sqrt(0.08 + F) + E
    ra = [-0.1 / s + 0.5 * 0.4 / p, 0.7 / s]
    rb = [-0.3 / s - 0.5 * 0.4 / p, -0.3 / s]
    expected = [ra[0] + ra[1], ra[1], rb[0] + rb[1], rb[1]]
    run = {"outcome": 1.0, "prm": 0.5}
    close(compute_advantages(b, IGPOConfig(), run).advantages, expected)
    # Without the run's weights IGPO reads IG and the outcome only, as before.
    close(adv(b, IGPOConfig()), [-0.1 / s + 0.7 / s, 0.7 / s, -0.6 / s, -0.3 / s])
    # The rewards weight of IG multiplies its normalised value, with ig_weight.
    half = compute_advantages(b, IGPOConfig(ig_weight=0.5), {"ig": 0.5}).advantages
    close(half, [-0.025 / s + 0.7 / s, 0.7 / s, -0.075 / s - 0.3 / s, -0.3 / s])


def test_sum_first_estimators_add_weighted_raw_turn_sources():
    # MatchTIR with match weighted 2 and a PRM configured equals MatchTIR on the raw turn
    # reward 2 * match + prm (outcome + prm on the final turn): the sources are summed raw.
    prm = np.array([0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7])
    mt = make(MT.group_id, MT.rollout_id, MT.turn_index, MT.outcome,
              match=MT.rewards["match"], prm=prm)
    final = np.array([False, False, True, False, True, False, True])
    merged = np.where(final, MT.outcome, 2 * MT.rewards["match"]) + prm
    flat = make(MT.group_id, MT.rollout_id, MT.turn_index, MT.outcome, match=merged)
    close(compute_advantages(mt, MatchTIRConfig(), {"match": 2.0, "prm": 1.0}).advantages,
          adv(flat, MatchTIRConfig(final_turn_reward="match")), rel=1e-12)
    # GiGPO: env weighted .5 plus a PRM equals GiGPO on env' = .5 env + prm.
    gp = np.array([0.3, 0.1, 0.0, 0.2, 0.2, 0.5])
    gi = make(GI.group_id, GI.rollout_id, GI.turn_index, GI.outcome, anchor=GI_ANCHORS,
              env=GI.rewards["env"], prm=gp)
    plain = make(GI.group_id, GI.rollout_id, GI.turn_index, GI.outcome, anchor=GI_ANCHORS,
                 env=0.5 * GI.rewards["env"] + gp)
    close(compute_advantages(gi, GiGPOConfig(), {"env": 0.5, "prm": 1.0}).advantages,
          adv(plain, GiGPOConfig()), rel=1e-12)


def test_outcome_estimators_read_only_the_outcome_weighted():
    # GRPO and RLOO read no turn source: a configured PRM is not theirs to read (the run
    # fails at start, cluster/requirements.py); the outcome weight scales the advantage.
    assert read_sources(GRPOConfig(), {"outcome": 1.0, "prm": 1.0}) == {"outcome"}
    assert read_sources(IGPOConfig(), {"outcome": 1.0, "prm": 1.0}) == {"outcome", "ig", "prm"}
    assert read_sources(GiGPOConfig(), {"outcome": 1.0, "match": 1.0}) == {"env", "match"}
    close(compute_advantages(FOUR, GRPOConfig(), {"outcome": 2.0}).advantages,
          2 * adv(FOUR, GRPOConfig()))
    close(compute_advantages(FOUR, RLOOConfig(), {"outcome": 2.0}).advantages,
          2 * adv(FOUR, RLOOConfig()))
    # A configured source the batch lacks is named.
    with pytest.raises(ValueError, match="prm"):
        compute_advantages(IG_BATCH, IGPOConfig(), {"prm": 1.0})


# ---------------------------------------------------------------- wiring and configs
def test_registry_required_fields_and_missing_field_errors():
    configs = [GRPOConfig(), RLOOConfig(), IGPOConfig(), A2TGPOConfig(), MatchTIRConfig(),
               PRMEstimatorConfig(), GiGPOConfig(), HGPOConfig()]
    assert sorted(ESTIMATORS) == sorted(c.type for c in configs)
    assert required_fields(GRPOConfig()) == {"outcome"}
    assert required_fields(IGPOConfig()) == {"outcome", "ig"}
    assert required_fields(MatchTIRConfig()) == {"match", "outcome"}
    assert required_fields(GiGPOConfig()) == {"env", "anchor"}
    assert required_fields(HGPOConfig()) == {"env", "anchor"}
    assert required_fields(PRMEstimatorConfig()) == {"outcome", "prm"}
    with pytest.raises(ValueError, match="anchor"):
        compute_advantages(make([0], [0], [0], [1], env=[1]), GiGPOConfig())
    with pytest.raises(ValueError, match="ig"):
        compute_advantages(FOUR, IGPOConfig())


def test_every_estimator_gives_exact_zeros_on_all_equal_rewards():
    # Three identical 2-turn rollouts: every pool at every level is constant, so every
    # estimator must return exactly 0.0 (the documented all-equal result), never NaN.
    n = 6
    b = make([0] * n, [0, 0, 1, 1, 2, 2], [0, 1] * 3, [0.5] * n, anchor=["s0", "s1"] * 3,
             ig=[0.5] * n, match=[0.5] * n, env=[0.5] * n, prm=[0.5] * n)
    for name in ESTIMATORS:
        res = compute_advantages(b, TypeAdapter(EstimatorConfig).validate_python({"type": name}))
        assert np.all(res.advantages == 0.0), name


def test_empty_batch_gives_empty_result():
    e = np.zeros(0)
    b = make(e, e, e, e, anchor=[], ig=e, env=e, match=e, prm=e)
    for name in ESTIMATORS:
        cfg = TypeAdapter(EstimatorConfig).validate_python({"type": name})
        assert compute_advantages(b, cfg).advantages.shape == (0,)


def test_configs_discriminate_and_forbid_unknown_keys():
    ta = TypeAdapter(EstimatorConfig)
    assert isinstance(ta.validate_python({"type": "hgpo", "history": 4}), HGPOConfig)
    with pytest.raises(ValidationError):
        ta.validate_python({"type": "grpo", "gama": 1.0})
    with pytest.raises(ValidationError):
        ta.validate_python({"type": "nope"})


def test_turn_batch_validates_structure():
    with pytest.raises(ValueError, match="same \\(rollout_id, turn_index\\)"):
        make([0, 0], [0, 0], [0, 0], [1, 1])
    with pytest.raises(ValueError, match="outcome"):
        make([0, 0], [0, 0], [0, 1], [1, 0])
    with pytest.raises(ValueError, match="spans two group_ids"):
        make([0, 1], [0, 0], [0, 1], [1, 1])


def _trajectories():
    from rollout.trajectory import Trajectory, Turn

    def turn(anchor, rewards, invalid=False):
        return Turn(action_ids=[1], action_logprobs=[-0.1], policy_version=0,
                    anchor_observation=anchor, rewards=rewards, invalid_action=invalid)

    return [
        Trajectory(trajectory_id="t-a", task_id="q", group_id="g1", prompt_ids=[0],
                   outcome=1.0, turns=[turn("s0", {"env": 0.0}), turn("s1", {"env": 1.0})]),
        Trajectory(trajectory_id="t-b", task_id="q", group_id="g1", prompt_ids=[0],
                   outcome=0.0, turns=[turn("s0", {"env": None}, invalid=True)]),
    ]


def test_turn_batch_from_trajectories():
    b = turn_batch_from_trajectories(_trajectories())
    assert b.group_id.tolist() == [0, 0, 0] and b.rollout_id.tolist() == [0, 0, 1]
    assert b.turn_index.tolist() == [0, 1, 0] and b.outcome.tolist() == [1, 1, 0]
    assert b.anchor[0] == b.anchor[2] == anchor_hash("s0") != b.anchor[1]
    assert np.isnan(b.rewards["env"][2]) and b.invalid.tolist() == [False, False, True]
    assert anchor_hash("s0") == anchor_hash("s0") and -2**63 <= anchor_hash("x") < 2**63


# ---------------------------------------------------------------- the tool
def _run_tool(args, capsys):
    code = tool_main(args)
    out, err = capsys.readouterr()
    return code, [json.loads(line) for line in out.splitlines()], err


def test_tool_flat_jsonl(tmp_path, capsys):
    path = tmp_path / "turns.jsonl"
    rows = [{"group_id": "q1", "rollout_id": "r1", "turn_index": 0, "outcome": 1,
             "rewards": {"ig": 0.2}}, {"group_id": "q1", "rollout_id": "r1", "turn_index": 1,
             "outcome": 1, "rewards": {"ig": None}},
            {"group_id": "q1", "rollout_id": "r2", "turn_index": 0, "outcome": 0}]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    code, out, _ = _run_tool(["--estimator", "grpo", "--set", "scale_by_std=false",
                              "--input", str(path)], capsys)
    assert code == 0
    assert [(o["rollout_id"], o["turn_index"], o["advantage"]) for o in out] == \
        [("r1", 0, 0.5), ("r1", 1, 0.5), ("r2", 0, -0.5)]
    code, out, _ = _run_tool(["--estimator", "a2tgpo", "--input", str(path)], capsys)
    assert code == 0 and {"clip_low", "clip_high"} <= set(out[0])


def test_tool_trajectory_jsonl(tmp_path, capsys):
    from rollout.trajectory import write_jsonl

    path = tmp_path / "trajs.jsonl"
    write_jsonl(path, _trajectories())
    code, out, _ = _run_tool(["--estimator", "grpo", "--input", str(path)], capsys)
    a = 0.5 / (math.sqrt(0.5) + E)
    assert code == 0 and [o["rollout_id"] for o in out] == ["t-a", "t-a", "t-b"]
    close([o["advantage"] for o in out], [a, a, -a])


def test_tool_errors_name_the_key(tmp_path, capsys):
    path = tmp_path / "turns.jsonl"
    path.write_text(json.dumps({"group_id": 1, "rollout_id": 1, "turn_index": 0}) + "\n")
    code, _, err = _run_tool(["--estimator", "grpo", "--set", "gama=1", "--input",
                              str(path)], capsys)
    assert code == 2 and "gama" in err and "scale_by_std" in err
    code, _, err = _run_tool(["--estimator", "grpo", "--set", "eps=-1", "--input",
                              str(path)], capsys)
    assert code == 2 and "eps" in err
    code, _, err = _run_tool(["--estimator", "bogus", "--input", str(path)], capsys)
    assert code == 2 and "grpo" in err
    code, _, err = _run_tool(["--estimator", "igpo", "--input", str(path)], capsys)
    assert code == 2 and "ig" in err
    path.write_text(json.dumps({"group_id": 1, "turn_index": 0}) + "\n")
    code, _, err = _run_tool(["--estimator", "grpo", "--input", str(path)], capsys)
    assert code == 2 and "rollout_id" in err and ":1:" in err
