"""Per-source turn rewards: one result per (trajectory, source), written without mixing.

Each source's values stay in their own slot of ``Turn.rewards`` (outcome, ig, prm, match, env)
so estimators can normalise them separately; ``combined_turn_reward`` is the weighted sum for
consumers that want one number. A failed scorer writes ``None`` on the turns it should have
scored and a flag in ``traj.reward_errors``: never a silent zero. Pure functions on
the schema; no torch, Ray or I/O.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

from rewards.config import JudgeConfig, MatchConfig, PRMConfig
from rewards.matching import match_turn_rewards
from rewards.prm_transforms import apply_prm_transform
from rollout.trajectory import Trajectory


@dataclass
class SourceResult:
    """One source's rewards for one trajectory."""

    values: dict[int, float | None]
    """Turn index -> reward; None = the scorer failed there. Turns absent here get no slot
    (e.g. IG never scores the final turn)."""
    versions: dict[int, int] = field(default_factory=dict)
    """Turn index -> weights version used (model-based sources)."""
    error: str | None = None
    """Why the None values are missing, recorded as a flag on the trajectory."""
    extra: dict[str, Any] = field(default_factory=dict)
    """Kept in ``traj.reward_details[source]`` (raw judgements, untransformed PRM)."""


def failed(turns: range | list[int], error: str) -> SourceResult:
    """Every listed turn missing, with the reason."""
    return SourceResult(values={t: None for t in turns}, error=error)


def ig_gold(traj: Trajectory) -> str | None:
    """The gold answer IG scores ``traj`` against (its first alias); None: it has none, so IG
    cannot score it (a scheduled rollout's IG is then ``ig_without_gold``; a live session's
    is skipped, ``rewards.inline.inapplicable_sources``)."""
    return traj.gold_answers[0] if traj.gold_answers else None


def ig_without_gold(traj: Trajectory) -> SourceResult:
    """IG of a trajectory without a gold answer: every boundary (turns 0..T-2) missing, flagged."""
    return failed(range(len(traj.turns) - 1), "IG needs gold_answers")


def write_source(traj: Trajectory, source: str, result: SourceResult) -> int:
    """Write ``result`` into the turns; returns how many values are missing (None)."""
    for t, value in result.values.items():
        traj.turns[t].rewards[source] = value
        if t in result.versions:
            traj.turns[t].reward_versions[source] = result.versions[t]
    missing = sum(v is None for v in result.values.values())
    if missing:
        turns = [t for t, v in result.values.items() if v is None]
        traj.reward_errors.append({"source": source, "turns": turns, "error": result.error or "missing"})
    if result.extra:
        traj.reward_details[source] = result.extra
    return missing


def match_result(traj: Trajectory, cfg: MatchConfig) -> SourceResult:
    """MatchTIR turn rewards: mean over each turn's calls; the answer turn gets answer F1.

    F1 comes from the outcome stage (``traj.answer_score``); a rollout that gave no answer has
    no answer turn, so its final turn is matched like the others, and so is the final turn of
    one whose task has no gold answer to score F1 against (its success is the environment's,
    e.g. BFCL, whose one-decision episodes end with the turn that makes the calls).
    """
    n = len(traj.turns)
    if traj.gold_tool_calls is None:
        return failed(range(n), "no gold_tool_calls to match against")
    answered = traj.finish_reason == "answer" and traj.answer is not None
    f1 = traj.answer_score.f1 if answered and traj.answer_score is not None else None
    values = match_turn_rewards(
        [t.tool_calls for t in traj.turns], traj.gold_tool_calls, mode=cfg.mode, answer_f1=f1,
        unmatched_penalty=cfg.unmatched_penalty, no_call_reward=cfg.no_call_reward,
        sinkhorn_reg=cfg.sinkhorn_reg, sinkhorn_iters=cfg.sinkhorn_iters,
    )
    return SourceResult(values=dict(enumerate(values)))


def process_result(
    raw: list[float | None], cfg: PRMConfig | JudgeConfig, version: int | None,
    extra: Mapping[str, Any] | None = None, error: str | None = None,
) -> SourceResult:
    """PRM or judge scores per turn, through the configured anti-hacking transform."""
    kwargs = {"bound": cfg.clip_bound, "shift": cfg.clip_shift} if cfg.transform == "clip" else {}
    values = apply_prm_transform(cfg.transform, raw, **kwargs)
    detail = dict(extra or {})
    if cfg.transform != "none":
        detail["raw"] = list(raw)
    versions = {} if version is None else {t: version for t, v in enumerate(values)}
    if error is None and any(v is None for v in values):
        error = "process reward missing on some turns"
    return SourceResult(values=dict(enumerate(values)), versions=versions, error=error,
                        extra=detail)


def combined_turn_reward(rewards: Mapping[str, float | None],
                         weights: Mapping[str, float]) -> float | None:
    """sum_s w_s * r_s over the sources present on the turn; None if any of them is missing."""
    total = 0.0
    for source, value in rewards.items():
        if value is None:
            return None
        total += weights.get(source, 1.0) * value
    return total


def missing_counts(traj: Trajectory) -> dict[str, int]:
    """Missing (None) values per source on this trajectory."""
    out: dict[str, int] = {}
    for turn in traj.turns:
        for source, value in turn.rewards.items():
            if value is None:
                out[source] = out.get(source, 0) + 1
    return out
