"""PPO-clip with truncated importance sampling, k3 KL and entropy bonus (to be minimised).

Per action token, with ``r = exp(logprobs - old_logprobs)`` and advantage ``A``::

    objective = min(r * A, clip(r, 1 - eps_low, 1 + eps_high) * A)
    loss_tok  = -w * objective,  w = min(pi_old / pi_behaviour, C)   (detached)

``w`` is per token, or per turn (exp of the mean log-ratio over the turn's tokens: the
geometric mean of its token ratios). Computation runs in at least float32, whatever the
input dtype, because bf16 ratios near 1 lose the differences PPO clips on.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from learner.losses.config import Aggregation, PPOLossConfig
from learner.losses.inputs import LossInputs, masked


def aggregate(x: Tensor, m: Tensor, mode: Aggregation) -> Tensor:
    """Reduce ``[B, L]`` per-token values to a scalar over the tokens where ``m``.

    ``token-mean``: sum / number of tokens. ``seq-mean-token-sum``: per-row sums averaged
    over rows. ``seq-mean-token-mean``: per-row means averaged over rows. Rows without
    tokens are left out of row averages; no tokens at all gives 0 (still differentiable).
    """
    x = masked(x, m)
    if mode == "token-mean":
        return x.sum() / m.sum().clamp(min=1)
    per_row_tokens = m.sum(dim=-1)
    per_row = x.sum(dim=-1)
    if mode == "seq-mean-token-mean":
        per_row = per_row / per_row_tokens.clamp(min=1)
    elif mode != "seq-mean-token-sum":
        raise ValueError(f"unknown aggregation {mode!r}; known: token-mean, "
                         "seq-mean-token-sum, seq-mean-token-mean")
    rows = (per_row_tokens > 0).sum().clamp(min=1)
    return per_row.sum() / rows  # empty rows hold 0 in per_row


def turn_mean(values: Tensor, m: Tensor, turn_ids: Tensor) -> Tensor:
    """``[B, L]`` -> ``[B, L]``: each action token gets the mean of ``values`` over the tokens
    of its turn (same ``turn_ids``); 0 outside ``m``."""
    ids = turn_ids[m]
    if ids.numel() and bool((ids < 0).any()):
        raise ValueError("turn_ids is -1 on an action token; give every action token the id "
                         "of its turn (turn-level TIS groups tokens by it)")
    uniq, inv = torch.unique(ids, return_inverse=True)
    vals = values[m]
    sums = torch.zeros(len(uniq), dtype=vals.dtype, device=vals.device).index_add_(0, inv, vals)
    counts = torch.zeros_like(sums).index_add_(0, inv, torch.ones_like(vals))
    out = torch.zeros_like(values)
    out[m] = (sums / counts)[inv]
    return out


def tis_weights(inputs: LossInputs, m: Tensor, cfg: PPOLossConfig, dtype: torch.dtype) -> Tensor:
    """``[B, L]`` detached importance weights ``min(pi_old / pi_behaviour, cap)``; 1 where
    TIS is off and outside ``m``."""
    if cfg.tis == "none":
        return torch.ones_like(m, dtype=dtype)
    with torch.no_grad():
        log_w = (masked(inputs.old_logprobs, m, dtype=dtype)
                 - masked(inputs.behaviour_logprobs, m, dtype=dtype))
        if cfg.tis == "turn":
            log_w = turn_mean(log_w, m, inputs.turn_ids)
        # Cap in log space: exp of a large log-ratio would overflow before min() applied.
        return torch.exp(log_w.clamp(max=math.log(cfg.tis_cap)))


def _epsilon(override: Tensor | None, default: float, m: Tensor, dtype: torch.dtype) -> Tensor:
    base = torch.full(m.shape, default, dtype=dtype, device=m.device)
    return base if override is None else torch.where(m, override.detach().to(dtype), base)


def k3_kl(logprobs: Tensor, ref_logprobs: Tensor) -> Tensor:
    """Low-variance KL estimate per token: ``exp(ref - lp) - (ref - lp) - 1`` (>= 0)."""
    d = ref_logprobs - logprobs
    return torch.exp(d) - d - 1.0


def ppo_loss(inputs: LossInputs, cfg: PPOLossConfig) -> tuple[Tensor, dict[str, float]]:
    """PPO-clip loss and metrics (clip_frac, ratio_mean, ratio_min, ratio_max, tis_mean,
    tis_capped_frac, pg_loss, kl, entropy, loss). Masked positions contribute exactly 0 to loss and grads."""
    m = inputs.action_mask()
    dt = torch.promote_types(inputs.logprobs.dtype, torch.float32)
    lp = masked(inputs.logprobs, m, dtype=dt)
    old = masked(inputs.old_logprobs.detach(), m, dtype=dt)
    adv = masked(inputs.advantages.detach(), m, dtype=dt)
    eps_low = _epsilon(inputs.clip_low, cfg.clip_low, m, dt)
    eps_high = _epsilon(inputs.clip_high, cfg.clip_high, m, dt)

    ratio = torch.exp(lp - old)
    clipped = torch.minimum(torch.maximum(ratio, 1.0 - eps_low), 1.0 + eps_high)
    surr, surr_clipped = ratio * adv, clipped * adv
    w = tis_weights(inputs, m, cfg, dt)
    pg_loss = aggregate(-w * torch.minimum(surr, surr_clipped), m, cfg.agg)
    loss = pg_loss

    terms: dict[str, Tensor] = {}
    if cfg.kl_coef > 0 and inputs.ref_logprobs is None:
        raise ValueError("kl_coef > 0 needs ref_logprobs in LossInputs")
    if inputs.ref_logprobs is not None:
        ref = masked(inputs.ref_logprobs.detach(), m, dtype=dt)
        kl = aggregate(k3_kl(lp, ref), m, cfg.agg)
        loss = loss + cfg.kl_coef * kl if cfg.kl_coef > 0 else loss
        terms["kl"] = kl
    if cfg.entropy_coef > 0 and inputs.entropy is None:
        raise ValueError("entropy_coef > 0 needs entropy in LossInputs")
    if inputs.entropy is not None:
        entropy = aggregate(masked(inputs.entropy, m, dtype=dt), m, cfg.agg)
        loss = loss - cfg.entropy_coef * entropy if cfg.entropy_coef > 0 else loss
        terms["entropy"] = entropy

    with torch.no_grad():
        n = m.sum().clamp(min=1)
        terms.update(
            clip_frac=((surr_clipped < surr) & m).sum() / n,
            ratio_mean=masked(ratio, m).sum() / n,
            ratio_min=ratio[m].min() if m.any() else torch.ones((), device=m.device),
            ratio_max=ratio[m].max() if m.any() else torch.ones((), device=m.device),
            tis_mean=masked(w, m).sum() / n,
            tis_capped_frac=((w >= cfg.tis_cap * (1 - 1e-6)) & m).sum() / n if cfg.tis != "none"
            else torch.zeros((), device=m.device),
            pg_loss=pg_loss, loss=loss)
        names = list(terms)
        values = torch.stack([terms[k].detach().to(torch.float64) for k in names]).tolist()
    return loss, dict(zip(names, values))
