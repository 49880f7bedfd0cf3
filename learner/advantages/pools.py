"""Shared numerics of the estimators: pools, z-scores and backward accumulation over turns.

A *pool* is the set of rows a value is normalised against (a group, a (group, turn index)
pair, a (group, anchor) pair ...). Everything is vectorised with ``np.unique`` and
``np.bincount`` except the backward accumulations, which are one pass over the rows.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np

from learner.advantages.batch import TurnBatch

StdKind = Literal["population", "unbiased"]
Singleton = Literal["zero", "raw"]


def pool_codes(*keys: np.ndarray) -> np.ndarray:
    """Dense int64 code per row for the composite key ``(keys[0][i], keys[1][i], ...)``."""
    if len(keys[0]) == 0:
        return np.zeros(0, dtype=np.int64)
    stacked = np.stack([np.asarray(k, dtype=np.int64) for k in keys], axis=1)
    _, inv = np.unique(stacked, axis=0, return_inverse=True)
    return inv.reshape(-1).astype(np.int64)


def zscore(
    values: np.ndarray,
    pools: np.ndarray,
    valid: np.ndarray,
    *,
    scale: bool = True,
    std: StdKind = "population",
    eps: float = 1e-6,
    singleton: Singleton = "zero",
    var_floor: float = 0.0,
) -> np.ndarray:
    """``(x - mean_pool) / (sqrt(var_pool + var_floor) + eps)`` per row, over the rows where
    ``valid``.

    Args:
        values: ``[N]`` float values (may be NaN where ``valid`` is False).
        pools: ``[N]`` int pool code per row.
        valid: ``[N]`` bool; only these rows enter the statistics and get a value.
        scale: divide by ``std + eps``; False subtracts the mean only (Dr.GRPO, mean_norm).
        std: ``population`` (ddof 0) or ``unbiased`` (ddof 1, ``torch.std``'s default).
        singleton: a pool of one row gets ``0.0`` (``zero``: the formula's numerator is 0)
            or its raw value over ``1 + eps`` (``raw``: verl-style code sets mean 0, std 1).
        var_floor: added to the variance under the square root (IGPO's corrected release:
            ``sqrt(var + 1e-8)``); it bounds how far a pool with a tiny spread is stretched.

    Returns:
        ``[N]`` float64, 0.0 where not ``valid``. A pool whose values are all equal gives
        exactly 0.0 (not float noise over eps), so all-equal groups carry no signal.
    """
    out = np.zeros(len(values), dtype=np.float64)
    idx = np.flatnonzero(valid)
    if idx.size == 0:
        return out
    x = np.asarray(values, dtype=np.float64)[idx]
    stats = pool_stats(x, np.asarray(pools)[idx], std=std if scale else None,
                       var_floor=var_floor)
    dev = x - stats.mean
    z = dev / (stats.sd + eps) if scale else dev
    z = np.where(stats.constant, 0.0, z)
    if singleton == "raw":
        z = np.where(stats.n == 1, x / (1.0 + eps) if scale else x, z)
    out[idx] = z
    return out


@dataclass(frozen=True)
class PoolStats:
    """Statistics of each row's pool, repeated per row (shapes ``[M]``)."""

    mean: np.ndarray
    sd: np.ndarray
    """``sqrt(var + var_floor)``; 0 when not asked for."""
    n: np.ndarray
    constant: np.ndarray
    """bool, every value of the pool is equal."""


def pool_stats(x: np.ndarray, pools: np.ndarray, *, std: StdKind | None = "population",
               var_floor: float = 0.0) -> PoolStats:
    """Mean, std (``None``: skip it), size and constancy of each row's pool, per row."""
    _, inv = np.unique(pools, return_inverse=True)
    inv = inv.reshape(-1)
    k = int(inv.max()) + 1 if len(inv) else 0
    n = np.bincount(inv, minlength=k).astype(np.float64)
    mean = np.bincount(inv, weights=x, minlength=k) / np.maximum(n, 1.0)
    sd = np.zeros(k)
    if std is not None:
        dev = x - mean[inv]
        ddof = 1.0 if std == "unbiased" else 0.0
        ss = np.bincount(inv, weights=dev * dev, minlength=k)
        sd = np.sqrt(ss / np.maximum(n - ddof, 1.0) + var_floor)
    lo = np.full(k, np.inf)
    hi = np.full(k, -np.inf)
    np.minimum.at(lo, inv, x)
    np.maximum.at(hi, inv, x)
    return PoolStats(mean=mean[inv], sd=sd[inv], n=n[inv], constant=(lo == hi)[inv])


@dataclass(frozen=True)
class Rollouts:
    """Per-rollout view of a TurnBatch (shapes ``[R]`` unless noted)."""

    inverse: np.ndarray
    """``[N]`` rollout position of each row."""
    group: np.ndarray
    """group code of each rollout."""
    last_row: np.ndarray
    """row index of each rollout's final turn (largest turn_index)."""
    is_final: np.ndarray
    """``[N]`` bool, the row is its rollout's final turn."""
    position: np.ndarray
    """``[N]`` 0-based rank of the row within its rollout by turn_index (robust to gaps)."""
    order: np.ndarray
    """``[N]`` row indices sorted by (rollout, turn_index)."""

    def any_row(self, flags: np.ndarray) -> np.ndarray:
        """Per rollout: some row of it has ``flags`` True."""
        return np.bincount(self.inverse, weights=flags.astype(np.float64),
                           minlength=len(self.group)) > 0

    def all_rows(self, flags: np.ndarray) -> np.ndarray:
        """Per rollout: every row of it has ``flags`` True."""
        return ~self.any_row(~flags)

    def total(self, values: np.ndarray) -> np.ndarray:
        """Per rollout sum of ``values`` over its rows."""
        return np.bincount(self.inverse, weights=values, minlength=len(self.group))


def rollouts(batch: TurnBatch) -> Rollouts:
    """Index the batch by rollout."""
    n = len(batch)
    _, first, inv = np.unique(batch.rollout_id, return_index=True, return_inverse=True)
    inv = inv.reshape(-1)
    order = np.lexsort((batch.turn_index, inv))
    sorted_inv = inv[order]
    starts = np.r_[True, sorted_inv[1:] != sorted_inv[:-1]] if n else np.zeros(0, bool)
    ends = np.r_[sorted_inv[1:] != sorted_inv[:-1], True] if n else np.zeros(0, bool)
    start_pos = np.maximum.accumulate(np.where(starts, np.arange(n), 0)) if n else starts
    position = np.empty(n, dtype=np.int64)
    position[order] = np.arange(n) - start_pos
    last_row = order[ends]  # in rollout-code order because the sort is by rollout first
    is_final = np.zeros(n, dtype=np.bool_)
    is_final[last_row] = True
    return Rollouts(inverse=inv, group=batch.group_id[first], last_row=last_row,
                    is_final=is_final, position=position, order=order)


def discounted_sum(values: np.ndarray, ro: Rollouts, gamma: float) -> np.ndarray:
    """``S_t = v_t + gamma * S_{t+1}`` within each rollout, in turn order (``[N]`` -> ``[N]``).

    Turns are chained by rank, not by turn_index arithmetic, so a gap in turn numbers does
    not add an extra discount.
    """
    out = np.zeros(len(values), dtype=np.float64)
    vals = np.asarray(values, dtype=np.float64).tolist()  # plain floats: fast scalar loop
    inv = ro.inverse.tolist()
    acc, prev = 0.0, -1
    # One pass backwards over (rollout, turn)-sorted rows: a rollout change resets the sum.
    for i in ro.order[::-1].tolist():
        if inv[i] != prev:
            acc, prev = 0.0, inv[i]
        acc = vals[i] + gamma * acc
        out[i] = acc
    return out
