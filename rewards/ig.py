"""IGPO information gain: the pure maths on per-token log-probabilities.

Owns (docs/rewards.md, "IG (IGPO)"): rendering the answer template and locating the gold answer's
tokens in it by character offsets; v = mean log-prob over those tokens; IG_t from v_0..v_{T-1}.
No model here: ``rewards.ig_scorer`` runs the forward passes and calls these. numpy only.

Gold-span policy: a template token belongs to the gold span when its character range overlaps
the gold answer's characters at all. A BPE token that merges prefix and answer characters
(e.g. " Paris" after a prefix ending in a space) is therefore scored, whereas counting the
prefix's own tokens would be off by one.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal, Sequence

import numpy as np

IGMode = Literal["prob_diff", "log_prob_diff"]


@dataclass
class AnswerTemplate:
    """The pseudo-response appended after a context: prefix + gold + suffix, tokenized once."""

    text: str
    """Rendered template text."""
    ids: list[int]
    """Its token ids (no special tokens), appended verbatim after the rollout's ids."""
    gold_positions: list[int]
    """Indices into ``ids`` of the tokens that overlap the gold answer's characters."""


@dataclass
class IGResult:
    """IG of one trajectory: values for boundaries 0..T-1 and gains for turns 1..T-1."""

    trajectory_id: str
    values: list[float]
    """v_0..v_{T-1}: mean gold log-prob after the prompt (v_0) and after each turn but the last."""
    ig: list[float]
    """IG_1..IG_{T-1}; the final turn's reward is the outcome, set by the caller."""
    version: int
    """Weights version of the scorer (should be the behaviour policy's)."""
    mode: IGMode = "prob_diff"
    gold_token_count: int = 0
    """Number of template tokens averaged into each v_t."""


def render_template(prefix: str, gold: str, suffix: str) -> tuple[str, int, int]:
    """Template text and the gold answer's character span [start, end) in it."""
    start = len(prefix)
    return prefix + gold + suffix, start, start + len(gold)


def overlapping_tokens(offsets: Sequence[tuple[int, int]], start: int, end: int) -> list[int]:
    """Indices of tokens whose character range [s, e) overlaps [start, end).

    Zero-width tokens (special tokens report (0, 0)) never overlap.
    """
    return [i for i, (s, e) in enumerate(offsets) if s < end and e > start and e > s]


def build_template(tokenizer, prefix: str, gold: str, suffix: str) -> AnswerTemplate:
    """Tokenize prefix+gold+suffix in one piece and find the gold tokens by offset mapping.

    ``tokenizer`` must be a fast (Rust-backed) Hugging Face tokenizer: only those return
    offsets. Tokenizing in one piece matters: BPE merges across the prefix/answer boundary.
    """
    if not getattr(tokenizer, "is_fast", False):
        raise ValueError(
            "IG needs a fast tokenizer for return_offsets_mapping; load it with "
            "AutoTokenizer.from_pretrained(..., use_fast=True)"
        )
    if not gold:
        raise ValueError("IG needs a non-empty gold answer (the first gold alias is used)")
    text, start, end = render_template(prefix, gold, suffix)
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    positions = overlapping_tokens(enc["offset_mapping"], start, end)
    if not positions:
        raise ValueError(f"no token of the template {text!r} overlaps the gold answer {gold!r}")
    return AnswerTemplate(text=text, ids=list(enc["input_ids"]), gold_positions=positions)


def mean_gold_logprob(token_logprobs: Sequence[float]) -> float:
    """v: the mean of the gold tokens' log-probs (each teacher forced on all before it)."""
    if len(token_logprobs) == 0:
        raise ValueError("no gold-token log-probs to average")
    return float(np.mean(np.asarray(token_logprobs, dtype=np.float64)))


def information_gain(values: Sequence[float], mode: IGMode = "prob_diff") -> list[float]:
    """IG_t for t = 1..len(values)-1 from v_0..v_{T-1}.

    prob_diff (the paper): exp(v_t) - exp(v_{t-1}), the change in the geometric-mean
    probability of the gold answer. log_prob_diff: v_t - v_{t-1}.
    """
    if mode == "prob_diff":
        probs = [math.exp(v) for v in values]
        return [probs[t] - probs[t - 1] for t in range(1, len(probs))]
    if mode == "log_prob_diff":
        return [values[t] - values[t - 1] for t in range(1, len(values))]
    raise ValueError(f"unknown IG mode {mode!r}; known: log_prob_diff, prob_diff")
