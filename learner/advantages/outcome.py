"""Outcome-only estimators: GRPO (and Dr.GRPO) and RLOO.

The pool is the group's rollouts, one value per rollout (not per turn: a long rollout must
not weigh more in the baseline). Every usable turn of a rollout gets the rollout's value.
A rollout is usable when its outcome is finite and at least one of its turns is unmasked.
Both read the outcome only; its weight multiplies the advantage.
"""

from __future__ import annotations

import numpy as np

from learner.advantages.batch import AdvantageResult, TurnBatch
from learner.advantages.config import GRPOConfig, RLOOConfig
from learner.advantages.pools import Rollouts, rollouts, zscore
from learner.advantages.sources import SourceWeights


def _usable(batch: TurnBatch, ro: Rollouts) -> tuple[np.ndarray, np.ndarray]:
    """(usable rows ``[N]``, usable rollouts ``[R]``) for outcome-based estimators."""
    row_ok = batch.mask & np.isfinite(batch.outcome)
    return row_ok, ro.any_row(row_ok)


def grpo(batch: TurnBatch, cfg: GRPOConfig, sw: SourceWeights = SourceWeights()) -> AdvantageResult:
    """``(R_i - mean_G) / (std_G + eps)`` (or ``R_i - mean_G`` for Dr.GRPO) per rollout.

    ``stats="per_step"`` takes mean and std over the group's usable step rows instead (each
    row holds its rollout's outcome), as verl-agent's multi-turn GRPO does.
    """
    ro = rollouts(batch)
    row_ok, roll_ok = _usable(batch, ro)
    if cfg.stats == "per_step":
        adv_rows = zscore(batch.outcome, batch.group_id, row_ok, scale=cfg.scale_by_std,
                          std=cfg.std, eps=cfg.eps, singleton=cfg.singleton)
        return AdvantageResult(advantages=sw.w("outcome") * adv_rows, mask=row_ok)
    value = batch.outcome[ro.last_row]
    adv = zscore(value, ro.group, roll_ok, scale=cfg.scale_by_std, std=cfg.std,
                 eps=cfg.eps, singleton=cfg.singleton)
    adv = sw.w("outcome") * adv
    return AdvantageResult(advantages=np.where(row_ok, adv[ro.inverse], 0.0), mask=row_ok)


def rloo(batch: TurnBatch, cfg: RLOOConfig, sw: SourceWeights = SourceWeights()) -> AdvantageResult:
    """``R_i - mean_{j != i} R_j`` over the usable rollouts of the group.

    Equals ``G / (G - 1) * (R_i - mean_G)``; a group with one usable rollout has no baseline
    and gets 0 (or the raw outcome with ``singleton="raw"``).
    """
    ro = rollouts(batch)
    row_ok, roll_ok = _usable(batch, ro)
    value = np.where(roll_ok, batch.outcome[ro.last_row], 0.0)
    _, ginv = np.unique(ro.group, return_inverse=True)
    ginv = ginv.reshape(-1)
    n = np.bincount(ginv, weights=roll_ok.astype(np.float64))[ginv]
    total = np.bincount(ginv, weights=value)[ginv]
    with np.errstate(invalid="ignore", divide="ignore"):
        adv = value - (total - value) / (n - 1.0)
    single = n == 1
    adv = np.where(single, value if cfg.singleton == "raw" else 0.0, adv)
    # All-equal groups: exactly zero instead of float noise.
    lo = np.full(ginv.max() + 1 if len(ginv) else 0, np.inf)
    hi = np.full_like(lo, -np.inf)
    np.minimum.at(lo, ginv[roll_ok], value[roll_ok])
    np.maximum.at(hi, ginv[roll_ok], value[roll_ok])
    adv = np.where((lo == hi)[ginv] & ~single, 0.0, adv)
    adv = sw.w("outcome") * np.where(roll_ok, adv, 0.0)
    return AdvantageResult(advantages=np.where(row_ok, adv[ro.inverse], 0.0), mask=row_ok)
