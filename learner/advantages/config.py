"""Advantage estimator configs: one class per estimator, a union discriminated on ``type``.

Imports only pydantic (the driver and CLI import configs; they must not pay for numpy/torch).
Defaults follow each method's paper; where the paper is silent they follow the authors'
code, and the other convention is an option. docs/advantages.md states the semantics, the
authors' variants, and cites the papers and the authors' public repositories.
"""

from __future__ import annotations

from typing import Annotated, Literal, Union

from pydantic import BaseModel, ConfigDict, Field

StdKind = Literal["population", "unbiased"]
Singleton = Literal["zero", "raw"]
NormMode = Literal["mean_std_norm", "mean_norm"]


class _EstimatorConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)


class GRPOConfig(_EstimatorConfig):
    """GRPO: the rollout's outcome z-scored among the rollouts of its group, on every turn."""

    type: Literal["grpo"] = "grpo"
    """Registry key."""
    scale_by_std: bool = True
    """Divide by the group std (GRPO). False subtracts the group mean only (Dr.GRPO)."""
    std: StdKind = "unbiased"
    """Std estimator. The paper does not say; verl and TRL use unbiased ``torch.std``."""
    eps: float = Field(1e-6, ge=0.0)
    """Added to the std before dividing (verl's 1e-6)."""
    singleton: Singleton = "zero"
    """A group with one usable rollout: ``zero`` (the z-score's numerator is 0) or ``raw``
    (verl: mean 0, std 1, so the outcome itself)."""
    stats: Literal["per_rollout", "per_step"] = "per_rollout"
    """Group statistics over the group's rollouts, one value each (so a long rollout does
    not weigh more in the baseline), or over its step rows, each carrying its rollout's
    outcome: verl-agent's multi-turn GRPO, which weights long rollouts more. ``per_step``
    reproduces verl-agent runs; ``singleton`` then applies to a group of one row."""


class RLOOConfig(_EstimatorConfig):
    """RLOO: outcome minus the mean outcome of the other rollouts of the group."""

    type: Literal["rloo"] = "rloo"
    """Registry key."""
    singleton: Singleton = "zero"
    """A group with one usable rollout has no leave-one-out baseline: ``zero`` gives 0,
    ``raw`` gives the outcome itself."""


class IGPOConfig(_EstimatorConfig):
    """IGPO: IG rewards on turns 1..T-1, outcome on the final turn, z-scored within the
    group, then accumulated backwards ``A_t = r~_t + gamma * A_{t+1}``."""

    type: Literal["igpo"] = "igpo"
    """Registry key."""
    normalisation: Literal["joint", "separate"] = "joint"
    """``joint``: one pool per group holding every IG reward and every outcome (the paper's
    single reward set R). ``separate``: IG rewards (all turns pooled) and outcomes are
    z-scored in two pools per group."""
    gamma: float = Field(1.0, ge=0.0, le=1.0)
    """Discount of the backward accumulation (1.0 in the released script)."""
    ig_weight: float = Field(1.0, ge=0.0)
    """Multiplies the normalised IG rewards (not the outcome). Above ~0.5 has been reported to
    destabilise training; 1.0 matches the paper."""
    std: StdKind = "population"
    """Std estimator of the pools (population in the authors' code)."""
    var_floor: float = Field(1e-8, ge=0.0)
    """Added to each pool's variance before the square root: ``std = sqrt(var + var_floor)``,
    the authors' corrected release (1e-8). It matters when a pool's spread is small: IG values
    0.1 and 0.1001 z-score to +-0.45 with it and +-0.98 without. 0 gives ``sqrt(var)``."""
    eps: float = Field(1e-6, ge=0.0)
    """Added to the std before dividing: ``(x - mean) / (sqrt(var + var_floor) + eps)``. The
    authors' corrected release adds ``epsilon = 1e-6`` (``compute_grpo_outcome_advantage``
    in their core_algos.py) on top of the variance floor."""
    singleton: Singleton = "zero"
    """A pool of one reward: ``zero`` (the authors' std := 1 leaves x - mean = 0) or ``raw``."""


class A2TGPOConfig(_EstimatorConfig):
    """A^2TGPO: IG z-scored within (group, turn index), accumulated and divided by
    sqrt(number of terms), with a per-turn clip range modulated by the normalised IG."""

    type: Literal["a2tgpo"] = "a2tgpo"
    """Registry key."""
    gamma: float = Field(1.0, ge=0.0, le=1.0)
    """Discount of the backward accumulation."""
    ig_weight: float = Field(1.0, ge=0.0)
    """Multiplies the normalised IG rewards (not the outcome)."""
    outcome_pool: Literal["group", "turn"] = "group"
    """Where the final turn's outcome is normalised: ``group`` (among the group's rollouts,
    as GRPO) or ``turn`` (in the (group, turn index) pool with other rollouts' IG there)."""
    sqrt_scaling: bool = True
    """Divide the accumulated sum by sqrt of the number of summed (unmasked) terms."""
    clip_low: float = Field(0.2, ge=0.0)
    """Base PPO epsilon below 1 that the per-turn factor scales; keep equal to the loss's."""
    clip_high: float = Field(0.2, ge=0.0)
    """Base PPO epsilon above 1 that the per-turn factor scales; keep equal to the loss's."""
    clip_beta: float = Field(0.3, ge=0.0, lt=1.0)
    """Per-turn factor ``c = 1 + beta * (2 * sigmoid(r~_t) - 1)`` in (1 - beta, 1 + beta):
    wider clipping for informative turns, narrower for uninformative ones. 0 disables."""
    std: StdKind = "population"
    """Std estimator of the pools."""
    eps: float = Field(1e-6, ge=0.0)
    """Added to the std before dividing."""
    singleton: Singleton = "zero"
    """A (group, turn index) pool of one turn: ``zero`` or ``raw``."""


class MatchTIRConfig(_EstimatorConfig):
    """MatchTIR dual-level: ``(A_traj + A_turn) / 2`` from matching turn rewards."""

    type: Literal["matchtir"] = "matchtir"
    """Registry key."""
    gamma: float = Field(0.9, ge=0.0, le=1.0)
    """Discount of the turn-level return ``G_t = r_t + gamma * G_{t+1}``."""
    final_turn_reward: Literal["outcome", "match"] = "outcome"
    """Reward of the final (answer) turn: the outcome (answer F1) or its ``match`` reward."""
    scale_traj_by_std: bool = True
    """Divide the trajectory-level term by the group std (the code's norm_adv_by_std)."""
    std: StdKind = "unbiased"
    """Std estimator at both levels (unbiased ``torch.std`` in the authors' code)."""
    eps: float = Field(1e-6, ge=0.0)
    """Added to the std before dividing."""
    singleton: Singleton = "zero"
    """A pool of one (a lone rollout in its group, or the only rollout reaching a turn
    index): ``zero`` (the z-score formula) or ``raw`` (the authors' code leaves G_t, or the
    trajectory sum, un-normalised there)."""


class PRMEstimatorConfig(_EstimatorConfig):
    """Process rewards as turn rewards with the outcome at the end, critic-free: each PRM
    score z-scored among all turns of its group, the outcome among the group's rollouts and
    placed on the final turn, then ``A_t = r~_t + gamma * A_{t+1}`` (DeepSeekMath's process
    supervision GRPO, on the per-turn PRM rewards of Lightman et al. / Gao et al.)."""

    type: Literal["prm"] = "prm"
    """Registry key."""
    gamma: float = Field(1.0, ge=0.0, le=1.0)
    """Discount of the backward accumulation (1: each turn gets the sum of what follows)."""
    std: StdKind = "population"
    """Std estimator of the pools."""
    eps: float = Field(1e-6, ge=0.0)
    """Added to the std before dividing."""
    singleton: Singleton = "zero"
    """A pool of one value (a lone rollout, or one scored turn in a group): ``zero`` or
    ``raw``."""


class GiGPOConfig(_EstimatorConfig):
    """GiGPO: ``A = A_E + step_weight * A_S``; episode level over the group, step level over
    the group's steps sharing an anchor observation."""

    type: Literal["gigpo"] = "gigpo"
    """Registry key."""
    mode: NormMode = "mean_std_norm"
    """``mean_std_norm`` z-scores both levels; ``mean_norm`` subtracts the mean only
    (verl-agent's default)."""
    step_weight: float = Field(1.0, ge=0.0)
    """Weight w of the step-level advantage."""
    gamma: float = Field(0.95, ge=0.0, le=1.0)
    """Discount of the step return ``R_t = r_t + gamma * R_{t+1}`` on env rewards."""
    invalid_penalty: float = Field(0.1, ge=0.0)
    """Charged for a turn whose action was invalid (set 0 if the environment already charges
    it); where it is charged is ``invalid_penalty_on``."""
    invalid_penalty_on: Literal["env_reward", "step_row"] = "env_reward"
    """``env_reward`` (default): subtracted from the turn's env reward before returns are
    computed, so, like any reward, it lowers the rollout's episode return (on every row) and
    is discounted into the returns of earlier steps, which led to the invalid action.
    ``step_row`` (verl-agent): subtracted only from the invalid step's own row, from its
    episode score and from its already-discounted return; other rows never see it."""
    episode_return: Literal["env_sum", "outcome"] = "env_sum"
    """Episode return: the undiscounted sum of env rewards, or the outcome reward."""
    episode_stats: Literal["per_rollout", "per_step"] = "per_rollout"
    """Episode statistics over the group's rollouts (the paper) or over its steps, which
    weights long rollouts more (verl-agent's compute_mean_std_cross_steps)."""
    std: StdKind = "unbiased"
    """Std estimator at both levels (unbiased ``torch.std`` in verl-agent)."""
    eps: float = Field(1e-6, ge=0.0)
    """Added to the std before dividing."""
    singleton: Singleton = "zero"
    """Episode level, a group with one usable rollout: ``zero`` or ``raw`` (verl-agent).
    A step-level singleton (an anchor seen once) is always 0, in paper and code."""


class HGPOConfig(_EstimatorConfig):
    """HGPO: weighted average of z-scored step returns over groups sharing the last k
    anchor observations, k = 1..K+1."""

    type: Literal["hgpo"] = "hgpo"
    """Registry key."""
    history: int = Field(2, ge=0)
    """K, the history length: levels k = 1..K+1 (the paper uses 2 or 4)."""
    alpha: float = Field(1.0, ge=0.0)
    """Exponent of the level weights."""
    weight_indexing: Literal["paper", "code"] = "paper"
    """``paper``: level k weighs k^alpha (1:2:3 for K=2); ``code``: (k+1)^alpha (2:3:4)."""
    mode: NormMode = "mean_std_norm"
    """``mean_std_norm`` z-scores each level group; ``mean_norm`` subtracts the mean only."""
    gamma: float = Field(0.95, ge=0.0, le=1.0)
    """Discount of the step return on env rewards."""
    invalid_penalty: float = Field(0.1, ge=0.0)
    """Subtracted from a turn's env reward when its action was invalid."""
    std: StdKind = "population"
    """Std estimator of the level groups (population in the authors' code)."""
    eps: float = Field(1e-6, ge=0.0)
    """Added to the std before dividing."""


EstimatorConfig = Annotated[
    Union[GRPOConfig, RLOOConfig, IGPOConfig, A2TGPOConfig, MatchTIRConfig, PRMEstimatorConfig,
          GiGPOConfig, HGPOConfig],
    Field(discriminator="type"),
]

ESTIMATOR_CONFIGS: dict[str, type[BaseModel]] = {
    cls.model_fields["type"].default: cls
    for cls in (GRPOConfig, RLOOConfig, IGPOConfig, A2TGPOConfig, MatchTIRConfig,
                PRMEstimatorConfig, GiGPOConfig, HGPOConfig)
}
"""Config class per estimator name, for tools that build a config from a name."""


class LiveBaselineConfig(BaseModel):
    """Live sessions' estimator (``learner/advantages/live.py``): each reward source's value
    minus a running baseline over earlier live sessions, accumulated backward over turns."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    decay: float = Field(0.9, gt=0.0, lt=1.0)
    """EMA decay of each source's baseline, per value (0.9: about the last 10 sessions)."""
    gamma: float = Field(1.0, ge=0.0, le=1.0)
    """Discount of the backward accumulation over a session's turns (1: every earlier turn
    gets the full outcome, as GRPO's broadcast does)."""
    var_floor: float = Field(0.01, ge=0.0)
    """Smallest variance divided by, so a source whose history barely varies is not
    stretched (0.01 on [0, 1] rewards: at most 10x)."""
    train_constrained: bool = False
    """Train on turns sampled from a reshaped distribution (``LiveOrigin.constrained``): a
    grammar (``tool_choice`` required or named, ``strict`` tools, ``response_format``) or the
    request's ``logit_bias`` or presence/frequency penalties. Their recorded log-probs are that
    reshaped distribution's, so they are not samples of the policy itself (the importance ratio
    cannot correct for tokens the mask forbade). False: they stay in the context, out of the loss."""
