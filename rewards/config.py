"""Reward configuration: which sources score a rollout, how, and how they are weighted.

Imports only pydantic (and the standard library's typing): no torch, no Ray, so the driver and
the CLI can validate a run's config without loading a model.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, model_validator

from rollout.config import PUSHED, refuse_removed

# Duplicated from rollout.trajectory.REWARD_SOURCES because config modules import only
# pydantic; tests/test_rewards_outcome.py checks the two stay equal.
REWARD_SOURCES: tuple[str, ...] = ("outcome", "ig", "prm", "match", "env")


class OutcomeConfig(BaseModel):
    """Final-answer reward (EM or F1 against the gold aliases)."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    metric: Literal["em", "f1"] = "em"
    """Which metric is the reward: exact match or bag-of-words token F1 (max over aliases)."""
    format_penalty: float = 0.0
    """Reward for a final turn with no answer or unbalanced tags (IGPO's F1 script: -2.0)."""
    weight: float = Field(default=1.0, ge=0.0)
    """Multiplier on this source when sources are combined."""


class IGConfig(BaseModel):
    """IGPO information-gain turn reward, scored with the behaviour policy."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    prefix: str = "<answer>"
    """Template text before the gold answer (the authors close the thinking block first)."""
    suffix: str = "</answer>"
    """Template text after the gold answer; its tokens are fed but never scored."""
    mode: Literal["prob_diff", "log_prob_diff"] = "prob_diff"
    """IG_t = exp(v_t) - exp(v_{t-1}) (paper) or v_t - v_{t-1}."""
    token_budget: int = Field(default=16384, ge=1)
    """Max padded tokens (rows x longest row) per batched forward pass of the IG scorer."""
    scorer: Literal["model", "engine"] = "model"
    """Where gold-answer log-probs come from. ``model``: the reward scorers' own copy of the
    policy, loaded with each trajectory's behaviour version (exact versions, one more model
    in memory per scorer). ``engine``: prompt log-probs from the rollout engines (vLLM's
    prompt log-probs; no model copy), on the version each engine serves when it scores; the
    recorded version says which, and mismatches are counted."""
    share_prefix: bool = True
    """Run each trajectory's context once and score all its boundaries against that KV cache
    (custom 4D mask); False scores one padded row per boundary (recomputes shared prefixes)."""
    keep_versions: int = Field(default=2, ge=1)
    """Published policy versions each scorer keeps (as object references) so a group generated
    by an older version is still scored with its own weights; a miss is counted."""
    weight: float = Field(default=1.0, ge=0.0)
    """Multiplier on IG relative to outcome; above ~0.5 has destabilised training in practice."""


class MatchConfig(BaseModel):
    """MatchTIR bipartite-matching turn reward over tool calls."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    mode: Literal["hungarian", "greedy", "sinkhorn"] = "hungarian"
    """Hard optimum (paper), the authors' greedy highest-first match, or soft Sinkhorn OT."""
    sinkhorn_reg: float = Field(default=0.1, gt=0.0)
    """Entropic regularisation of the soft assignment."""
    sinkhorn_iters: int = Field(default=1000, ge=1)
    """Maximum Sinkhorn iterations (POT's default; stops early once marginals match to 1e-9)."""
    unmatched_penalty: float = 0.0
    """Reward of a predicted call left unmatched by hard assignment (0 in the paper)."""
    no_call_reward: float = 0.0
    """Reward of a non-answer turn that made no tool call (nothing to match)."""
    weight: float = Field(default=1.0, ge=0.0)
    """Multiplier on this source when sources are combined."""


ProcessTransform = Literal["none", "clip", "delta"]

DEFAULT_RUBRIC = (
    "You grade one step of an agent that uses tools to answer a question. A good step moves "
    "toward the answer: it searches for an entity the question or earlier results name, calls "
    "the right tool with the right arguments, or gives the correct final answer. A bad step "
    "repeats itself, is malformed, or goes off topic."
)


class _ProcessRewardConfig(BaseModel):
    """Settings every process-reward source (model or judge) shares."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    transform: ProcessTransform = "none"
    """Guard against reward hacking: ``clip`` caps each turn at ``clip_bound`` after
    subtracting ``clip_shift``; ``delta`` uses r_t - r_{t+1}, so the sum telescopes."""
    clip_bound: float = 0.0
    """Cap of the ``clip`` transform (0: extra steps can only cost)."""
    clip_shift: float = 0.0
    """Subtracted before clipping (the paper's threshold eta)."""
    weight: float = Field(default=1.0, ge=0.0)
    """Multiplier on this source when sources are combined."""


class PRMTrainConfig(BaseModel):
    """``turnrl prm train``: labelled turns from the environment, then a short fine-tune."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    init_from: str = "policy"
    """Model the PRM starts from: ``policy`` (the run's resolved policy) or an HF path."""
    num_tasks: int = Field(default=200, ge=1)
    """Train tasks played into labelled episodes."""
    heldout_tasks: int = Field(default=40, ge=0)
    """Held-out tasks played the same way to report the PRM's AUC (0 skips evaluation)."""
    bad_step_rate: float = Field(default=0.8, ge=0.0, le=1.0)
    """Chance of inserting a wrong step (another task's action, a repeat, or text with no
    call) before each demonstration step; the environment labels every step."""
    epochs: int = Field(default=3, ge=1)
    """Passes over the labelled episodes."""
    batch_size: int = Field(default=8, ge=1)
    """Episodes per optimizer step (every turn of an episode is scored in one forward)."""
    lr: float = Field(default=5e-3, gt=0)
    """AdamW learning rate (constant after a short warm-up). The default suits the builtin
    tiny policy; billion-parameter models want about 1e-5."""
    seed: int = 0
    """Seed of the perturbations and of the episode order."""


class PRMConfig(_ProcessRewardConfig):
    """A process reward model read at the end of each turn's action."""

    type: Literal["model"] = "model"
    """Selects a trained PRM (``judge`` selects a generative judge)."""
    path: str
    """Hugging Face folder or hub id of the PRM; ``turnrl prm train`` writes it."""
    head: Literal["reward_tokens", "classification"] = "reward_tokens"
    """``reward_tokens``: a causal LM, P(good) = softmax over the logits of ``good_token``
    and ``bad_token`` at the turn's last action token. ``classification``: a token
    classification head with one output, P(good) = sigmoid."""
    good_token: str = "+"
    """Text of the single token whose logit means "good step"."""
    bad_token: str = "-"
    """Text of the single token whose logit means "bad step"."""
    token_budget: int = Field(default=16384, ge=1)
    """Max padded tokens (rows x longest row) per batched PRM forward pass."""
    train: PRMTrainConfig = PRMTrainConfig()
    """How ``turnrl prm train`` builds this PRM."""


class JudgeConfig(_ProcessRewardConfig):
    """A generative judge: an LLM prompted with a per-turn rubric, its score parsed."""

    type: Literal["judge"] = "judge"
    """Selects a generative judge."""
    backend: Literal["hf", "callable"] = "hf"
    """``hf``: a causal LM from ``path``, greedy. ``callable``: ``function`` is called with
    the prompt and returns the judgement text (e.g. an API client)."""
    path: str | None = None
    """Hugging Face folder or hub id of the judge model (backend ``hf``)."""
    function: str | None = None
    """``package.module:name`` of a callable ``(prompt: str) -> str`` (backend ``callable``)."""
    rubric: str = DEFAULT_RUBRIC
    """What a good turn is; the prompt asks for ``Score: <number>`` on this rubric."""
    score_min: float = 0.0
    """Lowest score the judge may give."""
    score_max: float = 10.0
    """Highest score the judge may give; scores are rescaled to [0, 1]."""
    retries: int = Field(default=1, ge=0, le=3)
    """Extra attempts after unparseable output, each with a format reminder."""
    max_new_tokens: int = Field(default=48, ge=1)
    """Most tokens one judgement may generate (backend ``hf``)."""
    max_context_chars: int = Field(default=4000, ge=100)
    """Trailing characters of the episode shown to the judge before the judged turn."""
    hindsight: bool = False
    """Also show the judge what followed the turn (the tool result or the user's next message,
    up to ``max_context_chars``), as OpenClaw-RL's judge does: a reply that shows the turn
    helped or failed is evidence the turn alone lacks. The last turn has nothing after it. On
    live sessions each turn is then judged as soon as its next state arrives (docs/live.md)."""
    queue_size: int = Field(default=256, ge=1)
    """Turns waiting for the judge; beyond it a turn's judgement is skipped (missing and
    flagged ``judge_queue_full``) so a slow judge never holds up generation."""
    timeout_s: float = Field(default=120.0, gt=0)
    """Longest a group waits for its judgements; later ones are missing (``judge_timeout``)."""
    num_workers: int = Field(default=1, ge=1)
    """Judge actors (each holds one copy of the judge model)."""
    batch_size: int = Field(default=8, ge=1)
    """Turns one judge actor judges per call."""

    @model_validator(mode="after")
    def _check_backend(self) -> "JudgeConfig":
        if self.backend == "hf" and not self.path:
            raise ValueError("judge backend 'hf' needs path: a Hugging Face folder or hub id")
        if self.backend == "callable" and (not self.function or ":" not in self.function):
            raise ValueError("judge backend 'callable' needs function: 'package.module:name'")
        if self.score_max <= self.score_min:
            raise ValueError(f"score_max ({self.score_max}) must exceed score_min ({self.score_min})")
        return self


ProcessRewardConfig = Annotated[Union[PRMConfig, JudgeConfig], Field(discriminator="type")]


class ServiceConfig(BaseModel):
    """The reward service: a front actor batching groups for a pool of model scorers."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    @model_validator(mode="before")
    @classmethod
    def _removed(cls, data: Any) -> Any:
        return refuse_removed(data, "rewards.service", {"weight_poll_s": f"model scorers no longer poll: {PUSHED}"})

    num_scorers: int = Field(default=1, ge=1)
    """Scorer actors for the model-based sources (IG, PRM); each holds its own models."""
    scorer_num_cpus: float = Field(default=0.25, ge=0)
    """Ray CPUs per scorer actor, counted when the run checks that its actors fit (0 lets it
    share the CPUs of the others; ``torch_threads`` still bounds what it uses)."""
    judge_num_cpus: float = Field(default=0.25, ge=0)
    """Ray CPUs per judge actor (0: share, as for scorers)."""
    torch_threads: int = Field(default=1, ge=1)
    """Intra-op threads per scorer or judge actor."""
    max_batch_trajectories: int = Field(default=64, ge=1)
    """Most trajectories (from any number of groups) sent to one scorer call."""
    batch_wait_ms: float = Field(default=20.0, ge=0)
    """How long the batcher waits for more groups before dispatching a batch."""
    queue_groups: int = Field(default=64, ge=1)
    """Groups waiting for model scoring; ``submit`` waits beyond it (backpressure)."""


class RewardsConfig(BaseModel):
    """All reward sources of a run and how the learner treats a failed one."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    outcome: OutcomeConfig = OutcomeConfig()
    """Final-answer reward; always on."""
    ig: IGConfig | None = None
    """Information-gain turn reward; None disables it."""
    match: MatchConfig | None = None
    """MatchTIR tool-call matching reward; None disables it."""
    prm: ProcessRewardConfig | None = None
    """Process reward: a trained PRM (``type: model``) or a generative judge
    (``type: judge``); None disables it."""
    service: ServiceConfig = ServiceConfig()
    """How the reward service is laid out and batches."""
    weights: dict[str, float] = {}
    """Per-source weights (outcome, ig, prm, match, env); override the sections' ``weight``."""
    unread: Literal["fail", "warn"] = "fail"
    """A configured source the chosen estimator does not read (a PRM under GRPO) would be
    scored every turn and thrown away: ``fail`` stops the run at start naming it; ``warn``
    only warns (e.g. to log a PRM's scores while training on the outcome). A source
    weighted 0 is taken as deliberately unused and never fails."""
    on_missing: Literal["mask_turn", "skip_group", "zero"] = "mask_turn"
    """What the learner does with a failed scorer's reward (None): mask the turn's loss, drop
    the whole group, or treat it as 0 (biased; for debugging)."""

    @model_validator(mode="after")
    def _check_weights(self) -> "RewardsConfig":
        for key, value in self.weights.items():
            if key not in REWARD_SOURCES:
                raise ValueError(
                    f"weights has unknown reward source {key!r}; use one of "
                    f"{', '.join(REWARD_SOURCES)}"
                )
            if value < 0:
                raise ValueError(f"weights[{key!r}] = {value} is negative; weights must be >= 0")
            section = getattr(self, key, None)
            if (
                isinstance(section, BaseModel)
                and "weight" in section.model_fields_set
                and section.weight != value
            ):
                raise ValueError(
                    f"weight of {key!r} set twice ({key}.weight = {section.weight}, "
                    f"weights[{key!r}] = {value}): set it in one place"
                )
        return self

    def enabled(self) -> list[str]:
        """Sources this config scores, in schema order (outcome and env are always on)."""
        return [s for s in REWARD_SOURCES
                if s in ("outcome", "env") or getattr(self, s, None) is not None]

    def weight(self, source: str) -> float:
        """Resolved weight: ``weights[source]``, else the section's ``weight``, else 1.0."""
        if source not in REWARD_SOURCES:
            raise KeyError(f"unknown reward source {source!r}; known: {', '.join(REWARD_SOURCES)}")
        if source in self.weights:
            return self.weights[source]
        section = getattr(self, source, None)
        return section.weight if isinstance(section, BaseModel) else 1.0

    def trained_weights(self) -> dict[str, float]:
        """The sources this run configured for training, with their resolved weights: the
        outcome, every section that is set (ig, match, prm), and every source named in
        ``weights`` (the way to add ``env`` to an estimator that does not read it already).
        The learner's estimator reads them (the learner is built with this config)."""
        named = [s for s in REWARD_SOURCES
                 if s == "outcome" or getattr(self, s, None) is not None or s in self.weights]
        return {s: self.weight(s) for s in named}

    def explicitly_weighted(self, source: str) -> bool:
        """The user set this source's weight (in ``weights`` or its section's ``weight``)."""
        section = getattr(self, source, None)
        return source in self.weights or (
            isinstance(section, BaseModel) and "weight" in section.model_fields_set)
