"""The tool-use task source: built-in generated tasks or MatchTIR/FTRL files.

Success is a numeric-aware exact match (``3.2400`` equals ``3.24``), since answers are numbers
copied from tool outputs. Demonstrations replay the gold calls, one per turn, through a real
episode, so every observation comes from the sandboxed tools.
"""

from __future__ import annotations

import json
import math
from typing import Any

from envs.base import Environment, SplitTaskSource, Task, exact_match, replay_gold_calls
from envs.config import ToolUseConfig
from envs.mcp.tools import offer_mcp_tools
from envs.tool_use.env import ToolUseEnv
from envs.tool_use.files import load_tool_tasks
from envs.tool_use.generator import SYSTEM_PROMPT, TOOL_SCHEMAS, generate_tasks
from envs.tool_use.matching import call_metrics
from envs.tool_use.sandbox import Limits
from envs.toolcalls import ToolCall, format_call


def _number(text: str) -> float | None:
    try:
        value = float(text.strip().replace(",", ""))
    except ValueError:
        return None
    return value if math.isfinite(value) else None


def numeric_match(answer: str | None, gold_answers: list[str] | None) -> bool:
    """Numbers equal within 1e-6 relative tolerance; other answers by normalised exact match."""
    if answer is None or not gold_answers:
        return False
    value = _number(answer)
    for gold in gold_answers:
        target = _number(gold)
        if value is not None and target is not None:
            if math.isclose(value, target, rel_tol=1e-6, abs_tol=1e-9):
                return True
        elif exact_match(answer, [gold]):
            return True
    return False


class ToolUseTaskSource(SplitTaskSource):
    """Tool-use tasks with their tool sources, gold traces and answers."""

    def __init__(self, cfg: ToolUseConfig) -> None:
        self.cfg = cfg
        self.limits = Limits(timeout_s=cfg.tool_timeout_s, memory_mb=cfg.tool_memory_mb)
        if cfg.train_path is not None and cfg.heldout_path is not None:
            self.splits = {
                "train": load_tool_tasks(cfg.train_path, "train"),
                "heldout": load_tool_tasks(cfg.heldout_path, "heldout"),
            }
        else:
            self.splits = generate_tasks(
                cfg.seed, cfg.num_train_tasks, cfg.num_heldout_tasks, cfg.min_calls, cfg.max_calls
            )
        self.mcp = offer_mcp_tools(self.splits, cfg.mcp)

    def make_env(self) -> Environment:
        return self.make_tool_env()

    def make_tool_env(self) -> ToolUseEnv:
        return ToolUseEnv(self.limits, self.cfg.max_turns, judge=self.success, mcp=self.mcp)

    def success(self, task: Task, answer: str | None) -> bool:
        return numeric_match(answer, task.gold_answers)

    def episode_metrics(self, task: Task, answer: str | None, calls: list[ToolCall],
                        labels: list[float]) -> dict[str, float]:
        """Adds the episode's calls matched one-to-one against the gold trace (AST match):
        ``call_precision``, ``call_recall``, ``call_f1``."""
        return super().episode_metrics(task, answer, calls, labels) | call_metrics(calls, task.gold_tool_calls)

    def demonstration(self, task: Task) -> list[dict[str, Any]]:
        """Gold calls one per turn with their real outputs, then the gold answer.

        Raises ValueError when the task has no gold trace or a gold call fails in the sandbox.
        """
        return replay_gold_calls(self.make_tool_env(), task)

    def corpus_text(self) -> list[str]:
        """Prompts, tool schemas and gold traces with their recorded outputs (no processes)."""
        out = [SYSTEM_PROMPT, *(json.dumps(t) for t in TOOL_SCHEMAS)]
        for task in self.splits["train"]:
            out.append(task.messages[-1]["content"])
            outputs = task.metadata.get("gold_outputs", [])
            for call, output in zip(task.gold_tool_calls or [], outputs):
                out += [format_call(call), output]
            out += [f"<answer>{a}</answer>" for a in task.gold_answers or []][:1]
        return out

    def provides(self) -> set[str]:
        return {"gold_answers", "gold_tool_calls", "anchor"}
