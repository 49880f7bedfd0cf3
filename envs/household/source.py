"""The household task source: one task per world seed, planner demonstrations.

Train and held-out tasks use disjoint ranges of world seeds derived from ``cfg.seed``, and no
held-out task opens with an observation a train task opens with.
Tasks carry the planner's trace as ``gold_tool_calls`` (useful for SFT), but ``provides()``
leaves it out: other traces are just as good, so it is no label to match against.
"""

from __future__ import annotations

from typing import Any

from envs.base import Environment, SplitTaskSource, Task
from envs.config import HouseholdConfig
from envs.household.env import ACT_TOOL, GOAL_REACHED, HouseholdEnv, opening
from envs.household.tasks import make_episode, plan
from envs.toolcalls import ToolCall, format_call

SYSTEM_PROMPT = (
    "You are in a house. Reach the goal by calling the act tool with one admissible "
    "command at a time."
)
SPLIT_OFFSET = {"train": 0, "heldout": 500_000}


class HouseholdTaskSource(SplitTaskSource):
    """Household tasks for ``cfg``; episodes rebuild their world from the task's seed."""

    def __init__(self, cfg: HouseholdConfig) -> None:
        self.cfg = cfg
        counts = {"train": cfg.num_train_tasks, "heldout": cfg.num_heldout_tasks}
        if max(counts.values()) > 500_000:
            raise ValueError("at most 500000 tasks per split (world seeds are split in ranges)")
        train = [self._task("train", i, i) for i in range(counts["train"])]
        # different seeds can share a layout and goal (objects hide in containers); held-out
        # skips those, so no held-out opening observation is ever seen in training
        seen = {t.messages[-1]["content"] for t in train}
        heldout: list[Task] = []
        offset = 0
        while len(heldout) < counts["heldout"]:
            task = self._task("heldout", len(heldout), offset)
            offset += 1
            if task.messages[-1]["content"] not in seen:
                heldout.append(task)
        self.splits = {"train": train, "heldout": heldout}

    def _task(self, split: str, index: int, offset: int) -> Task:
        world_seed = self.cfg.seed * 1_000_000 + SPLIT_OFFSET[split] + offset
        house, goal = make_episode(
            world_seed, list(self.cfg.goal_types), self.cfg.visible_items, self.cfg.other_rooms
        )
        commands = plan(house, goal)
        return Task(
            task_id=f"household-s{self.cfg.seed}-{split}-{index:05d}",
            messages=[
                {"role": "system", "content": SYSTEM_PROMPT},
                {"role": "user", "content": opening(house, goal)},
            ],
            tools=[ACT_TOOL],
            gold_answers=[GOAL_REACHED],
            gold_tool_calls=[ToolCall(name="act", arguments={"command": c}) for c in commands],
            metadata={
                "world_seed": world_seed,
                "goal_types": list(self.cfg.goal_types),
                "visible_items": self.cfg.visible_items,
                "other_rooms": self.cfg.other_rooms,
                "goal": goal.text(),
                "plan_length": len(commands),
            },
        )

    def make_env(self) -> Environment:
        return self.make_household_env()

    def make_household_env(self) -> HouseholdEnv:
        return HouseholdEnv(self.cfg.max_turns, self.cfg.success_reward, self.cfg.invalid_penalty)

    def demonstration(self, task: Task) -> list[dict[str, Any]]:
        """The planner's commands as ``act`` calls, each with its real observation.

        The last step reaches the goal and ends the episode, so it has no observation.
        Raises ValueError when the plan does not fit in ``max_turns``.
        """
        env = self.make_household_env()
        env.start(task)
        commands = plan(env.house, env.goal)  # type: ignore[arg-type]
        if len(commands) > self.cfg.max_turns:
            raise ValueError(f"task {task.task_id}: plan of {len(commands)} exceeds max_turns")
        messages: list[dict[str, Any]] = []
        for command in commands:
            action = format_call(ToolCall(name="act", arguments={"command": command}))
            result = env.act(action)
            messages += [{"role": "assistant", "content": action}, *result.observation.messages]
        if not result.info["success"]:
            raise ValueError(f"task {task.task_id}: the planner's commands did not reach the goal")
        return messages

    def corpus_text(self) -> list[str]:
        out = [SYSTEM_PROMPT] + [t.messages[-1]["content"] for t in self.splits["train"]]
        for task in self.splits["train"][:50]:
            out += [m["content"] for m in self.demonstration(task)]
        return out

    def provides(self) -> set[str]:
        return {"anchor"}
