"""The BFCL task source: categories split by task-id hash, success by BFCL's own checkers.

``success`` is the verdict of bfcl_eval's checker on the episode's output (the answer the
environment wrote, ``envs.bfcl.env``): the AST checker in this process for single-turn tasks,
the multi-turn checker in the source's own worker process (it evaluates call strings, so never
in the caller's process; a verdict that outlives ``check_timeout_s`` is a failure). Tasks carry
no gold answer, so the outcome reward is this success; gold calls feed MatchTIR's matching.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from envs.base import Environment, SplitTaskSource, Task
from envs.bfcl.data import MULTI_TURN, in_heldout, load_entries, to_task
from envs.bfcl.env import BfclEnv, checker_entry
from envs.bfcl.official import ast_verdict
from envs.bfcl.process import WorkerProcess
from envs.config import BfclConfig
from envs.tool_use.matching import call_metrics
from envs.toolcalls import ToolCall, format_call


def _hash_order(task: Task) -> str:
    return hashlib.sha256(task.task_id.encode()).hexdigest()


class BfclTaskSource(SplitTaskSource):
    """BFCL v4 tasks of the configured categories, train and held-out."""

    def __init__(self, cfg: BfclConfig) -> None:
        self.cfg = cfg
        self.splits = {"train": [], "heldout": []}
        for category in cfg.categories:
            split: dict[str, list[Task]] = {"train": [], "heldout": []}
            for entry, truth in load_entries(category):
                held = in_heldout(entry["id"], cfg.split_seed, cfg.heldout_fraction)
                split["heldout" if held else "train"].append(to_task(entry, truth, category))
            for name, tasks in split.items():
                if cfg.max_tasks_per_category is not None:
                    tasks = sorted(tasks, key=_hash_order)[:cfg.max_tasks_per_category]
                self.splits[name] += tasks
        self._checker = WorkerProcess(cfg.check_timeout_s, cfg.tool_memory_mb)

    def make_env(self) -> Environment:
        return BfclEnv(self.cfg)

    def verdict(self, task: Task, answer: str | None) -> dict[str, Any]:
        """bfcl_eval's verdict on an episode's output: ``{"valid": bool, ...}``."""
        if answer is None:  # the episode ended before its output was complete
            return {"valid": False, "error_type": "no output (turn limit or force-quit)"}
        output = json.loads(answer)
        meta = task.metadata
        if meta["category"] not in MULTI_TURN:
            return ast_verdict(meta["functions"], output["calls"], meta["possible_answer"],
                               meta["category"])
        reply = self._checker.request({"op": "check", "entry": checker_entry(task),
                                       "ground_truth": meta["ground_truth"],
                                       "decoded": output["turns"]})
        return reply["verdict"] if reply.get("ok") else {"valid": False, "error": reply.get("error")}

    def success(self, task: Task, answer: str | None) -> bool:
        return bool(self.verdict(task, answer).get("valid"))

    def demonstration(self, task: Task) -> list[dict[str, Any]]:
        """The gold calls played through a real episode: single-turn, one action with all of
        them; multi-turn, each user turn's calls in one action, then a short reply ending the
        turn, the next user message following. Raises ValueError when BFCL does not score the
        replay as a success."""
        env = BfclEnv(self.cfg)
        env.start(task)
        gold = list(task.gold_tool_calls or [])
        if task.metadata["category"] in MULTI_TURN:
            sizes = [len(turn) for turn in task.metadata["ground_truth"]]
            starts = [sum(sizes[:i]) for i in range(len(sizes))]
            turns = [[_calls_text(gold[s:s + n])] if n else [] for s, n in zip(starts, sizes)]
            actions = [a for turn in turns for a in [*turn, "Done."]]
        else:
            actions = [_calls_text(gold)]
        messages: list[dict[str, Any]] = []
        try:
            for action in actions:
                result = env.act(action)
                messages += [{"role": "assistant", "content": action}, *result.observation.messages]
        finally:
            env.close()
        if not result.info.get("correct"):
            raise ValueError(f"task {task.task_id}: BFCL did not score the gold replay a success: "
                             f"{result.info.get('verdict')}")
        return messages

    def episode_metrics(self, task: Task, answer: str | None, calls: list[ToolCall],
                        labels: list[float]) -> dict[str, float]:
        """Adds the calls matched one-to-one against the gold calls (AST match):
        ``call_precision``, ``call_recall``, ``call_f1``."""
        return super().episode_metrics(task, answer, calls, labels) | call_metrics(calls, task.gold_tool_calls)

    def corpus_text(self) -> list[str]:
        """Questions, tool schemas and gold calls of the train split."""
        out: list[str] = []
        for task in self.splits["train"]:
            out += [m["content"] for turn in task.metadata.get("turns", [task.messages]) for m in turn]
            out += [json.dumps(t) for t in task.tools]
            out.append(_calls_text(task.gold_tool_calls or []))
        return out

    def provides(self) -> set[str]:
        return {"gold_tool_calls", "anchor"}

    def close(self) -> None:
        """Stop the checker's worker process."""
        self._checker.close()


def _calls_text(calls: list[ToolCall]) -> str:
    return "\n".join(format_call(c) for c in calls)
