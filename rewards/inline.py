"""Scoring that needs no model: the outcome reward and MatchTIR matching, per trajectory.

Runs inline in the reward service's front actor (microseconds per trajectory). The outcome
goes on the final turn; an episode that errored gets no outcome (``None``, flagged), which the
learner masks rather than reading as zero. Matching runs after the outcome because the answer
turn's match reward is the answer F1 the outcome stage computes.
"""

from __future__ import annotations

from envs.formats import DEFAULT_FORMAT
from rewards.combine import failed, ig_gold, match_result, write_source
from rewards.config import RewardsConfig
from rewards.outcome import score_final_text
from rollout.trajectory import AnswerScore, Trajectory


def score_outcome(traj: Trajectory, cfg: RewardsConfig, chat_format: str = DEFAULT_FORMAT) -> None:
    """Set ``traj.outcome`` and the final turn's ``outcome`` slot in place (``set_outcome``);
    the final text is read in the policy's ``chat_format``."""
    if traj.error is not None or not traj.turns:
        traj.set_outcome(None)
    elif traj.env_outcome is not None:  # the environment grades its own episodes
        traj.set_outcome(traj.env_outcome)
    elif traj.gold_answers:
        score = score_final_text(
            traj.turns[-1].text, traj.gold_answers,
            metric=cfg.outcome.metric, format_penalty=cfg.outcome.format_penalty, chat_format=chat_format,
        )
        traj.set_outcome(score.reward)
        traj.answer_score = AnswerScore(em=score.em, f1=score.f1, well_formed=score.well_formed)
    else:  # environments without gold answers define success themselves
        traj.set_outcome(float(traj.success))
    if traj.turns and traj.outcome is None:
        write_source(traj, "outcome", failed([len(traj.turns) - 1],
                                             f"episode error: {(traj.error or '')[:200]}"))


def inapplicable_sources(traj: Trajectory, cfg: RewardsConfig) -> set[str]:
    """Configured sources that cannot score this trajectory: only live ones lack what a task
    carries (a client that sent no outcome, no gold answer for IG, no gold calls for
    matching). They are skipped and counted, never written as zero or as a failure."""
    if traj.live is None:
        return set()
    skip = set() if traj.outcome is not None else {"outcome"}
    if cfg.ig is not None and ig_gold(traj) is None:
        skip.add("ig")
    if cfg.match is not None and not traj.gold_tool_calls:
        skip.add("match")
    return skip


def score_cheap(traj: Trajectory, cfg: RewardsConfig, chat_format: str = DEFAULT_FORMAT) -> None:
    """Outcome, then (when configured) MatchTIR turn rewards, written into the turns. A live
    trajectory's outcome is the client's (set by its feedback), never re-scored."""
    if traj.live is None:
        score_outcome(traj, cfg, chat_format)
    if cfg.match is not None and traj.turns and "match" not in inapplicable_sources(traj, cfg):
        try:
            result = match_result(traj, cfg.match)
        except Exception as exc:  # noqa: BLE001 - a scorer error leaves the reward missing
            result = failed(range(len(traj.turns)), f"match: {type(exc).__name__}: {exc}")
        write_source(traj, "match", result)
