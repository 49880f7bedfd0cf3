"""MatchTIR matching rewards: hand-derived similarities, assignments and Sinkhorn plans."""

from __future__ import annotations

import math

import numpy as np
import pytest

from envs.toolcalls import ToolCall
from rewards.config import MatchConfig
from rewards.matching import (
    call_rewards,
    call_similarity,
    greedy_assignment,
    hungarian_assignment,
    match_turn_rewards,
    similarity_matrix,
    sinkhorn_plan,
)


def tc(name: str, **arguments: object) -> ToolCall:
    return ToolCall(name=name, arguments=arguments)


GOLD = tc("search", query="paris", k=3)


@pytest.mark.parametrize(
    ("pred", "expected"),
    [
        # same keys (J = 1), query equal, k differs (V = 1): (1 + 1 + 1) / (2 + 2) = 0.75
        (tc("Search", query="paris", k=5), 0.75),
        # keys {query} vs {query, k}: J = 1/2, V = 1: (1 + 0.5 + 1) / 4 = 0.625
        (tc("search", query="paris"), 0.625),
        # keys {query, lang, k} vs {query, k}: J = 2/3, V = 2: (1 + 2/3 + 2) / 4 = 11/12
        (tc("search", query="paris", lang="en", k=3), 11 / 12),
        (tc("lookup", query="paris", k=3), 0.0),  # name differs
    ],
)
def test_call_similarity(pred: ToolCall, expected: float) -> None:
    assert call_similarity(pred, GOLD) == pytest.approx(expected)


def test_similarity_without_gold_params() -> None:
    # no params on either side: J = 1, V = 0: (1 + 1) / (2 + 0) = 1
    assert call_similarity(tc("now"), tc("now")) == 1.0
    # pred adds a param: J = 0/1 = 0: (1 + 0) / 2 = 0.5
    assert call_similarity(tc("now", tz="utc"), tc("now")) == 0.5


# Gold g0 = f(a=1,b=1,c=1) (denominator 2+3 = 5), g1 = f(a=1) (denominator 3).
# p0 = f(a=1,b=1,c=1): S(p0,g0) = (1+1+3)/5 = 1; S(p0,g1) = (1 + 1/3 + 1)/3 = 7/9.
# p1 = f(a=2,b=1,c=1): S(p1,g0) = (1+1+2)/5 = 0.8; S(p1,g1) = (1 + 1/3 + 0)/3 = 4/9.
# Greedy takes (p0,g0) = 1 first, leaving p1 -> g1 = 4/9 (total 1.444). The optimum is
# p0 -> g1, p1 -> g0 = 7/9 + 0.8 = 1.578.
G0, G1 = tc("f", a=1, b=1, c=1), tc("f", a=1)
P0, P1 = tc("f", a=1, b=1, c=1), tc("f", a=2, b=1, c=1)


def test_hungarian_beats_greedy() -> None:
    sim = similarity_matrix([P0, P1], [G0, G1])
    np.testing.assert_allclose(sim, [[1.0, 7 / 9], [0.8, 4 / 9]])
    assert hungarian_assignment(sim) == [1, 0]
    assert greedy_assignment(sim) == [0, 1]


def test_match_turn_rewards_hard_modes() -> None:
    turns = [[P0], [P1], []]  # final turn answered with F1 0.5
    hung = match_turn_rewards(turns, [G0, G1], mode="hungarian", answer_f1=0.5)
    assert hung == pytest.approx([7 / 9, 0.8, 0.5])
    greedy = match_turn_rewards(turns, [G0, G1], mode="greedy", answer_f1=0.5)
    assert greedy == pytest.approx([1.0, 4 / 9, 0.5])


def test_greedy_tie_break_and_unmatched_penalty() -> None:
    # Two identical calls, one gold: both score 1. The authors' stable sort on the score alone
    # keeps the prediction-major listing order among ties, so p0 (the lowest prediction index)
    # takes the gold: [1, 0] with no penalty. (Sorting on (s, i, j) descending gave [0, 1].)
    g = tc("f", a=1)
    assert call_rewards([g, g], [g], mode="greedy") == [1.0, 0.0]
    # With a penalty the unmatched p1 scores -0.5; the turn holds both calls: (1 - 0.5) / 2.
    assert call_rewards([g, g], [g], mode="greedy", unmatched_penalty=-0.5) == [1.0, -0.5]
    out = match_turn_rewards([[g, g]], [g], mode="greedy", answer_f1=None, unmatched_penalty=-0.5)
    assert out == pytest.approx([0.25])


def test_greedy_tie_break_lowest_gold_index_next() -> None:
    # One prediction, two identical golds: both pairs score 1; the lowest gold index (0) wins,
    # so gold 1 stays free for a second prediction. preds [g, g] x golds [g, g]: p0-g0, p1-g1
    # (all four pairs tie at 1; listing order p0g0, p0g1, p1g0, p1g1).
    g = tc("f", a=1)
    assert greedy_assignment(np.ones((1, 2))) == [0]
    assert greedy_assignment(np.ones((2, 2))) == [0, 1]
    assert call_rewards([g, g], [g, g], mode="greedy") == [1.0, 1.0]


def test_zero_similarity_is_unmatched_and_no_call_turn() -> None:
    # Turn 1: a wrong-name call (similarity 0 -> unmatched -> penalty -0.2).
    # Turn 2: no calls -> no_call_reward 0.1. Turn 3: answer, F1 = 1.
    turns = [[tc("other", a=1)], [], [tc("f", a=1)]]
    out = match_turn_rewards(
        turns, [tc("f", a=1)], answer_f1=1.0, unmatched_penalty=-0.2, no_call_reward=0.1
    )
    # The answer turn's own call is not matched (authors' code skips calls in the answer turn).
    assert out == pytest.approx([-0.2, 0.1, 1.0])


def test_no_answer_final_turn_is_matched() -> None:
    # answer_f1 None: the final turn's call is matched like any other: S = 1.
    assert match_turn_rewards([[], [tc("f", a=1)]], [tc("f", a=1)], answer_f1=None) == [0.0, 1.0]
    assert match_turn_rewards([], [tc("f")], answer_f1=None) == []


def test_no_gold_calls() -> None:
    assert call_rewards([tc("f")], [], unmatched_penalty=-1.0) == [-1.0]
    assert call_rewards([tc("f")], [], mode="sinkhorn") == [0.0]


def test_sinkhorn_2x2_closed_form() -> None:
    # S = [[1, 2/3], [2/3, 1]] (query equal: (1+1+1)/3; differs: (1+1+0)/3).
    # Uniform marginals and symmetry give T = [[a, 1/2 - a], [1/2 - a, a]], and Sinkhorn's
    # T_ij = u_i K_ij v_j with K = exp(S / reg) gives (a / (1/2 - a))^2 = K11 K22 / (K12 K21)
    # = exp((1 + 1 - 2/3 - 2/3) / 0.1) = exp(20/3), so a / (1/2 - a) = r = exp(10/3),
    # a = r / (2 (1 + r)). Reward of each pred = a * 1 + (1/2 - a) * 2/3 (~0.49426).
    golds = [tc("search", q="a"), tc("search", q="b")]
    r = math.exp(10 / 3)
    a = r / (2 * (1 + r))
    plan = sinkhorn_plan(similarity_matrix(golds, golds), reg=0.1)
    np.testing.assert_allclose(plan, [[a, 0.5 - a], [0.5 - a, a]], atol=1e-9)
    expected = a + (0.5 - a) * 2 / 3
    assert call_rewards(golds, golds, mode="sinkhorn") == pytest.approx([expected] * 2)


def test_sinkhorn_shrinks_with_over_calling() -> None:
    g = tc("f", a=1)
    # 1 x 1: T = [[1]] -> reward = S = 1.
    assert call_rewards([g], [g], mode="sinkhorn") == pytest.approx([1.0])
    # 2 preds x 1 gold: each row carries 1/2 of the mass -> 0.5 each.
    assert call_rewards([g, g], [g], mode="sinkhorn") == pytest.approx([0.5, 0.5])
    # 1 pred x 2 gold: T = [[1/2, 1/2]] whatever S is. S = [1, 0.625]: gold2 = f(a=1, b=2),
    # keys {a} vs {a, b}: J = 1/2, V = 1 -> (1 + 0.5 + 1) / (2 + 2) = 0.625.
    out = call_rewards([g], [g, tc("f", a=1, b=2)], mode="sinkhorn")
    assert out == pytest.approx([0.5 * 1.0 + 0.5 * 0.625])


def test_sinkhorn_log_domain_is_stable() -> None:
    # reg = 1e-3 puts exp(S / reg) at exp(1000) in the plain domain (overflow); log-domain must
    # still return a plan with the right marginals (rows 1/3, columns 1/2).
    rng = np.random.default_rng(0)
    sim = rng.uniform(0, 1, size=(3, 2))
    plan = sinkhorn_plan(sim, reg=1e-3, max_iters=5000)
    assert np.isfinite(plan).all()
    np.testing.assert_allclose(plan.sum(axis=1), [1 / 3] * 3, atol=1e-6)
    np.testing.assert_allclose(plan.sum(axis=0), [1 / 2] * 2, atol=1e-6)


def test_match_config_defaults_and_mode_error() -> None:
    cfg = MatchConfig()
    assert (cfg.mode, cfg.sinkhorn_reg, cfg.unmatched_penalty) == ("hungarian", 0.1, 0.0)
    with pytest.raises(ValueError, match="known: greedy, hungarian, sinkhorn"):
        call_rewards([tc("f")], [tc("f")], mode="km")  # type: ignore[arg-type]
