"""What the learner hands a policy loss: padded ``[B, L]`` token tensors plus row tensors."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass
class LossInputs:
    """Tensors of one micro-batch; ``B`` rows (a trajectory, or one context of a windowed one),
    ``L`` token positions.

    Position ``j`` holds quantities of the token predicted at ``j`` (next-token alignment is
    the learner's job). Values where ``mask`` is 0 are never read into the loss and may be
    anything, NaN included.
    """

    logprobs: Tensor
    """``[B, L]`` log-probs of the tokens under the current policy; requires grad."""
    old_logprobs: Tensor
    """``[B, L]`` under the learner policy before this update (no grad)."""
    behaviour_logprobs: Tensor
    """``[B, L]`` recorded by the rollout engine that sampled the tokens."""
    advantages: Tensor
    """``[B, L]`` the turn's advantage broadcast to its action tokens."""
    mask: Tensor
    """``[B, L]`` float, 1 on action tokens, 0 on prompt, observation and padding."""
    turn_ids: Tensor
    """``[B, L]`` long, a global id per (row, turn), -1 where mask is 0."""
    clip_low: Tensor | None = None
    """``[B, L]`` per-token epsilon below 1 (a2tgpo); None uses the config's."""
    clip_high: Tensor | None = None
    """``[B, L]`` per-token epsilon above 1; None uses the config's."""
    ref_logprobs: Tensor | None = None
    """``[B, L]`` under the frozen reference policy, for the KL term."""
    entropy: Tensor | None = None
    """``[B, L]`` entropy of the current policy's next-token distribution, for the bonus."""
    task_ids: Tensor | None = None
    """``[B]`` long task codes, for trajectory balance's log Z."""
    log_rewards: Tensor | None = None
    """``[B]`` log R(x) of each row, for trajectory balance."""

    def action_mask(self) -> Tensor:
        """``[B, L]`` bool mask of action tokens."""
        return self.mask > 0


def masked(x: Tensor, m: Tensor, fill: float = 0.0, dtype: torch.dtype | None = None) -> Tensor:
    """``x`` where ``m`` else ``fill``, via torch.where so NaN/inf outside ``m`` cannot leak
    into values or gradients (multiplying by a 0 mask would give NaN * 0 = NaN)."""
    x = x if dtype is None else x.to(dtype)
    return torch.where(m, x, torch.full_like(x, fill))
