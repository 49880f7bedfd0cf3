"""Normalise-first turn estimators: IGPO, its successor A^2TGPO, and the PRM estimator.

Both read the ``ig`` turn rewards on turns 1..T-1 and the outcome on the final turn (the
final turn's own IG, if any, is ignored: the answer turn is scored by the outcome). Both
normalise first and accumulate after, so a masked turn simply contributes 0 (the pool
mean in z-space) to the sums of earlier turns and nothing to any pool. The PRM estimator
reads ``prm`` on every turn instead of IG, with the outcome added on the final turn.

Extra turn sources (``sources.py``) are z-scored in the estimator's turn pool and added,
weighted, to ``r~_t``; the primary IG weighs ``rewards`` weight x ``ig_weight``, the
normalised outcome its ``rewards`` weight.
"""

from __future__ import annotations

import numpy as np

from learner.advantages.batch import AdvantageResult, TurnBatch
from learner.advantages.config import A2TGPOConfig, IGPOConfig, PRMEstimatorConfig
from learner.advantages.pools import Rollouts, discounted_sum, pool_codes, rollouts, zscore
from learner.advantages.sources import SourceWeights, extra_normalised


def _turn_rewards(batch: TurnBatch, ro: Rollouts) -> tuple[np.ndarray, np.ndarray]:
    """(raw turn reward ``[N]``: IG, or the outcome on final turns; usable rows ``[N]``)."""
    value = np.where(ro.is_final, batch.outcome, batch.rewards["ig"])
    return value, batch.mask & np.isfinite(value)


def igpo(batch: TurnBatch, cfg: IGPOConfig, sw: SourceWeights = SourceWeights()) -> AdvantageResult:
    """IGPO turn advantages.

    ``r~`` = z-score of the turn reward within the group (``joint``: one pool of IG rewards
    and outcomes; ``separate``: IG pool and outcome pool), IG scaled by ``ig_weight``; then
    ``A_T = r~_T`` and ``A_t = r~_t + gamma * A_{t+1}`` per rollout.
    """
    ro = rollouts(batch)
    value, ok = _turn_rewards(batch, ro)
    if cfg.normalisation == "joint":
        pools = batch.group_id
    else:  # two pools per group: IG turns, and final (outcome) turns
        pools = pool_codes(batch.group_id, ro.is_final.astype(np.int64))
    norm = zscore(value, pools, ok, scale=True, std=cfg.std, eps=cfg.eps,
                  singleton=cfg.singleton, var_floor=cfg.var_floor)
    r = norm * np.where(ro.is_final, sw.w("outcome"), cfg.ig_weight * sw.w("ig"))
    r = r + extra_normalised(batch, sw, batch.group_id, ok, std=cfg.std, eps=cfg.eps,
                             var_floor=cfg.var_floor)
    acc = discounted_sum(np.where(ok, r, 0.0), ro, cfg.gamma)
    return AdvantageResult(advantages=np.where(ok, acc, 0.0), mask=ok)


def a2tgpo(batch: TurnBatch, cfg: A2TGPOConfig, sw: SourceWeights = SourceWeights()) -> AdvantageResult:
    """A^2TGPO turn advantages and per-turn clip ranges.

    ``r~_t`` = IG z-scored within (group, turn index); the final turn's outcome z-scored
    within the group (``outcome_pool="group"``) or within its (group, turn index) pool.
    ``A_t = sum_{k>=t} gamma^(k-t) r~_k / sqrt(n_t)`` with ``n_t`` the number of unmasked
    terms summed. Clip epsilons ``eps * (1 + beta * (2 * sigmoid(z_t) - 1))`` with ``z_t`` the
    turn's normalised reward (before ``ig_weight``); masked turns keep the base epsilons.
    """
    ro = rollouts(batch)
    value, ok = _turn_rewards(batch, ro)
    if cfg.outcome_pool == "group":
        # Final turns share one pool per group (-1 is never a real turn index).
        slot = np.where(ro.is_final, -1, batch.turn_index)
    else:
        slot = batch.turn_index
    norm = zscore(value, pool_codes(batch.group_id, slot), ok, scale=True, std=cfg.std,
                  eps=cfg.eps, singleton=cfg.singleton)
    r = norm * np.where(ro.is_final, sw.w("outcome"), cfg.ig_weight * sw.w("ig"))
    r = r + extra_normalised(batch, sw, pool_codes(batch.group_id, batch.turn_index), ok,
                             std=cfg.std, eps=cfg.eps)
    acc = discounted_sum(np.where(ok, r, 0.0), ro, cfg.gamma)
    if cfg.sqrt_scaling:
        terms = discounted_sum(ok.astype(np.float64), ro, 1.0)
        acc = acc / np.sqrt(np.maximum(terms, 1.0))
    # 2 * sigmoid(z) - 1 == tanh(z / 2), which cannot overflow.
    factor = 1.0 + cfg.clip_beta * np.tanh(norm / 2.0)
    factor = np.where(ok, factor, 1.0)
    return AdvantageResult(
        advantages=np.where(ok, acc, 0.0),
        clip_low=cfg.clip_low * factor,
        clip_high=cfg.clip_high * factor,
        mask=ok,
    )


def prm(batch: TurnBatch, cfg: PRMEstimatorConfig, sw: SourceWeights = SourceWeights()) -> AdvantageResult:
    """PRM turn advantages: ``r~_t = w_prm z(prm_t)`` (pool: every scored turn of the group)
    plus, on the final turn, ``w_outcome z(outcome)`` (pool: the group's rollouts); then
    ``A_t = r~_t + gamma * A_{t+1}``. A turn with neither a PRM value nor the outcome is
    masked and adds 0; a final turn without its PRM value still carries the outcome."""
    ro = rollouts(batch)
    process = batch.rewards["prm"]
    prm_ok = batch.mask & np.isfinite(process)
    outcome_ok = batch.mask & ro.is_final & np.isfinite(batch.outcome)
    z_prm = zscore(process, batch.group_id, prm_ok, std=cfg.std, eps=cfg.eps,
                   singleton=cfg.singleton)
    z_out = zscore(batch.outcome, batch.group_id, outcome_ok, std=cfg.std, eps=cfg.eps,
                   singleton=cfg.singleton)
    ok = prm_ok | outcome_ok
    r = sw.w("prm") * z_prm + sw.w("outcome") * z_out
    r = r + extra_normalised(batch, sw, batch.group_id, ok, std=cfg.std, eps=cfg.eps)
    acc = discounted_sum(np.where(ok, r, 0.0), ro, cfg.gamma)
    return AdvantageResult(advantages=np.where(ok, acc, 0.0), mask=ok)
