"""Household goals, episodes from world seeds, and the planner behind demonstrations.

A task is a world seed: ``make_episode(seed, goal_types)`` rebuilds the same house and goal
every time. The planner is a short script over the true state (pick a fitting object, fetch
it, change its state with the right appliance, put it in a target receptacle); it is not
optimal, but it always succeeds, and the change in its plan length labels steps as progress.
"""

from __future__ import annotations

import copy
import random
from dataclasses import dataclass
from typing import Any

from envs.household.world import APPLIANCE, OBJECTS, STATE_WORD, House, build_house


@dataclass(frozen=True)
class Goal:
    """Put an object of ``kind`` (in ``state``, if any) in a receptacle of ``target``."""

    verb: str
    """"place", "clean", "heat" or "cool"."""
    kind: str
    target: str

    def text(self) -> str:
        state = "" if self.verb == "place" else f"{STATE_WORD[self.verb]} "
        article = "an" if (state or self.kind)[0] in "aeiou" else "a"
        return f"put {article} {state}{self.kind} in {self.target}"

    def fits(self, house: House, name: str) -> bool:
        """Whether the item has the kind and state the goal asks for."""
        item = house.items[name]
        return item.kind == self.kind and (
            self.verb == "place"
            or (self.verb == "clean" and not item.dirty)
            or (self.verb == "heat" and item.temperature == "hot")
            or (self.verb == "cool" and item.temperature == "cold")
        )

    def reached(self, house: House) -> bool:
        return any(
            self.fits(house, i.name)
            and i.location in house.receptacles
            and house.receptacles[i.location].kind == self.target
            for i in house.items.values()
        )


def make_episode(
    seed: int, goal_types: list[str], show_items: bool = False, other_rooms: int = 3
) -> tuple[House, Goal]:
    """The house and goal of world ``seed``; the goal never holds at the start.
    ``show_items``: room descriptions list receptacles' contents (``House.show_items``);
    ``other_rooms``: most rooms besides the kitchen (``build_house``)."""
    rng = random.Random(seed)
    for _ in range(100):
        house = build_house(rng, other_rooms)
        verb = rng.choice(sorted(goal_types))
        kinds = sorted({i.kind for i in house.items.values()
                        if verb == "place" or verb in OBJECTS[i.kind]})  # fmt: skip
        targets = sorted({r.kind for r in house.receptacles.values() if r.kind not in APPLIANCE})
        if not kinds:
            continue
        goal = Goal(verb, rng.choice(kinds), rng.choice(targets))
        for item in house.items.values():  # start every candidate in the unwanted state
            if item.kind == goal.kind and verb == "clean":
                item.dirty = True
        if not goal.reached(house):
            house.show_items = show_items
            return house, goal
    raise RuntimeError(f"world seed {seed}: no valid goal found")  # never seen in practice


def task_episode(metadata: dict[str, Any]) -> tuple[House, Goal]:
    """The house and goal a task's metadata names (``HouseholdTaskSource`` writes it).
    Raises ValueError when the world seed or goal types are missing."""
    seed, goal_types = metadata.get("world_seed"), metadata.get("goal_types")
    if not isinstance(seed, int) or not goal_types:
        raise ValueError("household task metadata needs world_seed and goal_types")
    return make_episode(
        seed, goal_types, bool(metadata.get("visible_items")), int(metadata.get("other_rooms", 3))
    )


def _go(house: House, receptacle: str, cmds: list[str], open_it: bool = True) -> None:
    rec = house.receptacles[receptacle]
    steps = []
    if house.room != rec.room:
        steps.append(f"go to {rec.room}")
    if house.at != receptacle or house.room != rec.room:
        steps.append(f"go to {receptacle}")
    for step in steps:
        cmds.append(step)
        house.apply(step)
    if open_it and not rec.is_open:
        cmds.append(f"open {receptacle}")
        house.apply(cmds[-1])


def _nearest(house: House, kind: str) -> str:
    """The first receptacle of ``kind``, preferring the current room."""
    names = sorted(r.name for r in house.receptacles.values() if r.kind == kind)
    local = [n for n in names if house.receptacles[n].room == house.room]
    return (local or names)[0]


def plan(start: House, goal: Goal) -> list[str]:
    """Commands that reach ``goal`` from ``start`` (which is left untouched)."""
    house = copy.deepcopy(start)
    cmds: list[str] = []
    if goal.reached(house):
        return cmds
    if house.holding is not None and house.items[house.holding].kind != goal.kind:
        if house.at is None or house.receptacles[house.at].kind in APPLIANCE:
            holders = sorted(r.name for r in house.receptacles.values()
                             if r.room == house.room and r.kind not in APPLIANCE)  # fmt: skip
            _go(house, holders[0], cmds)
        _go(house, house.at or "", cmds)  # opens it when closed
        cmds.append(f"put {house.holding} in/on {house.at}")
        house.apply(cmds[-1])
    if house.holding is None:
        name = sorted(i.name for i in house.items.values() if i.kind == goal.kind)[0]
        _go(house, house.items[name].location, cmds)
        cmds.append(f"take {name} from {house.at}")
        house.apply(cmds[-1])
    held = house.holding
    assert held is not None
    if not goal.fits(house, held):
        appliance = _nearest(house, next(k for k, v in APPLIANCE.items() if v == goal.verb))
        _go(house, appliance, cmds, open_it=False)
        cmds.append(f"{goal.verb} {held} with {appliance}")
        house.apply(cmds[-1])
    _go(house, _nearest(house, goal.target), cmds)
    cmds.append(f"put {held} in/on {house.at}")
    house.apply(cmds[-1])
    assert goal.reached(house), "planner failed"  # a bug in the planner, never in the agent
    return cmds
