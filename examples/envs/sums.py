"""A custom environment in ~30 lines (docs/envs.md, "Bring your environment"): add two numbers
with an ``add`` tool, then answer. ``env: {type: custom, source: examples.envs.sums:SumSource}``."""

import random

from envs.base import Observation, SplitTaskSource, SyncEnvironment, Task, answer_step, question_text, tool_step
from envs.toolcalls import ToolCall, format_answer, format_call, parse_action
from envs.tools import check_arguments, tool_message

ADD = {"type": "function", "function": {"name": "add", "description": "a + b", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}}}


class SumEnv(SyncEnvironment):
    max_turns = 3

    def start(self, task: Task) -> Observation:
        self.task = task
        return Observation(messages=[], anchor=question_text(task))

    def act(self, action: str):
        parsed = parse_action(action, self.chat_format)  # bad output is an observation, never an error
        if parsed.answer is not None:
            return answer_step(parsed.answer, parsed.answer.strip() == self.task.gold_answers[0], parsed.calls, {})
        problems = [p for c in parsed.calls for p in check_arguments(ADD, c.arguments)] + parsed.errors
        if problems or not parsed.calls:
            return tool_step([tool_message(None, "Error: " + ("; ".join(problems) or "call add or answer"))],
                             False, True, parsed.calls, {})
        return tool_step([tool_message("add", str(c.arguments["a"] + c.arguments["b"])) for c in parsed.calls],
                         False, False, parsed.calls, {})


class SumSource(SplitTaskSource):
    def __init__(self, num_train: int = 500, num_heldout: int = 100, seed: int = 0) -> None:
        rng = random.Random(seed)
        pairs = [(rng.randint(10, 999), rng.randint(10, 999)) for _ in range(num_train + num_heldout)]
        tasks = [Task(task_id=f"sum-{i}", tools=[ADD], gold_answers=[str(a + b)], gold_tool_calls=[ToolCall(name="add", arguments={"a": a, "b": b})],
                      messages=[{"role": "system", "content": "Call add, then give the sum inside <answer></answer>."},
                                {"role": "user", "content": f"What is {a} + {b}?"}]) for i, (a, b) in enumerate(pairs)]
        self.splits = {"train": tasks[:num_train], "heldout": tasks[num_train:]}

    def make_env(self) -> SumEnv:
        return SumEnv()

    def demonstration(self, task: Task) -> list[dict]:
        call = task.gold_tool_calls[0]
        return [{"role": "assistant", "content": format_call(call)}, tool_message("add", task.gold_answers[0]),
                {"role": "assistant", "content": format_answer(task.gold_answers[0])}]

    def provides(self) -> set[str]:
        return {"gold_answers", "gold_tool_calls", "anchor"}
