"""Trajectory balance (Flow of Reasoning, a GFlowNet objective) over whole rollouts.

Per row ``i``: ``delta_i = log Z(x_i) + sum_t log P_F(a_t | s_t) - log R(x_i)`` and the loss is
``mean_i delta_i^2`` over rows with at least one action token. ``log P_B`` is 0: a token
sequence has exactly one parent state, so the backward policy is 1. The forward term sums
the current policy's log-probs over the row's action tokens and carries the gradient.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from learner.losses.config import TrajectoryBalanceConfig
from learner.losses.inputs import LossInputs, masked


class LogZ(nn.Module):
    """Learned log partition function per task id: a ``[num_tasks, 1]`` table."""

    def __init__(self, num_tasks: int, init: float = 0.0) -> None:
        super().__init__()
        self.table = nn.Embedding(num_tasks, 1)
        nn.init.constant_(self.table.weight, init)

    def forward(self, task_ids: Tensor) -> Tensor:
        """``[B]`` long -> ``[B]`` log Z of each row's task."""
        if task_ids.numel() and (int(task_ids.min()) < 0
                                 or int(task_ids.max()) >= self.table.num_embeddings):
            raise ValueError(f"task id outside [0, {self.table.num_embeddings}); raise "
                             "max_tasks or map task ids to dense codes")
        return self.table(task_ids).squeeze(-1)


def log_rewards(outcomes: Tensor, floor: float) -> Tensor:
    """``[B]`` log R(x) from each row's outcome reward R: ``log R`` where R > 0, ``floor``
    where R <= 0 or missing (NaN), since a GFlowNet reward must be positive."""
    safe = torch.where(outcomes > 0, outcomes, torch.ones_like(outcomes))
    return torch.where(outcomes > 0, torch.log(safe).clamp(min=floor), torch.full_like(outcomes, floor))


def make_log_z(cfg: TrajectoryBalanceConfig) -> LogZ | None:
    """The LogZ module the learner must own (and optimise) for ``cfg``, or None."""
    return LogZ(cfg.max_tasks, cfg.log_z_init) if cfg.log_z == "learned" else None


def _group_mean(x: Tensor, groups: Tensor | None, rows: Tensor) -> Tensor:
    """``[B]`` mean of ``x`` over the usable ``rows`` sharing each row's group (or all)."""
    xr = masked(x, rows)
    if groups is None:
        return (xr.sum() / rows.sum().clamp(min=1)).expand_as(x)
    uniq, inv = torch.unique(groups, return_inverse=True)
    sums = torch.zeros(len(uniq), dtype=x.dtype, device=x.device).index_add(0, inv, xr)
    counts = torch.zeros(len(uniq), dtype=x.dtype, device=x.device).index_add(
        0, inv, rows.to(x.dtype))
    return (sums / counts.clamp(min=1))[inv]


def trajectory_balance_loss(
    inputs: LossInputs, cfg: TrajectoryBalanceConfig, log_z: nn.Module | None = None
) -> tuple[Tensor, dict[str, float]]:
    """Trajectory-balance loss and metrics (tb_loss, log_z_mean, log_pf_mean,
    log_reward_mean, delta_abs_mean, loss).

    ``learned`` needs ``log_z`` (see ``make_log_z``) and ``task_ids``; ``batch_mean``
    replaces log Z by the mean of ``log R - sum log P_F`` over rows of the same task
    (``task_ids``) or of the batch. That mean is not detached: the gradient of
    ``sum (d_i - mean d)^2`` through the mean is zero anyway, so both forms agree.
    """
    if inputs.log_rewards is None:
        raise ValueError("trajectory balance needs log_rewards ([B]) in LossInputs")
    m = inputs.action_mask()
    dt = torch.promote_types(inputs.logprobs.dtype, torch.float32)
    log_pf = masked(inputs.logprobs, m, dtype=dt).sum(dim=-1)
    log_r = inputs.log_rewards.detach().to(dt).clamp(min=cfg.log_reward_floor)
    rows = m.any(dim=-1)
    if cfg.log_z == "learned":
        if log_z is None or inputs.task_ids is None:
            raise ValueError("log_z='learned' needs the LogZ module and task_ids; build it "
                             "with make_log_z(cfg) and optimise it with the policy")
        log_z_values = log_z(inputs.task_ids).to(dt)
    else:
        log_z_values = _group_mean(log_r - log_pf, inputs.task_ids, rows)
    delta = masked(log_z_values + log_pf - log_r, rows)
    loss = delta.square().sum() / rows.sum().clamp(min=1)
    with torch.no_grad():
        n = rows.sum().clamp(min=1)
        terms = {"tb_loss": loss, "log_z_mean": masked(log_z_values, rows).sum() / n,
                 "log_pf_mean": masked(log_pf, rows).sum() / n,
                 "log_reward_mean": masked(log_r, rows).sum() / n,
                 "delta_abs_mean": delta.abs().sum() / n, "loss": loss}
        values = torch.stack([v.detach().to(torch.float64) for v in terms.values()]).tolist()
    return loss, dict(zip(terms, values))
