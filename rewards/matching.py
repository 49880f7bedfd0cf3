"""MatchTIR turn rewards: bipartite matching of predicted tool calls against gold calls.

Owns the pure maths of MatchTIR (docs/advantages.md, "Sources"): call similarity, the hard
assignment (optimal Hungarian by default, the authors' greedy highest-first rule as an
option), the soft assignment (log-domain Sinkhorn) and the per-turn reward. numpy/scipy
only; no torch, Ray or I/O.

Matching runs over the whole trajectory (call order and turn are ignored), then each turn's
reward is the mean of its calls' rewards. Choices where the paper is silent follow the authors'
code (quchangle1/MatchTIR ``tool_similarity``/``assign_rewards_*``/``compute_process_*``):
- a hard pair with similarity 0 counts as unmatched (their greedy only matches score > 0);
- a non-answer turn with no calls gets ``no_call_reward`` (their value: 0);
- the answer turn gets the answer F1 only; calls written in it are not matched.
"""

from __future__ import annotations

from typing import Any, Literal

import numpy as np
from scipy.optimize import linear_sum_assignment
from scipy.special import logsumexp

from envs.toolcalls import ToolCall

MatchMode = Literal["hungarian", "greedy", "sinkhorn"]


def call_similarity(pred: ToolCall, gold: ToolCall) -> float:
    """(1 + J + V) / (2 + |params(gold)|) when names agree case-insensitively, else 0.

    J: Jaccard overlap of the parameter-name sets (1 when both are empty). V: number of gold
    parameters whose predicted value equals the gold value (Python ``==``, as the authors).
    """
    if pred.name.lower() != gold.name.lower():
        return 0.0
    p_keys, g_keys = set(pred.arguments), set(gold.arguments)
    union = p_keys | g_keys
    jaccard = 1.0 if not union else len(p_keys & g_keys) / len(union)
    values = sum(
        1 for k, v in gold.arguments.items() if k in pred.arguments and _eq(pred.arguments[k], v)
    )
    return (1.0 + jaccard + values) / (2.0 + len(gold.arguments))


def _eq(a: Any, b: Any) -> bool:
    # Plain == as the authors, but never let an exotic __eq__ (e.g. numpy arrays) raise.
    try:
        return bool(a == b)
    except Exception:
        return False


def similarity_matrix(preds: list[ToolCall], golds: list[ToolCall]) -> np.ndarray:
    """S[p, g] = call_similarity(preds[p], golds[g]); shape (P, G)."""
    sim = np.zeros((len(preds), len(golds)), dtype=np.float64)
    for i, p in enumerate(preds):
        for j, g in enumerate(golds):
            sim[i, j] = call_similarity(p, g)
    return sim


def hungarian_assignment(sim: np.ndarray) -> list[int | None]:
    """Optimal one-to-one assignment maximising total similarity; None = unmatched."""
    assignment: list[int | None] = [None] * sim.shape[0]
    if sim.size == 0:
        return assignment
    rows, cols = linear_sum_assignment(sim, maximize=True)
    for i, j in zip(rows, cols):
        if sim[i, j] > 0:  # a zero-similarity pair is no match (same rule as greedy)
            assignment[int(i)] = int(j)
    return assignment


def greedy_assignment(sim: np.ndarray) -> list[int | None]:
    """The authors' rule: take pairs by descending similarity, skipping used rows/columns.

    Pairs are listed prediction-major (all golds of prediction 0, then of prediction 1, ...)
    and sorted on the score alone with a stable sort, as the authors' ``pairs.sort(
    reverse=True, key=lambda x: x[0])`` does, so among equal scores the lowest prediction
    index wins, then the lowest gold index. Pairs with similarity 0 are never matched.
    """
    listed = [(float(sim[i, j]), i, j) for i in range(sim.shape[0]) for j in range(sim.shape[1])]
    # sorted() is stable, and reverse=True keeps equal keys in their listed order.
    pairs = sorted(listed, key=lambda p: p[0], reverse=True)
    assignment: list[int | None] = [None] * sim.shape[0]
    used: set[int] = set()
    for score, i, j in pairs:
        if score > 0 and assignment[i] is None and j not in used:
            assignment[i] = j
            used.add(j)
    return assignment


def sinkhorn_plan(
    sim: np.ndarray, reg: float = 0.1, max_iters: int = 1000, tol: float = 1e-9
) -> np.ndarray:
    """Entropic OT plan with uniform marginals and cost -sim, computed in the log domain.

    Same fixed point and update order as POT's ``ot.sinkhorn`` (v then u; stop when the column
    marginals are within ``tol``), but with log-sum-exp so small ``reg`` cannot overflow.
    Rows sum to 1/P, columns to 1/G.
    """
    n_p, n_g = sim.shape
    log_k = sim / reg  # -cost / reg
    log_a = np.full(n_p, -np.log(n_p))
    log_b = np.full(n_g, -np.log(n_g))
    log_u = np.zeros(n_p)
    log_v = np.zeros(n_g)
    for _ in range(max_iters):
        log_v = log_b - logsumexp(log_k + log_u[:, None], axis=0)
        log_u = log_a - logsumexp(log_k + log_v[None, :], axis=1)
        col = np.exp(logsumexp(log_k + log_u[:, None], axis=0) + log_v)
        if np.abs(col - np.exp(log_b)).sum() < tol:
            break
    return np.exp(log_u[:, None] + log_k + log_v[None, :])


def call_rewards(
    preds: list[ToolCall],
    golds: list[ToolCall],
    *,
    mode: MatchMode = "hungarian",
    unmatched_penalty: float = 0.0,
    sinkhorn_reg: float = 0.1,
    sinkhorn_iters: int = 1000,
) -> list[float]:
    """One reward per predicted call, from the chosen assignment.

    Hard modes: matched call = its similarity, unmatched = ``unmatched_penalty``. Soft mode:
    sum_g T[p, g] * S[p, g] (no penalty; the plan's 1/P row mass already shrinks rewards as
    calls multiply). No gold calls: every prediction is unmatched (soft: 0).
    """
    if mode not in ("hungarian", "greedy", "sinkhorn"):
        raise ValueError(f"unknown match mode {mode!r}; known: greedy, hungarian, sinkhorn")
    if not preds:
        return []
    if not golds:
        return [0.0 if mode == "sinkhorn" else unmatched_penalty] * len(preds)
    sim = similarity_matrix(preds, golds)
    if mode == "sinkhorn":
        plan = sinkhorn_plan(sim, sinkhorn_reg, sinkhorn_iters)
        return (plan * sim).sum(axis=1).tolist()
    assign = hungarian_assignment(sim) if mode == "hungarian" else greedy_assignment(sim)
    return [unmatched_penalty if j is None else float(sim[i, j]) for i, j in enumerate(assign)]


def match_turn_rewards(
    pred_calls_per_turn: list[list[ToolCall]],
    gold_calls: list[ToolCall],
    *,
    mode: MatchMode = "hungarian",
    answer_f1: float | None,
    unmatched_penalty: float = 0.0,
    no_call_reward: float = 0.0,
    sinkhorn_reg: float = 0.1,
    sinkhorn_iters: int = 1000,
) -> list[float]:
    """Per-turn MatchTIR reward of one trajectory.

    ``answer_f1`` is the final turn's answer F1 (None when the rollout gave no answer): when
    given, the final turn's reward is that F1 and its calls are not matched; when None the final
    turn is scored like the others. Every other turn gets the mean of its calls' rewards, or
    ``no_call_reward`` when it made none.
    """
    n_turns = len(pred_calls_per_turn)
    if n_turns == 0:
        return []
    scored = n_turns - 1 if answer_f1 is not None else n_turns
    flat = [c for t in range(scored) for c in pred_calls_per_turn[t]]
    owner = [t for t in range(scored) for _ in pred_calls_per_turn[t]]
    rewards = call_rewards(
        flat,
        gold_calls,
        mode=mode,
        unmatched_penalty=unmatched_penalty,
        sinkhorn_reg=sinkhorn_reg,
        sinkhorn_iters=sinkhorn_iters,
    )
    sums = [0.0] * n_turns
    counts = [0] * n_turns
    for t, r in zip(owner, rewards):
        sums[t] += r
        counts[t] += 1
    out = [sums[t] / counts[t] if counts[t] else no_call_reward for t in range(n_turns)]
    if answer_f1 is not None:
        out[-1] = float(answer_f1)
    return out
