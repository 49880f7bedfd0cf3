"""Advantages of a claimed batch, as the learner trains them: the run's reward sources read
from the trajectories, failed scorers handled per ``on_missing``, the estimator run, and the
turn mask the loss uses (every turn the estimator or a failure drops leaves it).

Pure numpy over trajectories. ``BatchAdvantages`` is what a learner (``learner.worker``, a
tenant of ``learner.pool``) calls on each claimed batch: ``batch_advantages`` for its scheduled
groups, the running baseline for its live sessions (whose moments it keeps), ``join_live``.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

import numpy as np

from learner.advantages.batch import AdvantageResult, constrained_turns, turn_batch_from_trajectories
from learner.advantages.config import EstimatorConfig, LiveBaselineConfig
from learner.advantages.live import Moments, running_baseline
from learner.advantages.registry import compute_advantages, read_sources

if TYPE_CHECKING:  # rollout is upstream of learner; imported lazily to keep start-up light
    from rollout.trajectory import Trajectory

ON_MISSING = ("mask_turn", "skip_group", "zero")


def batch_advantages(trajs: list[Trajectory], estimator: EstimatorConfig,
                     weights: dict[str, float] | None = None, on_missing: str = "mask_turn",
                     ) -> tuple[AdvantageResult, np.ndarray]:
    """Advantages and the turn mask. The estimator weighs and combines the run's reward
    sources (``weights``: ``RewardsConfig.trained_weights()``; None: the estimator's own
    sources). A reward the estimator reads that a scorer failed to give (``None``) is handled
    per ``on_missing``: ``mask_turn`` drops that turn from every pool and the loss,
    ``skip_group`` drops the trajectory's whole group, ``zero`` reads it as 0.0 (biased; for
    debugging)."""
    needed = read_sources(estimator, weights)
    # A column for every source read, even one no turn of this batch carries (IG in a batch
    # of one-turn rollouts): the run checked at start that its reward stages produce them.
    batch = turn_batch_from_trajectories(trajs, needed - {"outcome"})
    mask = batch.mask.copy()
    if on_missing not in ON_MISSING:
        raise ValueError(f"on_missing {on_missing!r}; known: {', '.join(ON_MISSING)}")
    # Failed scorers are explicit None values (a source absent from a turn is no failure).
    src_failed = np.array([any(turn.rewards.get(s, 0.0) is None for s in needed if s != "outcome")
                           for traj in trajs for turn in traj.turns], dtype=bool)
    out_failed = np.array([("outcome" in needed and traj.outcome is None)
                           for traj in trajs for _ in traj.turns], dtype=bool)
    failed = src_failed | out_failed
    if on_missing == "zero":
        rewards = {k: np.where(src_failed & np.isnan(v), 0.0, v) if k in needed else v
                   for k, v in batch.rewards.items()}
        outcome = np.where(out_failed, 0.0, batch.outcome)
        batch = dataclasses.replace(batch, rewards=rewards, outcome=outcome)
    elif on_missing == "skip_group":
        mask &= ~np.isin(batch.group_id, batch.group_id[failed])
    else:
        mask &= ~failed
    if "outcome" in needed:
        mask &= ~np.isnan(batch.outcome)
    batch = dataclasses.replace(batch, mask=mask)
    res = compute_advantages(batch, estimator, weights)
    # The estimator may drop more turns (e.g. a rollout whose summed reward is NaN); those
    # must leave the loss too, not train with advantage 0 and dilute the token mean.
    return res, mask if res.mask is None else mask & res.mask


def join_live(sched: tuple[AdvantageResult, np.ndarray], live: tuple[AdvantageResult, np.ndarray],
              loss: Any) -> tuple[AdvantageResult, np.ndarray]:
    """Scheduled turns' advantages and mask followed by the live turns'. Where the estimator
    gives per-turn clips (a2tgpo, which needs the ppo loss), live turns take the loss's own
    ``clip_low``/``clip_high`` (read only then: other losses have none)."""
    (a, mask_a), (b, mask_b) = sched, live
    clips = [None, None]
    if a.clip_low is not None:
        clips = [np.concatenate([a.clip_low, np.full(len(b.advantages), loss.clip_low)]),
                 np.concatenate([a.clip_high, np.full(len(b.advantages), loss.clip_high)])]
    res = AdvantageResult(np.concatenate([a.advantages, b.advantages]), *clips)
    return res, np.concatenate([mask_a, mask_b])


class BatchAdvantages:
    """A learner's advantages of each claimed batch: scheduled groups through ``estimator``
    (``batch_advantages``), live sessions through the running baseline ``live``, whose moments
    per reward source it keeps in ``state`` (its learner checkpoints them)."""

    def __init__(self, estimator: EstimatorConfig, live: LiveBaselineConfig, loss: Any,
                 weights: dict[str, float] | None = None, on_missing: str = "mask_turn",
                 state: dict[str, Moments] | None = None) -> None:
        self.estimator, self.live, self.loss = estimator, live, loss
        self.weights, self.on_missing = weights, on_missing
        self.state: dict[str, Moments] = dict(state or {})

    @classmethod
    def of_run(cls, learner: Any, rewards: Any = None, checkpoint: dict[str, Any] | None = None) -> BatchAdvantages:
        """A run's: its ``LearnerConfig`` (estimator, live baseline, loss), its ``RewardsConfig``
        (trained weights and ``on_missing``; None: the estimator's own sources, ``mask_turn``)
        and the live baselines its last checkpoint saved (``saved()``; None: fresh)."""
        moments = {src: Moments(*m) for src, m in (checkpoint or {}).get("live_baseline", {}).items()}
        return cls(learner.estimator, learner.live_baseline, learner.loss,
                   rewards.trained_weights() if rewards is not None else None,
                   rewards.on_missing if rewards is not None else "mask_turn", moments)

    def saved(self) -> dict[str, Any]:
        """What a checkpoint's state keeps of it (``of_run`` reads it back)."""
        return {"live_baseline": {src: [m.m1, m.m2, m.n] for src, m in self.state.items()}}

    def __call__(self, trajs: list[Trajectory]) -> tuple[list[Trajectory], AdvantageResult, np.ndarray]:
        """Advantages and turn mask of ``trajs``, which come back reordered (scheduled groups
        first, then live sessions) to match."""
        sched = [t for t in trajs if t.live is None]
        live = [t for t in trajs if t.live is not None]
        parts = [batch_advantages(sched, self.estimator, self.weights, self.on_missing)] if sched else []
        if live:
            parts.append(self._live(live))
        if len(parts) == 1:
            return sched + live, *parts[0]
        return sched + live, *join_live(*parts, self.loss)

    def _live(self, live: list[Trajectory]) -> tuple[AdvantageResult, np.ndarray]:
        res, self.state = running_baseline(turn_batch_from_trajectories(live), self.live, self.state, self.weights)
        if self.live.train_constrained:
            return res, res.mask
        return res, res.mask & ~constrained_turns(live)
