"""BFCL's own checkers, called as bfcl_eval's evaluation calls them; nothing re-implemented.

- Single-turn: ``ast_checker`` (``bfcl_eval.eval_checker.ast_eval``) on the decoded calls,
  ``[{name: {param: value}}]``, what BFCL's function-calling handlers decode a response into.
- Multi-turn: ``multi_turn_checker`` (state and response checkers) on the per-turn, per-step
  execution strings, after the two rules ``eval_runner._evaluate_single_multi_turn_entry``
  applies before it (``multi_turn_verdict``): a trajectory with fewer turns than the ground
  truth was force-terminated and fails; steps that decode to no call are dropped.

``ast_checker``'s module imports bfcl_eval's model registry (``constants.model_config``), which
imports every vendor SDK BFCL can call (anthropic, cohere, mistralai, google-genai...), only to
look up one flag of the model being scored, ``underscore_to_dot`` (whether its API forbids dots
in function names). This module imports the checker with a registry holding the one model it
scores as, ``turnrl``, whose format keeps dotted names, so that flag is False, as for BFCL's own
FC models that keep them. The multi-turn checker executes call strings with ``eval``; it runs in
the BFCL worker process (``envs.bfcl.worker``), never in a rollout actor.
"""

from __future__ import annotations

import builtins
import importlib
import keyword
import sys
import types
import uuid
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from envs.toolcalls import ToolCall

MODEL_NAME = "turnrl"
"""The model name BFCL's checkers are called with (no underscore: BFCL maps ``_`` to ``/``)."""
_AST_MODULE = "bfcl_eval.eval_checker.ast_eval.ast_checker"
_REGISTRY = "bfcl_eval.constants.model_config"


def _ast_checker_module() -> types.ModuleType:
    module = sys.modules.get(_AST_MODULE)
    if module is None:
        saved = sys.modules.get(_REGISTRY)
        registry = types.ModuleType(_REGISTRY)
        registry.MODEL_CONFIG_MAPPING = {}  # type: ignore[attr-defined]
        sys.modules[_REGISTRY] = registry
        try:
            module = importlib.import_module(_AST_MODULE)
        finally:  # nothing else sees this registry: the checker holds its own reference
            if saved is None:
                sys.modules.pop(_REGISTRY, None)
            else:
                sys.modules[_REGISTRY] = saved
    module.MODEL_CONFIG_MAPPING.setdefault(MODEL_NAME, SimpleNamespace(underscore_to_dot=False))
    return module


def decoded_ast(calls: list[ToolCall]) -> list[dict[str, dict[str, Any]]]:
    """Calls in BFCL's decoded AST form: ``[{name: {param: value}}]``."""
    return [{c.name: dict(c.arguments)} for c in calls]


def ast_verdict(functions: list[dict[str, Any]], decoded: list[dict[str, Any]],
                possible_answer: list[dict[str, Any]], category: str) -> dict[str, Any]:
    """BFCL's AST checker on one single-turn output: ``{"valid": bool, "error": ...}``."""
    from bfcl_eval.constants.enums import Language

    checker = _ast_checker_module()
    return checker.ast_checker(functions, decoded, possible_answer, Language.PYTHON, category,
                               MODEL_NAME)


def _unsafe_name(name: str) -> bool:
    # Names eval would resolve to something other than a BFCL API method (a builtin such as
    # open or input, a module global of BFCL's executor, a dotted path): never evaluated.
    return not name.isidentifier() or keyword.iskeyword(name) or hasattr(builtins, name) \
        or name.startswith("_")


UNKNOWN_CALL = "unknown_function_not_evaluated()"
"""What a call to an unsafe name becomes in an execution string: a NameError when evaluated,
as a call to an unknown plain name is in BFCL, without running the builtin it named."""


def execution_string(call: ToolCall) -> str:
    """One call as BFCL's FC handlers decode it for execution (``convert_to_function_call``):
    ``name(param=repr(value),...)``."""
    if _unsafe_name(call.name):
        return UNKNOWN_CALL
    args = ",".join(f"{k}={v!r}" for k, v in call.arguments.items())
    return f"{call.name}({args})"


def multi_turn_verdict(entry: dict[str, Any], ground_truth: list[list[str]],
                       decoded: list[list[list[str]]]) -> dict[str, Any]:
    """BFCL's multi-turn verdict on per-turn, per-step execution strings. Call in the worker
    process: the checker evaluates the strings. Its instances are dropped afterwards."""
    from bfcl_eval.eval_checker.multi_turn_eval import multi_turn_utils
    from bfcl_eval.eval_checker.multi_turn_eval.multi_turn_checker import multi_turn_checker
    from bfcl_eval.eval_checker.multi_turn_eval.multi_turn_utils import is_empty_execute_response

    if len(decoded) != len(ground_truth):
        return {"valid": False, "error_type": "multi_turn:force_terminated",
                "error_message": f"{len(decoded)} turns played of {len(ground_truth)}"}
    steps = [[s for s in turn if not is_empty_execute_response(s)] for turn in decoded]
    # A fresh name per check: BFCL keeps instances in its executor's globals by model name.
    name = f"{MODEL_NAME}{uuid.uuid4().hex}"
    try:
        result = multi_turn_checker(steps, ground_truth, entry, entry["id"].rsplit("_", 1)[0], name)
    finally:
        for key in [k for k in vars(multi_turn_utils) if name in k]:
            delattr(multi_turn_utils, key)
    return {k: result[k] for k in ("valid", "error_type", "error_message") if k in result}
