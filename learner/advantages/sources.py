"""Which reward sources an estimator reads, at which weight, and how extra sources combine.

Every estimator has *primary* sources (GRPO: the outcome; IGPO: IG and the outcome; GiGPO:
env ...). Estimators that use turn rewards also take every other turn source the run
configured (``extras``), weighted by the run's reward weights, so a configured source is
never scored and thrown away. Two combinations, following how each estimator treats its
own turn rewards:

- normalise-first (igpo, a2tgpo, prm): each extra source is z-scored in its own pool (the
  estimator's turn-reward pool), weighted, and added to the turn's normalised reward before
  the backward accumulation;
- sum-first (matchtir, gigpo, hgpo): the weighted raw values are added to the turn's raw
  reward before the estimator's sums and normalisation.

A NaN in an extra source (the source does not score that turn, e.g. IG on the answer turn)
contributes nothing; a failed scorer is the learner's business (``on_missing``) before the
estimator runs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping

import numpy as np

from learner.advantages.batch import TurnBatch
from learner.advantages.pools import StdKind, zscore

TURN_SOURCES: tuple[str, ...] = ("ig", "prm", "match", "env")
"""Reward sources that score turns (the outcome scores the rollout)."""


@dataclass(frozen=True)
class SourceWeights:
    """The run's reward weights and the extra turn sources the estimator adds."""

    weights: Mapping[str, float] = field(default_factory=dict)
    """Source -> weight; a source not listed weighs 1.0."""
    extras: tuple[str, ...] = ()
    """Turn sources read beyond the estimator's primary ones, in a fixed order."""

    def w(self, source: str) -> float:
        """Weight of ``source`` (1.0 when the run gave none)."""
        return float(self.weights.get(source, 1.0))


def extra_raw(batch: TurnBatch, sw: SourceWeights) -> np.ndarray:
    """``[N]`` sum over the extra sources of ``w_s * x_s`` (NaN read as nothing)."""
    total = np.zeros(len(batch))
    for s in sw.extras:
        x = batch.rewards[s]
        total += sw.w(s) * np.where(np.isfinite(x), x, 0.0)
    return total


def extra_normalised(batch: TurnBatch, sw: SourceWeights, pools: np.ndarray, valid: np.ndarray,
                     *, std: StdKind, eps: float, var_floor: float = 0.0) -> np.ndarray:
    """``[N]`` sum over the extra sources of ``w_s * z(x_s)``, each source z-scored in
    ``pools`` over the ``valid`` rows where it has a value."""
    total = np.zeros(len(batch))
    for s in sw.extras:
        x = batch.rewards[s]
        total += sw.w(s) * zscore(x, pools, valid & np.isfinite(x), std=std, eps=eps,
                                  var_floor=var_floor)
    return total
