"""The estimator registry, the fields each estimator needs, and the one entry point."""

from __future__ import annotations

from typing import Any, Callable, Mapping

import numpy as np

from learner.advantages.anchors import gigpo, hgpo
from learner.advantages.batch import AdvantageResult, TurnBatch
from learner.advantages.config import (
    A2TGPOConfig,
    EstimatorConfig,
    GiGPOConfig,
    GRPOConfig,
    HGPOConfig,
    IGPOConfig,
    MatchTIRConfig,
    PRMEstimatorConfig,
    RLOOConfig,
)
from learner.advantages.ig import a2tgpo, igpo, prm
from learner.advantages.matchtir import matchtir
from learner.advantages.outcome import grpo, rloo
from learner.advantages.sources import TURN_SOURCES, SourceWeights

# A new estimator is a config class in config.py, a pure function here, and a line below.
ESTIMATORS: dict[str, Callable[[TurnBatch, Any, SourceWeights], AdvantageResult]] = {
    "grpo": grpo,
    "rloo": rloo,
    "igpo": igpo,
    "a2tgpo": a2tgpo,
    "matchtir": matchtir,
    "prm": prm,
    "gigpo": gigpo,
    "hgpo": hgpo,
}


def required_fields(cfg: EstimatorConfig) -> set[str]:
    """Fields of the turn batch the estimator reads: ``outcome``, ``anchor`` and reward
    sources (``ig``, ``match``, ``env``). The run checks them at start-up against the
    reward stages it wires, so a missing one fails before any rollout."""
    if isinstance(cfg, (GRPOConfig, RLOOConfig)):
        return {"outcome"}
    if isinstance(cfg, (IGPOConfig, A2TGPOConfig)):
        return {"outcome", "ig"}
    if isinstance(cfg, PRMEstimatorConfig):
        return {"outcome", "prm"}
    if isinstance(cfg, MatchTIRConfig):
        return {"match", "outcome"} if cfg.final_turn_reward == "outcome" else {"match"}
    if isinstance(cfg, GiGPOConfig):
        return {"env", "anchor", "outcome"} if cfg.episode_return == "outcome" \
            else {"env", "anchor"}
    if isinstance(cfg, HGPOConfig):
        return {"env", "anchor"}
    raise ValueError(_unknown(cfg))


def uses_turn_rewards(cfg: EstimatorConfig) -> bool:
    """Whether the estimator takes turn rewards (and so every configured turn source)."""
    return not isinstance(cfg, (GRPOConfig, RLOOConfig))


def read_sources(cfg: EstimatorConfig, weights: Mapping[str, float] | None = None) -> set[str]:
    """Reward sources the estimator reads when the run configures ``weights`` (source ->
    weight, ``RewardsConfig.trained_weights()``): its required ones, plus every configured
    turn source if it uses turn rewards. Used at start to find configured sources that
    would be scored and thrown away, and by the learner to know which failures matter."""
    needed = required_fields(cfg) - {"anchor"}
    if uses_turn_rewards(cfg):
        needed |= {s for s in weights or {} if s in TURN_SOURCES}
    return needed


def source_weights(cfg: EstimatorConfig, weights: Mapping[str, float] | None) -> SourceWeights:
    """The weights and extra turn sources an estimator gets for the run's ``weights``."""
    primary = required_fields(cfg)
    extras = tuple(s for s in TURN_SOURCES if s in read_sources(cfg, weights) and s not in primary)
    return SourceWeights(weights=dict(weights or {}), extras=extras)


def missing_fields(batch: TurnBatch, cfg: EstimatorConfig) -> set[str]:
    """Required fields the batch does not carry at all (``anchor`` None, or no reward
    column for a source). Individual NaN values are not missing fields: they mask turns."""
    have = {"outcome", *batch.rewards}
    if batch.anchor is not None:
        have.add("anchor")
    return required_fields(cfg) - have


def _unknown(cfg: Any) -> str:
    name = getattr(cfg, "type", type(cfg).__name__)
    return f"unknown estimator {name!r}; known: {', '.join(sorted(ESTIMATORS))}"


def compute_advantages(batch: TurnBatch, cfg: EstimatorConfig,
                       weights: Mapping[str, float] | None = None) -> AdvantageResult:
    """Run the estimator named by ``cfg.type`` on ``batch``.

    ``weights`` are the run's reward sources and their weights (``RewardsConfig.
    trained_weights()``, which the learner is built with): the
    estimator weighs its sources by them and, if it uses turn rewards, adds the configured
    turn sources beyond its own (``sources.py``). None: its own sources at weight 1.

    Raises ValueError naming the estimator and the fields it needs when the batch lacks
    one, and FloatingPointError if an estimator ever produced a non-finite advantage.
    """
    fn = ESTIMATORS.get(getattr(cfg, "type", ""))
    if fn is None:
        raise ValueError(_unknown(cfg))
    sw = source_weights(cfg, weights)
    missing = missing_fields(batch, cfg) | (set(sw.extras) - set(batch.rewards))
    if missing:
        raise ValueError(
            f"estimator {cfg.type!r} needs field(s) {', '.join(sorted(missing))} which the "
            f"batch lacks (it needs {', '.join(sorted(required_fields(cfg) | set(sw.extras)))}); wire the "
            "reward stage that produces them or choose another estimator")
    result = fn(batch, cfg, sw)
    if not np.isfinite(result.advantages).all():
        raise FloatingPointError(f"estimator {cfg.type!r} produced a non-finite advantage")
    return result
