"""The BFCL worker process: BFCL's API classes and multi-turn checker, away from the caller.

Started by ``envs.bfcl.process`` as ``python -I -c ...`` and driven over its stdin/stdout, one
JSON request a line and one JSON reply a line. Before it reads a request it caps its address
space (``RLIMIT_AS``) and moves into an empty temporary folder, so a call string BFCL's executor
evaluates can neither exhaust the machine's memory nor write beside the project. Requests:

- ``{"op": "exec", "entry": {...}, "calls": [...]}``: run one step's call strings with BFCL's
  ``execute_multi_turn_func_call``; its instances persist across requests of this process, so
  one process is one episode's state.
- ``{"op": "check", "entry": {...}, "ground_truth": [...], "decoded": [...]}``: BFCL's
  multi-turn verdict (``envs.bfcl.official.multi_turn_verdict``) on fresh instances.

A request that raises gets ``{"ok": false, "error": ...}``; the process lives on. Prints from
BFCL's code go to a buffer, never into the reply stream. The cap, the folder and the names the
environment refuses to send (``envs.bfcl.official.execution_string``) guard against a policy's
accidents, not against hostile code: BFCL's executor ``eval``s what it is given.
"""

from __future__ import annotations

import io
import json
import os
import resource
import sys
import tempfile
from typing import Any

EPISODE_NAME = "turnrl_episode"
"""The model name this process's episode instances are kept under in BFCL's executor."""


def _execute(request: dict[str, Any]) -> dict[str, Any]:
    from bfcl_eval.eval_checker.multi_turn_eval.multi_turn_utils import (
        execute_multi_turn_func_call,
    )

    entry = request["entry"]
    category = entry["id"].rsplit("_", 1)[0]
    results, _ = execute_multi_turn_func_call(
        request["calls"], entry.get("initial_config", {}), entry["involved_classes"],
        EPISODE_NAME, entry["id"], long_context="long_context" in category)
    return {"ok": True, "results": results}


def _check(request: dict[str, Any]) -> dict[str, Any]:
    from envs.bfcl.official import multi_turn_verdict

    verdict = multi_turn_verdict(request["entry"], request["ground_truth"], request["decoded"])
    return {"ok": True, "verdict": verdict}


def handle(request: dict[str, Any]) -> dict[str, Any]:
    """One request's reply; exceptions become ``ok: false`` replies."""
    try:
        if request.get("op") == "exec":
            return _execute(request)
        if request.get("op") == "check":
            return _check(request)
        return {"ok": False, "error": f"unknown op {request.get('op')!r}"}
    except Exception as exc:  # noqa: BLE001 - a request's failure is its reply, not a crash
        return {"ok": False, "error": f"{type(exc).__name__}: {exc}"}


def main(memory_mb: int) -> None:
    """Serve requests from stdin until it closes."""
    limit = memory_mb * 1024 * 1024
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    replies = sys.stdout
    with tempfile.TemporaryDirectory(prefix="bfcl-") as folder:
        os.chdir(folder)
        for line in sys.stdin:
            if not line.strip():
                continue
            sys.stdout = io.StringIO()  # what a request prints is dropped
            reply = handle(json.loads(line))
            replies.write(json.dumps(reply, default=str) + "\n")
            replies.flush()
