"""Metrics of a trained batch: rewards, success, lengths, staleness. Pure."""

from __future__ import annotations

import numpy as np

from rollout.trajectory import Trajectory


def batch_metrics(trajs: list[Trajectory], staleness: list[int]) -> dict[str, float]:
    outcomes = [t.outcome for t in trajs if t.outcome is not None]
    turns = [len(t.turns) for t in trajs]
    return {
        "reward/outcome_mean": float(np.mean(outcomes)) if outcomes else float("nan"),
        "rollout/success_rate": float(np.mean([t.success for t in trajs])),
        "rollout/turns_mean": float(np.mean(turns)),
        "rollout/invalid_rate": float(np.mean([u.invalid_action for t in trajs for u in t.turns] or [0])),
        "rollout/error_rate": float(np.mean([t.error is not None for t in trajs])),
        "rollout/action_tokens": float(sum(t.num_action_tokens() for t in trajs)),
        "samples": float(len(trajs)),
        "live/trained_sessions": float(sum(t.live is not None for t in trajs)),
        "staleness/mean": float(np.mean(staleness)) if staleness else 0.0,
        "staleness/max": float(max(staleness)) if staleness else 0.0,
    }


def signal_metrics(trajs: list[Trajectory], advantages: np.ndarray, mask: np.ndarray) -> dict[str, float]:
    """How many of the batch's groups carry a learning signal. ``advantages`` and ``mask`` have
    one entry per turn row, the trajectories' turns in order (``turn_batch_from_trajectories``).

    ``groups/no_outcome_signal``: the share of groups whose outcomes are all equal (every
    rollout right, or every one wrong): outcome-only GRPO gives them zero advantage.
    ``groups/no_signal``: the share whose every trained turn has zero advantage under the run's
    own estimator: what turn-level credit (IG, PRM, matching, anchors) is meant to rescue."""
    if not trajs:
        return {}
    ends = np.cumsum([len(t.turns) for t in trajs])
    signal: dict[str, bool] = {}
    outcomes: dict[str, set[float | None]] = {}
    for traj, end in zip(trajs, ends):
        turns = slice(end - len(traj.turns), end)
        signal[traj.group_id] = signal.get(traj.group_id, False) or bool(np.any(advantages[turns][mask[turns]] != 0))
        outcomes.setdefault(traj.group_id, set()).add(traj.outcome)
    return {"groups/no_outcome_signal": float(np.mean([len(o) == 1 for o in outcomes.values()])),
            "groups/no_signal": float(np.mean([not s for s in signal.values()]))}
