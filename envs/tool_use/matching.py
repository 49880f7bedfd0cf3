"""AST matching of tool calls against gold calls, in the manner of BFCL's AST checker.

A predicted call matches a gold call when the function names are equal, every gold parameter
is present with a matching value, no parameter is unexpected, and (given the schema) every
required parameter is present. Values match by type-aware rules:

- numbers: int and float interchange, equal within 1e-6 relative tolerance (BFCL accepts an int
  where a float is expected);
- strings: equal after BFCL's standardisation (lowercase; spaces and ``,./-_*^`` removed);
- lists element-wise in order, dicts key by key, recursively; booleans only equal booleans.

Pure functions: no process, no I/O. ``rewards/`` builds the MatchTIR turn matching on top.
"""

from __future__ import annotations

import math
import re
from typing import Any

from envs.toolcalls import ToolCall

_STRIP_RE = re.compile(r"[ ,./\-_*^]")


def standardize_string(text: str) -> str:
    """BFCL's string normal form: case and separators do not count."""
    return _STRIP_RE.sub("", text).lower().replace("'", '"')


def values_match(predicted: Any, gold: Any) -> bool:
    """Whether one argument value matches the gold value (rules in the module docstring)."""
    if isinstance(gold, bool) or isinstance(predicted, bool):
        return isinstance(gold, bool) and isinstance(predicted, bool) and predicted == gold
    if isinstance(gold, (int, float)):
        return isinstance(predicted, (int, float)) and math.isclose(
            float(predicted), float(gold), rel_tol=1e-6, abs_tol=1e-9
        )
    if isinstance(gold, str):
        return isinstance(predicted, str) and standardize_string(predicted) == standardize_string(
            gold
        )
    if isinstance(gold, list):
        return (
            isinstance(predicted, list)
            and len(predicted) == len(gold)
            and all(values_match(p, g) for p, g in zip(predicted, gold))
        )
    if isinstance(gold, dict):
        return (
            isinstance(predicted, dict)
            and predicted.keys() == gold.keys()
            and all(values_match(predicted[k], gold[k]) for k in gold)
        )
    return predicted == gold


def parameter_score(predicted: ToolCall, gold: ToolCall) -> float:
    """Share of the union of parameter names whose values match (0 on a name mismatch).

    A graded signal for partial credit; :func:`ast_match` is the strict pass/fail.
    """
    if predicted.name != gold.name:
        return 0.0
    keys = set(predicted.arguments) | set(gold.arguments)
    if not keys:
        return 1.0
    hits = sum(
        1
        for k in keys
        if k in predicted.arguments
        and k in gold.arguments
        and values_match(predicted.arguments[k], gold.arguments[k])
    )
    return hits / len(keys)


def ast_match(predicted: ToolCall, gold: ToolCall, tool: dict[str, Any] | None = None) -> bool:
    """BFCL-style strict match; ``tool`` (its JSON schema) adds the required-parameter check."""
    if predicted.name != gold.name or set(predicted.arguments) != set(gold.arguments):
        return False
    if tool is not None:
        required = tool.get("function", tool).get("parameters", {}).get("required", [])
        if any(key not in predicted.arguments for key in required):
            return False
    return all(values_match(predicted.arguments[k], gold.arguments[k]) for k in gold.arguments)


def match_trace(predicted: list[ToolCall], gold: list[ToolCall]) -> dict[str, float]:
    """One-to-one greedy matching of a predicted trace to the gold trace, in gold order.

    Returns ``matched`` (count), ``precision``, ``recall`` and ``f1``. Empty against empty is a
    perfect score.
    """
    used: set[int] = set()
    for g in gold:
        for i, p in enumerate(predicted):
            if i not in used and ast_match(p, g):
                used.add(i)
                break
    matched = len(used)
    precision = matched / len(predicted) if predicted else float(not gold)
    recall = matched / len(gold) if gold else float(not predicted)
    f1 = 2 * precision * recall / (precision + recall) if precision + recall else 0.0
    return {"matched": float(matched), "precision": precision, "recall": recall, "f1": f1}


def call_metrics(predicted: list[ToolCall], gold: list[ToolCall] | None) -> dict[str, float]:
    """An episode's calls matched one-to-one against its gold calls (``match_trace``), as the
    metrics environments with gold calls report: ``call_precision``, ``call_recall``, ``call_f1``."""
    trace = match_trace(predicted, gold or [])
    return {f"call_{k}": trace[k] for k in ("precision", "recall", "f1")}
