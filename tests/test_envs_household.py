"""The household environment: seeded worlds, rules, rewards, anchors and planner demos."""

from __future__ import annotations

import asyncio
from collections import Counter
from functools import cache

import pytest
from pydantic import ValidationError

from envs.base import StepResult, Task
from envs.config import HouseholdConfig
from envs.household.env import GOAL_REACHED
from envs.household.source import HouseholdTaskSource
from envs.household.tasks import make_episode, plan
from envs.household.world import ROOM_RECEPTACLES
from envs.registry import make_task_source
from envs.toolcalls import ToolCall, format_call


@cache
def source(**kw) -> HouseholdTaskSource:
    return HouseholdTaskSource(HouseholdConfig(num_train_tasks=60, num_heldout_tasks=20, **kw))


def act(command: str) -> str:
    return format_call(ToolCall(name="act", arguments={"command": command}))


def episode(src: HouseholdTaskSource, task: Task, actions: list[str]) -> list[StepResult]:
    async def go() -> list[StepResult]:
        env = src.make_env()
        await env.reset(task)
        return [await env.step(a) for a in actions]

    return asyncio.run(go())


def test_same_task_same_initial_state_and_recurring_observations():
    src = source()
    task = src.tasks("train")[3]
    first = asyncio.run(src.make_env().reset(task))
    assert first.anchor == task.messages[-1]["content"]
    actions = [act("look"), act("go to countertop 1"), act("inventory")]
    a, b = episode(src, task, actions), episode(src, task, actions)
    assert [r.observation.anchor for r in a] == [r.observation.anchor for r in b]
    again = HouseholdTaskSource(HouseholdConfig(num_train_tasks=60, num_heldout_tasks=20))
    assert again.tasks("train")[3].model_dump() == task.model_dump()


def test_splits_use_disjoint_world_seeds_and_mix_goal_kinds():
    src = source()
    train, held = src.tasks("train"), src.tasks("heldout")
    assert not {t.metadata["world_seed"] for t in train} & {t.metadata["world_seed"] for t in held}
    assert not {t.messages[-1]["content"] for t in train} & {
        t.messages[-1]["content"] for t in held
    }
    words = Counter(t.metadata["goal"].split()[2] for t in train)
    assert {"clean", "hot", "cold"} <= set(words)
    assert held[0].task_id == "household-s0-heldout-00000"
    assert src.provides() == {"anchor"}


def test_planner_demonstrations_reach_the_goal_with_reward_ten():
    src = source()
    for task in src.tasks("train")[:15] + src.tasks("heldout")[:5]:
        demo = src.demonstration(task)
        actions = [m["content"] for m in demo if m["role"] == "assistant"]
        assert [format_call(c) for c in task.gold_tool_calls] == actions
        results = episode(src, task, actions)
        assert results[-1].done and results[-1].reward == 10.0
        assert results[-1].answer == GOAL_REACHED and src.success(task, results[-1].answer)
        assert all(not r.invalid_action and r.reward == 0.0 for r in results[:-1])
        # every planner step shortens the planner's own path: progress label 1 throughout
        assert [r.info["label"] for r in results] == [1] * len(results)


def test_observations_list_admissible_actions_and_invalid_actions_cost():
    src = source()
    task = src.tasks("train")[0]
    bad = [act("fly to the moon"), "I will look around.", act(""),
           '<tool_call>{"name": "walk", "arguments": {"command": "look"}}</tool_call>']  # fmt: skip
    results = episode(src, task, [act("look"), *bad])
    assert "Admissible actions: " in results[0].observation.anchor
    assert not results[0].invalid_action and results[0].reward == 0.0
    for r in results[1:]:
        assert r.invalid_action and r.reward == pytest.approx(-0.1) and not r.done
    assert "Nothing happens" in results[1].observation.messages[0]["content"]
    assert "No action found" in results[2].observation.messages[0]["content"]
    assert "unknown tool" in results[4].observation.messages[0]["content"]


def test_rules_open_take_heat_and_put():
    house, goal = make_episode(11, ["heat"])
    steps = plan(house, goal)
    assert any(s.startswith("heat ") for s in steps) and steps[-1].startswith("put ")
    closed = [r for r in house.receptacles.values() if not r.is_open]
    assert closed and all("take" not in c for c in house.admissible())  # nothing reachable yet
    for command in steps:
        assert command in house.admissible(), command
        house.apply(command)
    assert goal.reached(house)
    held = [i for i in house.items.values() if i.kind == goal.kind and i.temperature == "hot"]
    assert held and house.holding is None


def test_turn_limit_and_step_after_done():
    src = source(max_turns=5)
    task = src.tasks("train")[0]
    results = episode(src, task, [act("look")] * 5)
    assert [r.done for r in results] == [False] * 4 + [True]
    assert results[-1].answer is None and not src.success(task, results[-1].answer)
    env = src.make_household_env()
    env.start(task)
    with pytest.raises(RuntimeError):
        for _ in range(6):
            env.act(act("look"))


def test_config_and_registry():
    src = make_task_source({"type": "household", "num_train_tasks": 3, "num_heldout_tasks": 1,
                            "goal_types": ["place"]})  # fmt: skip
    assert all(t.metadata["goal"].split()[2] not in ("clean", "hot", "cold")
               for t in src.tasks("train"))  # fmt: skip
    with pytest.raises(ValidationError):
        HouseholdConfig(goal_types=["juggle"])
    with pytest.raises(ValueError, match="world_seed"):
        src.make_env().start(Task(task_id="x", messages=[]))  # type: ignore[attr-defined]


def test_visible_items_lists_each_receptacles_contents_in_room_descriptions():
    hidden, shown = source(), source(visible_items=True)
    task, seen = hidden.tasks("train")[0], shown.tasks("train")[0]
    assert task.metadata["world_seed"] == seen.metadata["world_seed"]  # same world, same goal
    house, _ = make_episode(seen.metadata["world_seed"], seen.metadata["goal_types"], True)
    room = [r for r in house.receptacles.values() if r.room == house.room]
    for rec in room:
        inside = [i.name for i in house.items.values() if i.location == rec.name]
        listed = f"{rec.name} ({', '.join(inside)})" if inside else rec.name
        assert listed in seen.messages[-1]["content"]  # closed ones too
        assert f"{rec.name} (" not in task.messages[-1]["content"]  # off: names only
    assert any(i.location in {r.name for r in room} for i in house.items.values())
    # the episode shows the same: moving to another room lists that room's contents
    other = next(r for r in house.rooms if r != house.room)
    (step,) = episode(shown, seen, [act(f"go to {other}")])
    far = [r.name for r in house.receptacles.values() if r.room == other]
    for item in house.items.values():
        if item.location in far:
            assert item.name in step.observation.anchor
    # the demonstration still reaches the goal
    assert episode(shown, seen, [m["content"] for m in shown.demonstration(seen)
                                 if m["role"] == "assistant"])[-1].answer == GOAL_REACHED


def test_other_rooms_bounds_the_house_and_keeps_default_worlds():
    # default worlds are those of earlier releases (cached warm starts and recorded results
    # depend on them): rooms of world seeds 0-2 as build_house drew them before the option
    assert [make_episode(s, ["place"])[0].rooms for s in range(3)] == [
        ["kitchen", "bathroom", "bedroom"], ["kitchen", "livingroom"], ["kitchen", "bathroom"]]
    for bound in (0, 1):
        src = source(other_rooms=bound, goal_types=("place",), visible_items=True)
        for task in src.tasks("train"):
            house, _ = make_episode(task.metadata["world_seed"], ["place"], True, bound)
            assert len(house.rooms) == 1 + bound
            assert task.metadata["other_rooms"] == bound
        task = src.tasks("train")[0]
        # the episode rebuilds the same bounded world from the task's metadata, and the
        # planner's demonstration still reaches the goal in it
        steps = episode(src, task, [m["content"] for m in src.demonstration(task)
                                    if m["role"] == "assistant"])  # fmt: skip
        assert steps[-1].answer == GOAL_REACHED
        if bound == 0:
            assert "Other rooms: none." in task.messages[-1]["content"]
            assert all(not c.startswith("go to ") or c[6:] not in ROOM_RECEPTACLES
                       for c in make_episode(task.metadata["world_seed"], ["place"], True, 0)[0]
                       .admissible())  # fmt: skip
    with pytest.raises(ValidationError, match="other_rooms"):
        HouseholdConfig(other_rooms=4)
