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
