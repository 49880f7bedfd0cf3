"""The household episode: act with ``act(command)`` until the goal holds or turns run out.

Each observation is the command's feedback, the agent's status and the admissible commands;
the anchor is that raw text, so identical states in different rollouts share an anchor.
Rewards (``StepResult.reward``): ``success_reward`` on the step that reaches the goal,
``invalid_penalty`` on a step with any invalid action (inadmissible command, malformed call,
wrong tool, no call). Reaching the goal ends the episode with ``answer = GOAL_REACHED``, which
is each task's gold answer, so the generic ``TaskSource.success`` applies unchanged.

Step labels (``info["label"]``): 1 when the step shortened the planner's path to the goal.
"""

from __future__ import annotations

from typing import Any

from envs.formats import DEFAULT_FORMAT
from envs.base import Observation, StepResult, SyncEnvironment, Task, step_observation
from envs.household.tasks import Goal, plan, task_episode
from envs.household.world import House
from envs.toolcalls import ToolCall, format_call, parse_action
from envs.tools import check_arguments, tool_message

GOAL_REACHED = "goal reached"
ACT_TOOL: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "act",
        "description": "Perform one admissible command in the house.",
        "parameters": {
            "type": "object",
            "properties": {"command": {"type": "string", "description": "e.g. open cabinet 1"}},
            "required": ["command"],
        },
    },
}
def no_action_hint(chat_format: str = DEFAULT_FORMAT) -> str:
    """What the model is told when it did not act, its call in the policy's format."""
    call = format_call(ToolCall(name="act", arguments={"command": "..."}), chat_format)
    return f"No action found. Act with {call}, using one of the admissible commands."


NO_ACTION_HINT = no_action_hint()


def describe(house: House, feedback: str) -> str:
    """One observation: feedback, status and admissible commands."""
    return f"{feedback}\n{house.status()}\nAdmissible actions: {', '.join(house.admissible())}."


def opening(house: House, goal: Goal) -> str:
    """The first observation, which is also the task's user message."""
    return describe(house, f"{house.look()}\nYour task is to: {goal.text()}.")


class HouseholdEnv(SyncEnvironment):
    """One household episode at a time, rebuilt from the task's world seed."""

    def __init__(self, max_turns: int, success_reward: float, invalid_penalty: float) -> None:
        self.max_turns = max_turns
        self.success_reward = success_reward
        self.invalid_penalty = invalid_penalty
        self.house: House | None = None
        self.goal: Goal | None = None
        self.turn = 0
        self.done = True
        self.distance = 0

    def start(self, task: Task) -> Observation:
        """Synchronous ``reset``; raises ValueError when the task has no world seed."""
        try:
            self.house, self.goal = task_episode(task.metadata)
        except ValueError as e:
            raise ValueError(f"task {task.task_id}: {e}") from None
        self.turn, self.done = 0, False
        self.distance = len(plan(self.house, self.goal))
        return Observation(messages=[], anchor=opening(self.house, self.goal))

    def act(self, action: str) -> StepResult:
        """Synchronous ``step``: run each call in order until the goal holds."""
        if self.house is None or self.goal is None or self.done:
            raise RuntimeError("step() called with no episode running: call reset(task) first")
        self.turn += 1
        parsed = parse_action(action, self.chat_format)
        messages = [tool_message(None, f"Error: {e}") for e in parsed.errors]
        invalid = bool(parsed.errors)
        if not parsed.calls and not parsed.errors:
            messages, invalid = [{"role": "user", "content": no_action_hint(self.chat_format)}], True
        reached = False
        for call in parsed.calls:
            text, ok = self._run(call)
            messages.append(tool_message(call.name, text))
            invalid |= not ok
            reached = self.goal.reached(self.house)
            if reached:
                break
        before, self.distance = self.distance, len(plan(self.house, self.goal))
        self.done = reached or self.turn >= self.max_turns
        reward = self.success_reward if reached else 0.0
        reward += self.invalid_penalty if invalid else 0.0
        return StepResult(
            observation=step_observation(messages, self.done),
            reward=reward,
            done=self.done,
            invalid_action=invalid,
            tool_calls=parsed.calls,
            answer=GOAL_REACHED if reached else None,
            info={"label": int(self.distance < before), "success": reached, "turn": self.turn},
        )

    def _run(self, call: ToolCall) -> tuple[str, bool]:
        assert self.house is not None
        if call.name != "act":
            return f"Error: unknown tool {call.name!r}; available tools: act.", False
        problems = check_arguments(ACT_TOOL, call.arguments)
        if problems:
            return "Error: act: " + "; ".join(problems) + ".", False
        command = " ".join(call.arguments["command"].strip().lower().split())
        if command not in self.house.admissible():
            return describe(self.house, f"Nothing happens: {command!r} is not admissible."), False
        return describe(self.house, self.house.apply(command)), True
