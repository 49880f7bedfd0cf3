"""Outcome reward: exact match, token F1 and the format penalty.

Owns the final-turn score every method shares (docs/rewards.md). Pure
functions on strings; no torch, Ray or I/O. Answer normalisation and exact match are the
environments' rule (``envs.base.normalize_answer``, ``exact_match``: SQuAD's, lowercase, drop
punctuation, drop the articles a/an/the, collapse whitespace), so a rollout's reward and its
environment's success verdict can never disagree on what matches.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Literal

from envs.base import exact_match, normalize_answer
from envs.formats import DEFAULT_FORMAT
from envs.toolcalls import parse_action


@dataclass
class OutcomeScore:
    """The outcome of one rollout: the reward that trains, plus both metrics for logging."""

    reward: float
    """EM or F1 (per ``metric``), or ``format_penalty`` when the answer is missing/malformed."""
    em: float
    """Exact match, max over gold aliases (0 when malformed)."""
    f1: float
    """Bag-of-words token F1, max over gold aliases (0 when malformed)."""
    well_formed: bool
    """An answer was present and the tags were balanced."""


def token_f1(prediction: str, gold: str) -> float:
    """Bag-of-words F1 between normalised token multisets.

    When either side normalises to no tokens, F1 is 1.0 if both are empty and 0.0 otherwise
    (SQuAD v2's rule), so an empty answer never scores against a non-empty gold.
    """
    pred_toks = normalize_answer(prediction).split()
    gold_toks = normalize_answer(gold).split()
    if not pred_toks or not gold_toks:
        return float(pred_toks == gold_toks)
    common = Counter(pred_toks) & Counter(gold_toks)
    num_same = sum(common.values())
    if num_same == 0:
        return 0.0
    precision = num_same / len(pred_toks)
    recall = num_same / len(gold_toks)
    return 2 * precision * recall / (precision + recall)


def outcome_reward(
    answer: str | None,
    gold_answers: list[str],
    *,
    metric: Literal["em", "f1"] = "em",
    format_penalty: float = 0.0,
    balanced: bool = True,
) -> OutcomeScore:
    """Score a final answer against all gold aliases.

    ``answer`` is the text inside the final turn's ``<answer>`` (None when there was none);
    ``balanced`` is whether that turn's tags paired up. A missing answer or unbalanced tags
    score ``format_penalty`` with em = f1 = 0. Otherwise EM (1.0 when the answer matches an
    alias, ``envs.base.exact_match``) and F1 are each the max over aliases
    (taken independently, as the reference scripts do) and ``reward`` is the one ``metric`` names.
    """
    if not gold_answers:
        raise ValueError(
            "outcome_reward needs at least one gold answer: give the task gold_answers, or "
            "disable the outcome source for tasks without one"
        )
    if metric not in ("em", "f1"):
        raise ValueError(f"metric must be 'em' or 'f1', got {metric!r}")
    if answer is None or not balanced:
        return OutcomeScore(reward=float(format_penalty), em=0.0, f1=0.0, well_formed=False)
    em = float(exact_match(answer, gold_answers))
    f1 = max(token_f1(answer, g) for g in gold_answers)
    return OutcomeScore(reward=em if metric == "em" else f1, em=em, f1=f1, well_formed=True)


def score_final_text(
    final_text: str,
    gold_answers: list[str],
    *,
    metric: Literal["em", "f1"] = "em",
    format_penalty: float = 0.0,
    chat_format: str = DEFAULT_FORMAT,
) -> OutcomeScore:
    """Parse the final turn's text in the policy's chat format (``rollout.chat_format``: where
    reasoning is split off, an answer inside it does not count), then ``outcome_reward`` it."""
    parsed = parse_action(final_text, chat_format)
    return outcome_reward(
        parsed.answer,
        gold_answers,
        metric=metric,
        format_penalty=format_penalty,
        balanced=parsed.balanced,
    )
