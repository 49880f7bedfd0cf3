"""BFCL v4 categories as tasks: questions, functions as OpenAI tools, gold calls, hash splits.

Reads the question and possible-answer files the ``bfcl-eval`` wheel ships
(``bfcl_eval/data/BFCL_v4_<category>.json``, one JSON object a line) without importing
``bfcl_eval.utils``, whose import creates result folders beside the installed package. What
BFCL's own loader does to a test entry before inference is done here the same way: multi-turn
entries get the function docs of their involved classes (``multi_turn_func_doc/``), and every
function description gets BFCL's Python language hint.

A task's split is a hash of its id (and ``split_seed``), never its place in the file, so adding
or dropping a category leaves every other task where it was.
"""

from __future__ import annotations

import ast
import hashlib
import importlib.util
import json
from pathlib import Path
from typing import Any

from envs.base import Task
from envs.toolcalls import ToolCall

SINGLE_TURN = ("simple_python", "multiple", "parallel", "parallel_multiple")
"""One-decision categories: the model answers with its calls once; BFCL's AST checker scores."""
MULTI_TURN = ("multi_turn_base", "multi_turn_miss_param", "multi_turn_long_context")
"""Multi-turn categories: user turns, executed API calls; BFCL's state and response checkers
score. ``multi_turn_miss_func`` is left out: it adds functions in the middle of an episode,
which a prompt rendered once cannot show (``docs/envs.md``)."""
CATEGORIES = SINGLE_TURN + MULTI_TURN

PYTHON_HINT = " Note that the provided function is in Python 3 syntax."
"""What BFCL appends to every Python function description before inference."""


def package_data() -> Path:
    """The ``data`` folder of the installed bfcl-eval wheel; a clear error when it is absent."""
    spec = importlib.util.find_spec("bfcl_eval")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError(
            "env.type bfcl needs the bfcl-eval wheel (pinned in requirements-test.lock, which "
            "make test installs): pip install --no-deps bfcl-eval==2026.3.23")
    return Path(list(spec.submodule_search_locations)[0]) / "data"


def _read_lines(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _func_docs(data: Path, classes: list[str]) -> list[dict[str, Any]]:
    from bfcl_eval.constants.executable_backend_config import MULTI_TURN_FUNC_DOC_FILE_MAPPING

    docs: list[dict[str, Any]] = []
    for cls in classes:
        docs += _read_lines(data / "multi_turn_func_doc" / MULTI_TURN_FUNC_DOC_FILE_MAPPING[cls])
    return docs


def load_entries(category: str) -> list[tuple[dict[str, Any], Any]]:
    """(test entry, ground truth) pairs of one category, as BFCL prepares them for inference."""
    if category not in CATEGORIES:
        raise ValueError(f"unknown BFCL category {category!r}; supported: {', '.join(CATEGORIES)}")
    data = package_data()
    entries = _read_lines(data / f"BFCL_v4_{category}.json")
    answers = {a["id"]: a["ground_truth"] for a in
               _read_lines(data / "possible_answer" / f"BFCL_v4_{category}.json")}
    out = []
    for entry in entries:
        if category in MULTI_TURN:
            entry["function"] = _func_docs(data, entry["involved_classes"])
        for fn in entry["function"]:
            fn["description"] = fn["description"] + PYTHON_HINT
        out.append((entry, answers[entry["id"]]))
    return out


def _openai_schema(node: dict[str, Any]) -> dict[str, Any]:
    from bfcl_eval.constants.type_mappings import GORILLA_TO_OPENAPI

    out = dict(node)
    if isinstance(out.get("type"), str):
        out["type"] = GORILLA_TO_OPENAPI.get(out["type"], out["type"])
    if isinstance(out.get("properties"), dict):
        out["properties"] = {k: _openai_schema(v) for k, v in out["properties"].items()}
    if isinstance(out.get("items"), dict):
        out["items"] = _openai_schema(out["items"])
    return out


def openai_tool(fn: dict[str, Any]) -> dict[str, Any]:
    """A BFCL function doc as an OpenAI tool: BFCL's type names mapped with its own table
    (``GORILLA_TO_OPENAPI``: dict -> object, float -> number, tuple -> array, any -> string)."""
    return {"type": "function", "function": {
        "name": fn["name"], "description": fn["description"],
        "parameters": _openai_schema(fn["parameters"])}}


def _first_option(options: Any) -> Any:
    """The first accepted value of a possible-answer entry ("" means "may be left out"),
    nested dicts included."""
    values = [o for o in options if o != ""] if isinstance(options, list) else [options]
    value = values[0] if values else ""
    if isinstance(value, dict):
        return {k: _first_option(v) for k, v in value.items() if not _may_omit(v)}
    if isinstance(value, list) and value and isinstance(value[0], dict):
        return [_first_option([v]) for v in value]
    return value


def _may_omit(options: Any) -> bool:
    return isinstance(options, list) and "" in options


def gold_from_possible_answer(answer: list[dict[str, Any]],
                              functions: list[dict[str, Any]]) -> list[ToolCall]:
    """One gold call per possible-answer call: parameters BFCL lets be left out (and the
    function does not require) are left out, the others take their first accepted value."""
    calls = []
    for item in answer:
        (name, params), = item.items()
        doc = next((f for f in functions if f["name"] == name), {"parameters": {}})
        required = set(doc["parameters"].get("required", []))
        calls.append(ToolCall(name=name, arguments={
            k: _first_option(v) for k, v in params.items() if k in required or not _may_omit(v)}))
    return calls


def gold_from_call_string(text: str, functions: list[dict[str, Any]]) -> ToolCall:
    """A ground-truth call string (``mv(source='a', destination='b')``) as a ToolCall;
    positional arguments take the parameter names in the function doc's order."""
    node = ast.parse(text.strip(), mode="eval").body
    if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name):
        raise ValueError(f"not a plain function call: {text!r}")
    name = node.func.id
    doc = next((f for f in functions if f["name"] == name), None)
    order = list(doc["parameters"].get("properties", {})) if doc else []
    args = {order[i]: ast.literal_eval(a) for i, a in enumerate(node.args)}
    args |= {kw.arg: ast.literal_eval(kw.value) for kw in node.keywords if kw.arg}
    return ToolCall(name=name, arguments=args)


def in_heldout(task_id: str, split_seed: int, heldout_fraction: float) -> bool:
    """Whether ``task_id`` is held out: a SHA-256 of seed and id, read as a fraction."""
    digest = hashlib.sha256(f"{split_seed}:{task_id}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64 < heldout_fraction


def to_task(entry: dict[str, Any], truth: Any, category: str) -> Task:
    """One BFCL entry as a task; metadata keeps what the checkers need, verbatim."""
    functions = entry["function"]
    meta: dict[str, Any] = {"category": category, "functions": functions}
    if category in MULTI_TURN:
        gold = [gold_from_call_string(c, functions) for turn in truth for c in turn]
        meta |= {"ground_truth": truth, "turns": entry["question"],
                 "initial_config": entry.get("initial_config", {}),
                 "involved_classes": entry["involved_classes"]}
    else:
        gold = gold_from_possible_answer(truth, functions)
        meta |= {"possible_answer": truth}
    return Task(task_id=entry["id"], messages=list(entry["question"][0]),
                tools=[openai_tool(f) for f in functions], gold_tool_calls=gold, metadata=meta)
