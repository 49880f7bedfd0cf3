"""The MCP task set (``env.type: mcp_tasks``): prompts answered with MCP servers' tools.

A task file (YAML list, JSON list or JSONL) holds one record per task::

    - id: tokyo-time                        # optional; the record's position otherwise
      prompt: "It is 14:30 in Paris. What time is it in Tokyo?"   # or messages: [...]
      system: "..."                         # optional; env.system_prompt otherwise
      answers: ["22:30"]                    # accepted final answers (normalised exact match)
      gold_calls:                           # the reference trace (MatchTIR scores against it)
        - {name: convert_time, arguments: {source_timezone: Europe/Paris, time: "14:30",
                                           target_timezone: Asia/Tokyo}}
      check: [answer, calls]                # optional; every check the record can give

A task succeeds (outcome 1.0) when every check passes: ``answer``, the final answer matches one
of ``answers``; ``calls``, every gold call was made (AST match, as the tool-use environment
matches them) and succeeded. Every task offers every server's tools; the servers start once per
process when the source is built (a server that cannot start fails the run there).
"""

from __future__ import annotations

from typing import Any

from envs.base import Environment, SplitTaskSource, Task, exact_match, replay_gold_calls
from envs.config import McpTasksConfig
from envs.mcp.tools import McpTools
from envs.records import read_records
from envs.tool_use.env import ToolUseEnv
from envs.tool_use.files import read_gold_calls
from envs.tool_use.matching import call_metrics
from envs.tool_use.sandbox import Limits
from envs.toolcalls import ToolCall

CHECKS = ("answer", "calls")
_FIELDS = {"id", "prompt", "messages", "system", "answers", "gold_calls", "check"}


def _messages(where: str, record: dict[str, Any], system: str) -> list[dict[str, Any]]:
    if "messages" in record:
        messages = record["messages"]
        if not isinstance(messages, list) or not all(isinstance(m, dict) and "role" in m for m in messages):
            raise ValueError(f"{where}: field 'messages' must be a list of chat messages")
        return messages
    prompt = record.get("prompt")
    if not isinstance(prompt, str) or not prompt.strip():
        raise ValueError(f"{where}: field 'prompt' (or 'messages') is missing")
    return [{"role": "system", "content": record.get("system", system)}, {"role": "user", "content": prompt}]


def _checks(where: str, record: dict[str, Any]) -> list[str]:
    can = [c for c, key in zip(CHECKS, ("answers", "gold_calls")) if record.get(key)]
    if not can:
        raise ValueError(f"{where}: no field answers or gold_calls: a task needs answers, gold_calls or both to be graded")
    checks = record.get("check", can)
    if isinstance(checks, str):
        checks = [checks]
    if not isinstance(checks, list) or not checks or any(c not in CHECKS for c in checks):
        raise ValueError(f"{where}: field 'check' must list some of {list(CHECKS)}; got {record.get('check')!r}")
    lacking = [c for c in checks if c not in can]
    if lacking:
        raise ValueError(f"{where}: check {lacking} needs field {'answers' if 'answer' in lacking else 'gold_calls'}")
    return checks


def load_mcp_tasks(path: str, split: str, system: str, tools: list[dict[str, Any]]) -> list[Task]:
    """The tasks of one file, each offering ``tools``; problems name the file, record and field."""
    tasks = []
    for where, record in read_records(path):
        unknown = sorted(set(record) - _FIELDS)
        if unknown:
            raise ValueError(f"{where}: unknown fields {unknown}; a record takes {sorted(_FIELDS)}")
        answers = record.get("answers")
        if isinstance(answers, (str, int, float)) and not isinstance(answers, bool):
            answers = [answers]
        if answers is not None and not isinstance(answers, list):
            raise ValueError(f"{where}: field 'answers' must be a list of accepted answers")
        checks = _checks(where, record | {"answers": answers})
        tasks.append(Task(
            task_id=f"{split}-{record.get('id', len(tasks))}", messages=_messages(where, record, system), tools=tools,
            gold_answers=[str(a) for a in answers] if answers else None,
            gold_tool_calls=read_gold_calls(where, record), metadata={"checks": checks}))
    if len({t.task_id for t in tasks}) != len(tasks):
        raise ValueError(f"{path}: field 'id' repeats; task ids must be unique")
    return tasks


class McpTaskEnv(ToolUseEnv):
    """The tool-use episode with every tool on MCP servers, graded by the task's checks."""

    def grade(self, answer: str) -> float:
        assert self.task is not None
        checks = self.task.metadata["checks"]
        ok = ("answer" not in checks or self.judge(self.task, answer)) and (
            "calls" not in checks or len(self.matched) == len(self.task.gold_tool_calls or []))
        return float(ok)


class McpTasksSource(SplitTaskSource):
    """Prompts and checks from files, tools from the configured MCP servers."""

    scores_outcome = True  # a trace check is the environment's to grade, not a match of the answer

    def __init__(self, cfg: McpTasksConfig) -> None:
        self.cfg = cfg
        self.mcp = McpTools(cfg.mcp)
        tools = self.mcp.definitions
        self.splits = {split: load_mcp_tasks(path, split, cfg.system_prompt, tools)
                       for split, path in (("train", cfg.train_path), ("heldout", cfg.heldout_path))}

    def make_env(self) -> Environment:
        return McpTaskEnv(Limits(), self.cfg.max_turns, judge=self.success, mcp=self.mcp)

    def success(self, task: Task, answer: str | None) -> bool:
        """The answer check alone (an episode's success is its outcome, the checks together)."""
        return exact_match(answer, task.gold_answers)

    def demonstration(self, task: Task) -> list[dict[str, Any]]:
        """The gold calls one per turn with their real results from the servers, then the first
        answer. Raises ValueError for a task without both, or whose replay fails its checks."""
        env = self.make_env()
        try:
            return replay_gold_calls(env, task)
        finally:
            env.close()

    def episode_metrics(self, task: Task, answer: str | None, calls: list[ToolCall],
                        labels: list[float]) -> dict[str, float]:
        out = super().episode_metrics(task, answer, calls, labels)
        return out | call_metrics(calls, task.gold_tool_calls) if task.gold_tool_calls else out

    def provides(self) -> set[str]:
        out = {"anchor"}
        tasks = self.splits["train"]
        if tasks and all(t.gold_answers for t in tasks):
            out.add("gold_answers")
        if tasks and all(t.gold_tool_calls for t in tasks):
            out.add("gold_tool_calls")
        return out
