"""MatchTIR dual-level advantage over bipartite-matching turn rewards.

Turn rewards: ``match`` on tool-calling turns, the outcome (answer F1) on the final turn.
``A_traj`` = z-score of the rollout's summed turn rewards within the group;
``G_t = r_t + gamma * G_{t+1}``; ``A_turn`` = z-score of ``G_t`` within (group, turn index);
the turn's advantage is ``(A_traj + A_turn) / 2``.

Sums of raw rewards are undefined when one is missing, so a rollout with any missing turn
reward is masked as a whole. A turn masked by the batch (finite reward) still counts in its
rollout's sums but enters no pool and gets 0. Weights multiply the raw rewards (``match``,
the outcome) and extra turn sources add their weighted raw values to ``r_t`` (sum-first).
"""

from __future__ import annotations

import numpy as np

from learner.advantages.batch import AdvantageResult, TurnBatch
from learner.advantages.config import MatchTIRConfig
from learner.advantages.pools import discounted_sum, pool_codes, rollouts, zscore
from learner.advantages.sources import SourceWeights, extra_raw


def matchtir(batch: TurnBatch, cfg: MatchTIRConfig, sw: SourceWeights = SourceWeights()) -> AdvantageResult:
    """Dual-level MatchTIR advantages (see module docstring)."""
    ro = rollouts(batch)
    match = sw.w("match") * batch.rewards["match"]
    value = np.where(ro.is_final, sw.w("outcome") * batch.outcome, match) \
        if cfg.final_turn_reward == "outcome" else match
    finite = np.isfinite(value)
    complete = ro.all_rows(finite)
    ok = batch.mask & complete[ro.inverse]
    v = np.where(finite, value, 0.0) + extra_raw(batch, sw)

    roll_ok = complete & ro.any_row(ok)
    a_traj = zscore(ro.total(v), ro.group, roll_ok, scale=cfg.scale_traj_by_std,
                    std=cfg.std, eps=cfg.eps, singleton=cfg.singleton)
    g = discounted_sum(v, ro, cfg.gamma)
    # The code always std-normalises the turn level, whatever norm_adv_by_std says.
    a_turn = zscore(g, pool_codes(batch.group_id, batch.turn_index), ok, scale=True,
                    std=cfg.std, eps=cfg.eps, singleton=cfg.singleton)
    adv = (a_traj[ro.inverse] + a_turn) / 2.0
    return AdvantageResult(advantages=np.where(ok, adv, 0.0), mask=ok)
