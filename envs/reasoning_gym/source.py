"""reasoning-gym task families as a TurnRL task source (``env.type: reasoning_gym``).

Questions come from reasoning-gym's procedural generators (``reasoning_gym.create_dataset``),
one dataset per family and split, the held-out one on a seed of its own; a train question whose
text is also a held-out one is dropped, so the splits share no question. Each answer is graded by
its family's own ``score_answer`` (1.0 correct; some families give partial credit), which is the
episode's outcome (``TaskSource.scores_outcome``); the generator's answer is also the task's gold
answer, for IG and the SFT warm start.

Single-turn by default: the policy answers inside ``<answer></answer>``. With ``tools:
[python]`` the episode is the tool-use episode (``envs.tool_use.env``): the policy may run Python
in the tool sandbox, read what it printed, and answer within ``max_turns``.
"""

from __future__ import annotations

import dataclasses
import difflib
import zlib
from typing import Any

from envs.base import Environment, SplitTaskSource, Task, replay_gold_calls
from envs.config import ReasoningGymConfig, ReasoningGymTask
from envs.mcp.tools import offer_mcp_tools
from envs.tool_use.env import ToolUseEnv
from envs.tool_use.sandbox import Limits
from envs.toolcalls import ToolCall, format_answer

SYSTEM_PROMPT = "Solve the problem, then give only the final answer inside <answer></answer>."
PYTHON_PROMPT = ("Solve the problem. You may run Python with the python tool (print what you "
                 "need to see), then give only the final answer inside <answer></answer>.")
TOOLS_PROMPT = "Solve the problem with the tools, then give only the final answer inside <answer></answer>."
PYTHON_TOOL = {"type": "function", "function": {
    "name": "python",
    "description": "Run Python 3 code and return what it printed (standard library only, no network).",
    "parameters": {"type": "object", "properties": {"code": {"type": "string", "description": "The code to run"}},
                   "required": ["code"]},
}}
# Runs in the sandbox's child process (``python -I -S``): the standard library only. An
# exception propagates, so the call fails and the model reads its error.
PYTHON_SOURCE = '''
def python(code):
    import contextlib, io
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code, "<code>", "exec"), {"__name__": "__main__"})
    text = out.getvalue()
    return text[-4000:] if text else "(nothing printed: print the values you need)"
'''
_SLACK = 1.2
"""Train questions generated per one kept: room for the ones dropped as held-out repeats."""


def _reasoning_gym() -> Any:
    try:
        import reasoning_gym
    except ImportError as exc:
        raise ValueError("env.type reasoning_gym needs the reasoning-gym package: "
                         "pip install reasoning-gym") from exc
    return reasoning_gym


def shares(total: int, weights: list[float]) -> list[int]:
    """``total`` split in proportion to ``weights`` (largest remainders; sums to ``total``)."""
    exact = [total * w / sum(weights) for w in weights]
    counts = [int(x) for x in exact]
    for i in sorted(range(len(exact)), key=lambda i: counts[i] - exact[i])[: total - sum(counts)]:
        counts[i] += 1
    return counts


def split_seed(seed: int, split: str, name: str) -> int:
    """The generator seed of one family's split: stable across processes (no ``hash()``)."""
    return zlib.crc32(f"{seed}:{split}:{name}".encode())


class ReasoningGymTaskSource(SplitTaskSource):
    """Procedurally generated questions of the configured families, graded by their scorers."""

    scores_outcome = True

    def __init__(self, cfg: ReasoningGymConfig) -> None:
        self.cfg = cfg
        self.limits = Limits(timeout_s=cfg.tool_timeout_s, memory_mb=cfg.tool_memory_mb)
        self.entries: dict[str, tuple[Any, dict[str, Any]]] = {}
        """Task id -> (its dataset, its reasoning-gym entry): what grading needs."""
        weights = [t.weight for t in cfg.tasks]
        heldout = [self._generate(i, "heldout", n, set()) for i, n in enumerate(shares(cfg.num_heldout_tasks, weights))]
        seen = {t.messages[-1]["content"] for tasks in heldout for t in tasks}
        train = [self._generate(i, "train", n, seen) for i, n in enumerate(shares(cfg.num_train_tasks, weights))]
        self.splits = {"train": [t for ts in train for t in ts], "heldout": [t for ts in heldout for t in ts]}
        self.mcp = offer_mcp_tools(self.splits, cfg.mcp)

    def _dataset(self, index: int, spec: ReasoningGymTask, seed: int, size: int) -> Any:
        rg = _reasoning_gym()
        where = f"env.tasks[{index}]"
        if spec.name not in rg.factory.DATASETS:
            close = difflib.get_close_matches(spec.name, rg.factory.DATASETS, n=3)
            hint = f"; did you mean {', '.join(close)}?" if close else "; reasoning_gym.factory.DATASETS lists them"
            raise ValueError(f"{where}.name: unknown reasoning-gym task {spec.name!r}{hint}")
        config_cls = rg.factory.DATASETS[spec.name][1]
        known = {f.name for f in dataclasses.fields(config_cls)} - {"seed", "size"}
        unknown = sorted(set(spec.config) - known)
        if unknown:
            raise ValueError(f"{where}.config: {spec.name} takes no {unknown}; it takes {sorted(known)}")
        try:
            return rg.create_dataset(spec.name, seed=seed, size=size, **spec.config)
        except (AssertionError, TypeError, ValueError) as exc:
            raise ValueError(f"{where}.config: reasoning-gym refused it: {exc or type(exc).__name__}") from exc

    def _generate(self, index: int, split: str, count: int, exclude: set[str]) -> list[Task]:
        spec = self.cfg.tasks[index]
        if count == 0:
            return []
        size = count if split == "heldout" else int(count * _SLACK) + 8
        dataset = self._dataset(index, spec, split_seed(self.cfg.seed, split, spec.name), size)
        tasks: list[Task] = []
        for i in range(size):
            entry = dataset[i]
            if entry["question"] in exclude:
                continue
            tasks.append(self._task(f"{spec.name}:{split}:{i}", entry))
            self.entries[tasks[-1].task_id] = (dataset, entry)
            if len(tasks) == count:
                return tasks
        raise ValueError(
            f"env.tasks[{index}] ({spec.name}): only {len(tasks)} of {size} generated train questions "
            f"differ from the held-out ones, short of {count}: lower env.num_train_tasks or widen its config")

    def _task(self, task_id: str, entry: dict[str, Any]) -> Task:
        prompt = PYTHON_PROMPT if self.cfg.tools else TOOLS_PROMPT if self.cfg.mcp else SYSTEM_PROMPT
        return Task(
            task_id=task_id,
            messages=[{"role": "system", "content": prompt}, {"role": "user", "content": entry["question"]}],
            tools=[PYTHON_TOOL] if self.cfg.tools else [],
            gold_answers=[str(entry["answer"])] if entry.get("answer") is not None else None,
            gold_tool_calls=self._gold_calls(entry),
            metadata={"family": entry["metadata"].get("source_dataset", task_id.split(":")[0]),
                      "functions": {"python": PYTHON_SOURCE} if self.cfg.tools else {}},
        )

    def _gold_calls(self, entry: dict[str, Any]) -> list[ToolCall] | None:
        """With the Python tool, a family whose generator records the ``expression`` it asks
        about (the arithmetic ones) gets one gold call that prints it; others have none."""
        expression = entry["metadata"].get("expression")
        if "python" not in self.cfg.tools or not isinstance(expression, str) or entry.get("answer") is None:
            return None
        return [ToolCall(name="python", arguments={"code": f"print({expression})"})]

    def score(self, task: Task, answer: str | None) -> float:
        """The family's own grade of ``answer`` (0.0 for no answer)."""
        if answer is None:
            return 0.0
        dataset, entry = self.entries[task.task_id]
        try:
            return float(dataset.score_answer(answer, entry))
        except Exception:  # noqa: BLE001 - a scorer that chokes on odd model output grades it 0
            return 0.0

    def success(self, task: Task, answer: str | None) -> bool:
        return self.score(task, answer) >= 1.0

    def make_env(self) -> Environment:
        return ToolUseEnv(self.limits, self.cfg.max_turns, judge=self.score, mcp=self.mcp)

    def demonstration(self, task: Task) -> list[dict[str, Any]]:
        """With a gold call (the Python tool on an arithmetic family): the call, what the sandbox
        printed, then the answer, when the printed value is the generator's answer (a division
        that prints ``2.0`` for ``2`` would teach answering otherwise than the tool said, so
        that question is answered at once). Otherwise the generator's answer, given at once."""
        if not task.gold_answers:
            raise ValueError(f"task {task.task_id} has no generated answer to demonstrate")
        if task.gold_tool_calls:
            messages = replay_gold_calls(self.make_env(), task)
            printed = [m["content"].strip() for m in messages if m["role"] == "tool"]
            if printed == [task.gold_answers[0].strip()]:
                return messages
        return [{"role": "assistant", "content": format_answer(task.gold_answers[0])}]

    def episode_metrics(self, task: Task, answer: str | None, calls: list[ToolCall],
                        labels: list[float]) -> dict[str, float]:
        """Adds ``score``: the family's grade, partial credit included."""
        return super().episode_metrics(task, answer, calls, labels) | {"score": self.score(task, answer)}

    def corpus_text(self) -> list[str]:
        out = [SYSTEM_PROMPT, PYTHON_PROMPT]
        for task in self.splits["train"]:
            out += [task.messages[-1]["content"], format_answer(task.gold_answers[0])] if task.gold_answers else []
        return out

    def provides(self) -> set[str]:
        """Gold calls only when every training question has one (an arithmetic family with the
        Python tool): an estimator matching calls needs them on every episode."""
        calls = {"gold_tool_calls"} if all(t.gold_tool_calls for t in self.splits["train"]) else set()
        return {"gold_answers", "anchor", *calls}
