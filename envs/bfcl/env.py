"""A BFCL episode, played as BFCL's function-calling inference plays it.

Single-turn tasks are one decision: the first action's tool calls are the output; the episode
ends with them, decoded as BFCL decodes an FC model's calls.

Multi-turn tasks follow ``BaseHandler.inference_multi_turn_FC``: each user turn, the model's
calls are executed by BFCL's API classes and their results shown as tool messages; an action
with no tool call ends the user turn, and the next user message follows. More than
``max_steps_per_turn`` call steps in one user turn force-quits the episode, as BFCL's
``MAXIMUM_STEP_LIMIT`` does. Calls run in this episode's own worker process
(``envs.bfcl.process``), whose instances are the episode's state: a call that hangs or crashes
it fails that step (the results say so) and the next step starts a fresh process that replays
the episode's executed calls first. A malformed call is an error observation and, as in BFCL,
not part of the output. A call to a name that is not one of the task's functions is not
executed (the model sees an error); it stays in the output, where BFCL's executor would fail it.

The episode's answer is its output in BFCL's decoded form (JSON): ``{"calls": [...]}`` or
``{"turns": [[[call strings of a step], ...], ...]}``; the task source scores it with BFCL's
checkers (``envs.bfcl.source``). Step labels: 1 when a call of the step AST-matches a gold call
not matched earlier in the episode.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from envs.base import Observation, StepResult, SyncEnvironment, Task, question_text, tool_step
from envs.bfcl.data import MULTI_TURN
from envs.bfcl.official import ast_verdict, decoded_ast, execution_string
from envs.bfcl.process import WorkerProcess
from envs.config import BfclConfig
from envs.tool_use.matching import ast_match
from envs.toolcalls import ParsedAction, ToolCall, parse_action
from envs.tools import tool_message


def checker_entry(task: Task) -> dict[str, Any]:
    """What BFCL's executor and multi-turn checker read of a test entry."""
    return {"id": task.task_id, "initial_config": task.metadata.get("initial_config", {}),
            "involved_classes": task.metadata["involved_classes"]}


class BfclEnv(SyncEnvironment):
    """One BFCL episode at a time; multi-turn calls run in the episode's worker process."""

    def __init__(self, cfg: BfclConfig) -> None:
        self.cfg = cfg
        self.max_turns = cfg.max_turns
        self.task: Task | None = None
        self.done = True
        self.proc: WorkerProcess | None = None

    def start(self, task: Task) -> Observation:
        self.close()
        self.task, self.done, self.turn = task, False, 0
        self.multi = task.metadata["category"] in MULTI_TURN
        self.names = {t["function"]["name"] for t in task.tools}
        self.user_turn, self.steps_in_turn = 0, 0
        self.decoded: list[list[list[str]]] = [[]]
        self.history: list[list[str]] = []  # executed steps, replayed into a fresh process
        self.matched: set[int] = set()
        return Observation(messages=[], anchor=question_text(task))

    # Overrides the sync wrapper: a call may run up to its timeout, which must not block the
    # rollout's event loop.
    async def step(self, action: str) -> StepResult:
        return await asyncio.to_thread(self.act, action)

    def act(self, action: str) -> StepResult:
        if self.task is None or self.done:
            raise RuntimeError("step() called with no episode running: call reset(task) first")
        self.turn += 1
        parsed = parse_action(action, self.chat_format)
        if not self.multi:
            return self._single(parsed)
        if parsed.calls or parsed.errors:
            return self._call_step(parsed)
        return self._end_user_turn()

    def _label(self, calls: list[ToolCall]) -> int:
        gold = (self.task.gold_tool_calls if self.task else None) or []
        new = set()
        for call in calls:
            hit = next((i for i, g in enumerate(gold) if i not in self.matched | new
                        and ast_match(call, g)), None)
            if hit is not None:
                new.add(hit)
        self.matched |= new
        return int(bool(new))

    def _finish(self, answer: str, verdict: dict[str, Any], calls: list[ToolCall],
                info: dict[str, Any]) -> StepResult:
        self.done = True
        correct = bool(verdict.get("valid"))
        info |= {"correct": correct, "verdict": verdict}
        return StepResult(observation=Observation(messages=[], anchor=""), reward=float(correct),
                          done=True, tool_calls=calls, answer=answer, info=info)

    def _single(self, parsed: ParsedAction) -> StepResult:
        assert self.task is not None
        decoded = decoded_ast(parsed.calls)
        meta = self.task.metadata
        verdict = ast_verdict(meta["functions"], decoded, meta["possible_answer"], meta["category"])
        info = {"label": self._label(parsed.calls), "turn": self.turn}
        result = self._finish(json.dumps({"calls": decoded}), verdict, parsed.calls, info)
        result.invalid_action = bool(parsed.errors) or not parsed.calls
        return result

    def _execute(self, strings: list[str]) -> dict[str, Any]:
        assert self.task is not None
        if self.proc is None:
            self.proc = WorkerProcess(self.cfg.tool_timeout_s, self.cfg.tool_memory_mb)
        entry = checker_entry(self.task)
        if self.proc.ensure_started():  # fresh: rebuild the episode's state
            for done in self.history:
                self.proc.request({"op": "exec", "entry": entry, "calls": done})
        reply = self.proc.request({"op": "exec", "entry": entry, "calls": strings})
        if reply.get("ok"):
            self.history.append(strings)
        return reply

    def _call_step(self, parsed: ParsedAction) -> StepResult:
        self.steps_in_turn += 1
        runnable = [execution_string(c) for c in parsed.calls if c.name in self.names]
        reply = self._execute(runnable) if runnable else {"ok": True, "results": []}
        results = iter(reply.get("results", []))
        messages, invalid = [], bool(parsed.errors) or not reply.get("ok")
        for call in parsed.calls:
            if call.name not in self.names:
                text = f"Error: unknown function {call.name!r}; available: {', '.join(sorted(self.names))}"
            elif reply.get("ok"):
                text = str(next(results, ""))
            else:
                text = f"Error: {reply.get('error')}"
            invalid |= text.startswith("Error")  # ours, or BFCL's "Error during execution"
            messages.append(tool_message(call.name, text))
        messages += [tool_message(None, f"Error: {e}") for e in parsed.errors]
        self.decoded[self.user_turn].append([execution_string(c) for c in parsed.calls])
        force_quit = self.steps_in_turn > self.cfg.max_steps_per_turn
        self.done = force_quit or self.turn >= self.max_turns
        info = {"label": self._label(parsed.calls), "turn": self.turn, "user_turn": self.user_turn,
                "force_quit": force_quit}
        return tool_step(messages, self.done, invalid, parsed.calls, info)

    def _end_user_turn(self) -> StepResult:
        assert self.task is not None
        turns = self.task.metadata["turns"]
        self.user_turn += 1
        self.steps_in_turn = 0
        info: dict[str, Any] = {"label": 0, "turn": self.turn, "user_turn": self.user_turn}
        if self.user_turn < len(turns):
            self.decoded.append([])
            self.done = self.turn >= self.max_turns
            return tool_step(list(turns[self.user_turn]), self.done, False, [], info)
        answer = json.dumps({"turns": self.decoded})
        return self._finish(answer, self._check(self.decoded), [], info)

    def _check(self, decoded: list[list[list[str]]]) -> dict[str, Any]:
        """BFCL's multi-turn verdict, run in this episode's process (fresh instances)."""
        assert self.task is not None
        if self.proc is None:
            self.proc = WorkerProcess(self.cfg.tool_timeout_s, self.cfg.tool_memory_mb)
        reply = self.proc.request(
            {"op": "check", "entry": checker_entry(self.task), "decoded": decoded,
             "ground_truth": self.task.metadata["ground_truth"]}, timeout_s=self.cfg.check_timeout_s)
        return reply["verdict"] if reply.get("ok") else {"valid": False, "error": reply.get("error")}

    def close(self) -> None:
        if self.proc is not None:
            self.proc.close()
            self.proc = None
