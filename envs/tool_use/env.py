"""The tool-use episode: call the task's Python tools (sandboxed), then answer.

Each call is checked against the tool's JSON schema, then run in its own limited process
(``envs.tool_use.sandbox``). A tool that raises, hangs or runs out of memory becomes a tool
message with the error text and ``invalid_action=True``. ``<answer>...</answer>`` ends the
episode, with reward 1.0 when it is correct.

Step labels (``info["label"]``): 1 when a call of the step AST-matches a gold call not matched
earlier in the episode (``envs.tool_use.matching``), or the step answers correctly.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from envs.formats import DEFAULT_FORMAT
from envs.base import (
    Observation,
    StepResult,
    SyncEnvironment,
    Task,
    answer_step,
    question_text,
    tool_step,
)
from envs.mcp.tools import McpSession, McpTools
from envs.tool_use.matching import ast_match
from envs.tool_use.sandbox import Limits, ToolOutcome, run_tool, run_tool_async
from envs.toolcalls import ParsedAction, ToolCall, format_call, parse_action
from envs.tools import check_arguments, tool_message, tool_name

NO_ACTION_HINT = (
    'No tool call or answer found. Call a tool as <tool_call>{"name": ..., "arguments": '
    "{...}}</tool_call> or give the final answer as <answer>...</answer>."
)


def no_action_hint(chat_format: str = DEFAULT_FORMAT) -> str:
    """What the model is told when it neither called nor answered. Hermes keeps the placeholder
    form above (what the built-in policies were warm-started on); another format shows its own
    call syntax."""
    if chat_format == DEFAULT_FORMAT:
        return NO_ACTION_HINT
    call = format_call(ToolCall(name="<tool name>", arguments={"<argument>": "..."}), chat_format)
    return f"No tool call or answer found. Call a tool as {call} or give the final answer as <answer>...</answer>."


class ToolUseEnv(SyncEnvironment):
    """One tool-use episode at a time; the task carries its tools' source code."""

    def __init__(
        self, limits: Limits, max_turns: int, judge: Callable[[Task, str | None], float],
        mcp: McpTools | None = None,
    ) -> None:
        """``judge``: the answer's grade, 1.0 for a correct one (a bool will do); below 1 it is
        partial credit, which becomes the answer step's reward. ``mcp``: tools served by MCP
        servers (``envs.mcp``), called there rather than from a source in the sandbox."""
        self.limits = limits
        self.mcp = mcp
        self.session: McpSession | None = None
        self.max_turns = max_turns
        self.judge = judge
        self.task: Task | None = None
        self.schemas: dict[str, dict[str, Any]] = {}
        self.sources: dict[str, str] = {}
        self.turn = 0
        self.done = True
        self.matched: set[int] = set()

    def start(self, task: Task) -> Observation:
        """Synchronous ``reset``. Raises ValueError when a tool has no source to run."""
        self.schemas = {tool_name(t): t for t in task.tools}
        self.sources = dict(task.metadata.get("functions", {}))
        remote = self.mcp.names if self.mcp is not None else set()
        missing = sorted(set(self.schemas) - set(self.sources) - remote)
        if missing:
            raise ValueError(f"task {task.task_id}: no source for tools {missing}")
        self.task, self.turn, self.done, self.matched = task, 0, False, set()
        if self.mcp is not None and self.session is None:
            self.session = self.mcp.episode()
        return Observation(messages=[], anchor=question_text(task))

    def close(self) -> None:
        if self.session is not None:
            self.session.close()
            self.session = None

    # Overrides the sync wrapper: sandboxed tools run for up to their timeout, so the rollout's
    # event loop must not block on them.
    async def step(self, action: str) -> StepResult:
        parsed, early = self._begin(action)
        if early is not None:
            return early
        outcomes = []
        for call in parsed.calls:  # in order: a later call may rely on an earlier one's effect
            if (early := self._check(call)) is not None:
                outcomes.append(early)
            elif self._remote(call):
                outcomes.append(await self.session.call(call.name, call.arguments))
            else:
                outcomes.append(await run_tool_async(*self._job(call)))
        return self._conclude(parsed, outcomes)

    def act(self, action: str) -> StepResult:
        """Synchronous ``step`` (demonstrations, tests)."""
        parsed, early = self._begin(action)
        if early is not None:
            return early
        outcomes = [self._check(call) or (self.session.call_sync(call.name, call.arguments) if self._remote(call)
                                          else run_tool(*self._job(call))) for call in parsed.calls]
        return self._conclude(parsed, outcomes)

    def _begin(self, action: str) -> tuple[ParsedAction, StepResult | None]:
        if self.task is None or self.done:
            raise RuntimeError("step() called with no episode running: call reset(task) first")
        self.turn += 1
        parsed = parse_action(action, self.chat_format)
        if parsed.answer is not None:
            return parsed, self._finish(parsed)
        if not parsed.calls and not parsed.errors:
            hint = [{"role": "user", "content": no_action_hint(self.chat_format)}]
            return parsed, self._observe(hint, True, [], 0, {})
        return parsed, None

    def _check(self, call: ToolCall) -> ToolOutcome | None:
        """An error outcome when the call cannot run (unknown tool, bad arguments)."""
        if call.name not in self.schemas:
            known = ", ".join(sorted(self.schemas))
            return ToolOutcome(False, error=f"unknown tool {call.name!r}; available tools: {known}")
        problems = check_arguments(self.schemas[call.name], call.arguments)
        if problems:
            return ToolOutcome(False, error=f"{call.name}: " + "; ".join(problems))
        return None

    def _remote(self, call: ToolCall) -> bool:
        return self.session is not None and call.name not in self.sources and call.name in self.session.tools.names

    def _job(self, call: ToolCall) -> tuple[list[str], str, dict[str, Any], Limits]:
        return [self.sources[call.name]], call.name, call.arguments, self.limits

    def _conclude(self, parsed: ParsedAction, outcomes: list[ToolOutcome]) -> StepResult:
        assert self.task is not None
        messages = [tool_message(c.name, o.text()) for c, o in zip(parsed.calls, outcomes)]
        messages += [tool_message(None, f"Error: {e}") for e in parsed.errors]
        invalid = bool(parsed.errors) or not all(o.ok for o in outcomes)
        gold = self.task.gold_tool_calls or []
        new: dict[int, int] = {}  # gold index -> call index, each gold call credited once
        for ci, (call, outcome) in enumerate(zip(parsed.calls, outcomes)):
            for gi, g in enumerate(gold):
                if outcome.ok and gi not in self.matched and gi not in new and ast_match(call, g):
                    new[gi] = ci
                    break
        self.matched |= set(new)
        return self._observe(messages, invalid, parsed.calls, int(bool(new)), new)

    def _observe(
        self,
        messages: list[dict[str, Any]],
        invalid: bool,
        calls: list[ToolCall],
        label: int,
        matched: dict[int, int],
    ) -> StepResult:
        self.done = self.turn >= self.max_turns
        info = {"label": label, "matched_gold": sorted(matched), "turn": self.turn}
        return tool_step(messages, self.done, invalid, calls, info)

    def grade(self, answer: str) -> float:
        """The final answer's grade (``judge``); a subclass may grade the episode's trace too."""
        assert self.task is not None
        return float(self.judge(self.task, answer))

    def _finish(self, parsed: ParsedAction) -> StepResult:
        assert self.task is not None and parsed.answer is not None
        score = self.grade(parsed.answer)
        correct = score >= 1.0
        self.done = True
        info = {"label": int(correct), "matched_gold": [], "turn": self.turn, "correct": correct}
        return answer_step(parsed.answer, correct, parsed.calls, info, score=score)
