"""Guards against PRM reward hacking: the "clip" and "delta" per-turn transforms.

Owns the pure post-processing of one rollout's process-reward sequence (docs/rewards.md,
"PRM"; from "On Designing Effective RL Reward at Training Time for LLM Reasoning").
Learned process rewards are hacked by repeating good-looking steps; both transforms remove the
incentive. ``None`` marks a failed scorer and propagates, never becoming a number.
"""

from __future__ import annotations

from typing import Callable, Sequence

TurnRewards = Sequence[float | None]


def clip_transform(
    rewards: TurnRewards, *, bound: float = 0.0, shift: float = 0.0
) -> list[float | None]:
    """r_t -> min(r_t - shift, bound).

    With the defaults every turn's reward is capped at 0, so extra steps can only cost, never
    pay. The paper's thresholded form min(r - eta, 0) is ``shift=eta``.
    """
    return [None if r is None else min(r - shift, bound) for r in rewards]


def delta_transform(rewards: TurnRewards) -> list[float | None]:
    """r_t -> r_t - r_{t+1} for t < T; the last turn keeps r_T.

    The sum over turns telescopes to r_1, so repeating a good step adds nothing. A delta that
    touches a failed (None) reward is itself None.
    """
    out: list[float | None] = []
    for t, r in enumerate(rewards):
        if t == len(rewards) - 1:
            out.append(r)
        else:
            nxt = rewards[t + 1]
            out.append(None if r is None or nxt is None else r - nxt)
    return out


def identity_transform(rewards: TurnRewards) -> list[float | None]:
    """No transform (the raw PRM scores)."""
    return list(rewards)


PRM_TRANSFORMS: dict[str, Callable[..., list[float | None]]] = {
    "none": identity_transform,
    "clip": clip_transform,
    "delta": delta_transform,
}


def apply_prm_transform(name: str, rewards: TurnRewards, **kwargs: float) -> list[float | None]:
    """Look ``name`` up in ``PRM_TRANSFORMS`` and apply it; unknown names list the known ones."""
    try:
        fn = PRM_TRANSFORMS[name]
    except KeyError:
        raise ValueError(
            f"unknown PRM transform {name!r}; known: {', '.join(sorted(PRM_TRANSFORMS))}"
        ) from None
    return fn(rewards, **kwargs)
