"""The live estimator's numbers, derived by hand (learner/advantages/live.py)."""

from __future__ import annotations

import numpy as np
import pytest

from learner.advantages.batch import TurnBatch
from learner.advantages.config import LiveBaselineConfig
from learner.advantages.live import Moments, running_baseline


def _batch(outcomes: list[float], turns: list[int], prm: list[float] | None = None) -> TurnBatch:
    rollout = np.repeat(np.arange(len(turns)), turns)
    return TurnBatch(group_id=rollout, rollout_id=rollout,
                     turn_index=np.concatenate([np.arange(n) for n in turns]),
                     outcome=np.repeat(outcomes, turns), rewards={} if prm is None else {"prm": prm},
                     anchor=None, mask=np.ones(sum(turns), dtype=bool))


def test_first_batch_uses_leave_one_out_then_history() -> None:
    cfg = LiveBaselineConfig(decay=0.5, gamma=1.0, var_floor=0.01)
    # three one-turn sessions, outcomes 1, 0, 0: leave-one-out baselines 0, 0.5, 0.5, scale 1
    res, state = running_baseline(_batch([1.0, 0.0, 0.0], [1, 1, 1]), cfg, {})
    assert res.advantages.tolist() == pytest.approx([1.0, -0.5, -0.5])
    # EMA, decay 0.5: m1 = 0.5, 0.25, 0.125; bias correction 1 - 0.5^3 = 0.875
    m = state["outcome"]
    assert (m.n, m.m1, m.m2) == (3, pytest.approx(0.125), pytest.approx(0.125))
    mean, var = m.mean_var(0.5)
    assert mean == pytest.approx(1 / 7) and var == pytest.approx(1 / 7 - 1 / 49)
    # the next batch is judged against that history: (1 - 1/7) / sqrt(6/49)
    res2, _ = running_baseline(_batch([1.0], [1]), cfg, state)
    assert res2.advantages[0] == pytest.approx((6 / 7) / np.sqrt(6 / 49))


def test_outcome_once_per_session_turn_sources_per_turn_accumulated_backward() -> None:
    cfg = LiveBaselineConfig(decay=0.9, gamma=0.5)
    state = {"outcome": Moments(m1=0.05, m2=0.05, n=1),  # mean 0.5, var 0.25 -> scale 0.5
             "prm": Moments(m1=0.0, m2=0.01, n=1)}       # mean 0, var 0.1 -> scale sqrt(0.1)
    # one session of 2 turns, outcome 1, prm 0.1 then NaN (the PRM did not score turn 1)
    res, new = running_baseline(_batch([1.0], [2], prm=[0.1, np.nan]), cfg, state,
                                weights={"outcome": 2.0})
    z_prm, z_out = 0.1 / np.sqrt(0.1), 2.0 * (1.0 - 0.5) / 0.5
    assert res.advantages.tolist() == pytest.approx([z_prm + 0.5 * z_out, z_out])
    assert new["outcome"].n == 2 and new["prm"].n == 2  # one outcome, one prm value added
    assert state["outcome"].n == 1  # the caller's state is not mutated


def test_masked_turns_get_zero_and_do_not_enter_the_baseline() -> None:
    batch = _batch([1.0, 0.0], [1, 1])
    batch.mask[1] = False
    res, state = running_baseline(batch, LiveBaselineConfig(), {})
    assert res.advantages.tolist() == [1.0, 0.0] and state["outcome"].n == 1
