"""Anchor-state estimators: GiGPO and HGPO (verl-agent lineage).

Both discount environment rewards into step returns ``R_t = r_t + gamma * R_{t+1}`` (an
invalid action costs ``invalid_penalty``) and compare a step with the steps of its group
that were taken in the same anchor observation (GiGPO), or with the same last k anchor
observations (HGPO). The env reward is weighted and extra turn sources add their weighted
raw values to it (sum-first, ``sources.py``); the penalty is never weighted. Returns of raw
rewards are undefined when one is missing, so a rollout with any missing env reward is
masked as a whole; a turn masked by the batch still counts in its rollout's returns (and in the anchor history) but enters no pool and gets 0.
"""

from __future__ import annotations

import numpy as np

from learner.advantages.batch import AdvantageResult, TurnBatch
from learner.advantages.config import GiGPOConfig, HGPOConfig
from learner.advantages.pools import (
    Rollouts,
    discounted_sum,
    pool_codes,
    pool_stats,
    rollouts,
    zscore,
)
from learner.advantages.sources import SourceWeights, extra_raw


def _env_rewards(batch: TurnBatch, ro: Rollouts, penalty: float,
                 sw: SourceWeights) -> tuple[np.ndarray, np.ndarray]:
    """(weighted, penalised env reward plus the weighted extra turn sources, 0 where missing
    ``[N]``; rollout complete ``[R]``)."""
    env = batch.rewards["env"]
    finite = np.isfinite(env)
    r = sw.w("env") * np.where(finite, env, 0.0) + extra_raw(batch, sw)
    if batch.invalid is not None:
        r = r - penalty * batch.invalid
    return r, ro.all_rows(finite)


def gigpo(batch: TurnBatch, cfg: GiGPOConfig, sw: SourceWeights = SourceWeights()) -> AdvantageResult:
    """``A = A_E + w * A_S``.

    ``A_E``: z-score of the episode return (sum of penalised env rewards, or the outcome)
    within the group, over rollouts (``per_rollout``) or over steps (``per_step``).
    ``A_S``: z-score of ``R_t`` within the group's usable steps sharing the anchor hash; an
    anchor seen once gives 0. With ``invalid_penalty_on="step_row"`` the penalty is taken
    off the invalid row's episode score and step return only (see ``_row_penalised``).
    """
    ro = rollouts(batch)
    on_row = cfg.invalid_penalty_on == "step_row"
    r, complete = _env_rewards(batch, ro, 0.0 if on_row else cfg.invalid_penalty, sw)
    if cfg.episode_return == "outcome":
        ret = sw.w("outcome") * batch.outcome[ro.last_row]
        complete = complete & np.isfinite(ret)
    else:
        ret = ro.total(r)
    ok = batch.mask & complete[ro.inverse]
    scale = cfg.mode == "mean_std_norm"
    step_return = discounted_sum(r, ro, cfg.gamma)
    row_pen = np.zeros(len(batch))
    if on_row and batch.invalid is not None:
        row_pen = cfg.invalid_penalty * batch.invalid
    if cfg.episode_stats == "per_rollout":
        a_e = zscore(ret, ro.group, complete & ro.any_row(ok), scale=scale, std=cfg.std,
                     eps=cfg.eps, singleton=cfg.singleton)[ro.inverse]
        a_e = a_e - _row_penalised(ret, ro, complete & ro.any_row(ok), row_pen, scale, cfg)
    else:
        a_e = zscore(ret[ro.inverse] - row_pen, batch.group_id, ok, scale=scale, std=cfg.std,
                     eps=cfg.eps, singleton=cfg.singleton)
    a_s = zscore(step_return - row_pen, pool_codes(batch.group_id, batch.anchor), ok,
                 scale=scale, std=cfg.std, eps=cfg.eps, singleton="zero")
    adv = a_e + cfg.step_weight * a_s
    return AdvantageResult(advantages=np.where(ok, adv, 0.0), mask=ok)


def _row_penalised(ret: np.ndarray, ro: Rollouts, roll_ok: np.ndarray, row_pen: np.ndarray,
                   scale: bool, cfg: GiGPOConfig) -> np.ndarray:
    """``[N]`` what a row's own penalty takes off its episode advantage when statistics are
    over rollouts: the pool's statistics stay those of the rollouts' returns, and the row's
    score ``ret - p`` is standardised with them, so the row loses ``p / (std + eps)`` (``p``
    under mean_norm). A pool with no spread (one rollout, or equal returns) has no scale to
    divide by: there the row loses ``p`` itself, as with verl's std := 1 for singletons."""
    if not row_pen.any():
        return row_pen
    sd = np.ones(len(ret))
    if scale and roll_ok.any():
        idx = np.flatnonzero(roll_ok)
        stats = pool_stats(ret[idx], ro.group[idx], std=cfg.std)
        sd[idx] = np.where(stats.constant, 1.0, stats.sd + cfg.eps)
    return row_pen / sd[ro.inverse]


def _history_pools(batch: TurnBatch, ro: Rollouts, k: int) -> np.ndarray:
    """``[N]`` code of (group, last k anchors) per row; -1 where the rollout has < k steps."""
    assert batch.anchor is not None
    anchors = batch.anchor.tolist()
    groups = batch.group_id.tolist()
    inv = ro.inverse.tolist()
    order = ro.order.tolist()
    codes = np.full(len(batch), -1, dtype=np.int64)
    table: dict[tuple[int, ...], int] = {}
    window: list[int] = []
    prev = -1
    for i in order:  # rows sorted by (rollout, turn): keep a sliding window of anchors
        if inv[i] != prev:
            window, prev = [], inv[i]
        window.append(anchors[i])
        if len(window) >= k:
            key = (groups[i], *window[-k:])
            codes[i] = table.setdefault(key, len(table))
    return codes


def hgpo(batch: TurnBatch, cfg: HGPOConfig, sw: SourceWeights = SourceWeights()) -> AdvantageResult:
    """Weighted average over levels k = 1..K+1 of the z-scored step return.

    At level k the steps of a group whose last k anchor observations are identical form a
    pool; pools of 2+ usable steps z-score ``R_t``. A step averages its non-zero level
    advantages with weights ``k^alpha`` (paper) or ``(k+1)^alpha`` (code), renormalised
    over the levels used; a step with none gets 0.
    """
    ro = rollouts(batch)
    r, complete = _env_rewards(batch, ro, cfg.invalid_penalty, sw)
    ok = batch.mask & complete[ro.inverse]
    step_return = discounted_sum(r, ro, cfg.gamma)
    scale = cfg.mode == "mean_std_norm"
    num = np.zeros(len(batch))
    den = np.zeros(len(batch))
    for k in range(1, cfg.history + 2):
        pools = _history_pools(batch, ro, k)
        # Singletons give exactly 0 and so drop out of the average below, as in the code.
        a = zscore(step_return, pools, ok & (pools >= 0), scale=scale, std=cfg.std,
                   eps=cfg.eps, singleton="zero")
        weight = float(k if cfg.weight_indexing == "paper" else k + 1) ** cfg.alpha
        used = a != 0.0
        num += np.where(used, weight * a, 0.0)
        den += np.where(used, weight, 0.0)
    adv = np.divide(num, den, out=np.zeros(len(batch)), where=den > 0)
    return AdvantageResult(advantages=np.where(ok, adv, 0.0), mask=ok)
