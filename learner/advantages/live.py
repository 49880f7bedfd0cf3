"""Advantages for live sessions: a running baseline per reward source.

A live session is a group of one: nobody sampled G answers to the same prompt, so a group
baseline (GRPO's mean) would be the session's own reward and its advantage always 0. The
baseline here is instead an exponential moving average over the live sessions trained
before, one per reward source (the value function of REINFORCE with a running-mean baseline;
what prime-rl and AReaL's online modes fall back to when there is no group):

    b_s, v_s = EMA mean and variance of source s over earlier live values (bias-corrected)
    z_s(t)   = w_s * (x_s(t) - b_s) / sqrt(max(v_s, var_floor))
    r(t)     = sum over turn sources of z_s(t)  (+ z_outcome on the session's last turn)
    A(t)     = sum_{k >= t} gamma^(k - t) * r(k)        within the session

The outcome is counted once per session; a turn source (``prm``, ``judge``, ``env`` from the
client's per-turn feedback, ``ig``, ``match``) once per turn that has it. The baseline used for
a batch is the state *before* it (a session never baselines itself), then the batch's values
update it. Before any history the batch's own leave-one-out mean is the baseline and the
scale is 1. The state is small, returned rather than mutated, and checkpointed by the learner.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

import numpy as np

from learner.advantages.batch import AdvantageResult, TurnBatch
from learner.advantages.config import LiveBaselineConfig
from learner.advantages.pools import discounted_sum, rollouts


@dataclass(frozen=True)
class Moments:
    """Exponentially weighted first and second moments of one source, Adam-style (``m1`` and
    ``m2`` start at 0; dividing by ``1 - decay**n`` removes that start's bias)."""

    m1: float = 0.0
    m2: float = 0.0
    n: int = 0

    def mean_var(self, decay: float) -> tuple[float, float]:
        correction = 1.0 - decay ** self.n
        mean = self.m1 / correction
        return mean, max(self.m2 / correction - mean * mean, 0.0)

    def updated(self, values: np.ndarray, decay: float) -> "Moments":
        m1, m2 = self.m1, self.m2
        for x in values:
            m1 = decay * m1 + (1.0 - decay) * x
            m2 = decay * m2 + (1.0 - decay) * x * x
        return Moments(float(m1), float(m2), self.n + len(values))


BaselineState = Mapping[str, Moments]
"""Source -> its moments; a source not present has no history yet."""


def live_signals(batch: TurnBatch) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Source -> (``[N]`` values, ``[N]`` bool rows that carry one). The outcome sits on each
    session's last turn only, so it is counted once per session."""
    last = rollouts(batch).is_final
    out = {"outcome": (batch.outcome, last & np.isfinite(batch.outcome) & batch.mask)}
    for source, values in batch.rewards.items():
        if source != "outcome":
            out[source] = (values, np.isfinite(values) & batch.mask)
    return {s: (v, has) for s, (v, has) in out.items() if has.any()}


def _baseline(moments: Moments | None, values: np.ndarray, cfg: LiveBaselineConfig
              ) -> tuple[np.ndarray, float]:
    """Per-value baseline and the scale: the history's, or leave-one-out within the batch."""
    if moments is not None and moments.n > 0:
        mean, var = moments.mean_var(cfg.decay)
        return np.full(len(values), mean), float(np.sqrt(max(var, cfg.var_floor)))
    if len(values) == 1:
        return np.zeros(1), 1.0
    return (values.sum() - values) / (len(values) - 1), 1.0


def running_baseline(batch: TurnBatch, cfg: LiveBaselineConfig, state: BaselineState,
                     weights: Mapping[str, float] | None = None
                     ) -> tuple[AdvantageResult, dict[str, Moments]]:
    """Advantages of live sessions against the running baselines, and the updated state."""
    weights = weights or {}
    reward = np.zeros(len(batch))
    new_state = dict(state)
    for source, (values, has) in live_signals(batch).items():
        x = values[has]
        base, scale = _baseline(state.get(source), x, cfg)
        reward[has] += float(weights.get(source, 1.0)) * (x - base) / scale
        new_state[source] = (state.get(source) or Moments()).updated(x, cfg.decay)
    adv = discounted_sum(reward, rollouts(batch), cfg.gamma)
    adv[~batch.mask] = 0.0
    return AdvantageResult(advantages=adv, mask=batch.mask.copy()), new_state
