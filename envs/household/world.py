"""An ALFWorld-like household: rooms, receptacles that open and close, objects with states.

The state is plain data; ``admissible`` lists every command valid in a state and ``apply``
performs one. Both are deterministic, so the same world seed always yields the same initial
state and the same observations for the same actions: observation texts recur across the
rollouts of a group, which is what anchor-based grouping needs.

Commands: ``go to <receptacle>`` (in the current room), ``go to <room>``, ``open/close <r>``,
``take <o> from <r>``, ``put <o> in/on <r>``, ``clean <o> with <sinkbasin>``,
``heat <o> with <microwave>``, ``cool <o> with <fridge>``, ``look``, ``inventory``.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

ROOM_RECEPTACLES: dict[str, tuple[str, ...]] = {
    "kitchen": ("countertop", "cabinet", "drawer", "fridge", "microwave", "sinkbasin",
                "diningtable"),
    "livingroom": ("sofa", "coffeetable", "shelf", "drawer", "cabinet"),
    "bathroom": ("sinkbasin", "cabinet", "countertop"),
    "bedroom": ("bed", "desk", "drawer", "shelf"),
}  # fmt: skip
OPENABLE = {"cabinet", "drawer", "fridge", "microwave"}
APPLIANCE = {"sinkbasin": "clean", "microwave": "heat", "fridge": "cool"}
OBJECTS: dict[str, set[str]] = {
    "mug": {"clean", "heat", "cool"}, "cup": {"clean", "heat", "cool"},
    "plate": {"clean"}, "bowl": {"clean", "heat", "cool"}, "apple": {"clean", "heat", "cool"},
    "potato": {"clean", "heat", "cool"}, "egg": {"heat", "cool"}, "book": set(),
    "pen": set(), "soapbar": set(), "towel": set(), "vase": set(),
}  # fmt: skip
STATE_WORD = {"clean": "clean", "heat": "hot", "cool": "cold"}


@dataclass
class Receptacle:
    name: str
    kind: str
    room: str
    is_open: bool = True


@dataclass
class Item:
    name: str
    kind: str
    location: str
    """Receptacle name, or "agent" while held."""
    dirty: bool = False
    temperature: str = "room"
    """"room", "hot" or "cold"."""


@dataclass
class House:
    """The whole mutable state of one episode."""

    receptacles: dict[str, Receptacle]
    items: dict[str, Item]
    room: str
    at: str | None = None
    holding: str | None = None
    rooms: list[str] = field(default_factory=list)
    show_items: bool = False
    """The room description lists what each receptacle holds (closed ones included)."""

    # -- descriptions ------------------------------------------------------------------
    def item_text(self, item: Item) -> str:
        tags = ["dirty"] if item.dirty else []
        if item.temperature != "room":
            tags.append(item.temperature)
        return f"{item.name} ({', '.join(tags)})" if tags else item.name

    def contents(self, receptacle: str) -> str:
        rec = self.receptacles[receptacle]
        if not rec.is_open:
            return f"The {receptacle} is closed."
        inside = [self.item_text(i) for i in self.items.values() if i.location == receptacle]
        where = "In" if rec.kind in OPENABLE else "On"
        return f"{where} the {receptacle} you see: {', '.join(inside) if inside else 'nothing'}."

    def holding_text(self) -> str:
        held = self.item_text(self.items[self.holding]) if self.holding else "nothing"
        return f"You are holding {held}."

    def status(self) -> str:
        where = f"at the {self.at}" if self.at else "in the middle of the room"
        return f"You are in the {self.room}, {where}. {self.holding_text()}"

    def look(self) -> str:
        here = [self._listed(r) for r in self.receptacles.values() if r.room == self.room]
        others = [r for r in self.rooms if r != self.room]
        return (
            f"You are in the {self.room}. You see: {', '.join(here)}. "
            f"Other rooms: {', '.join(others) if others else 'none'}."
        )

    def _listed(self, rec: Receptacle) -> str:
        inside = [i.name for i in self.items.values() if i.location == rec.name]
        return f"{rec.name} ({', '.join(inside)})" if self.show_items and inside else rec.name

    # -- rules -------------------------------------------------------------------------
    def admissible(self) -> list[str]:
        """Every valid command in this state, in a fixed order."""
        cmds = [f"go to {r.name}" for r in self.receptacles.values()
                if r.room == self.room and r.name != self.at]  # fmt: skip
        cmds += [f"go to {room}" for room in self.rooms if room != self.room]
        if self.at is not None:
            rec = self.receptacles[self.at]
            if rec.kind in OPENABLE:
                cmds.append(f"{'close' if rec.is_open else 'open'} {rec.name}")
            if rec.is_open and self.holding is None:
                cmds += [f"take {i.name} from {rec.name}" for i in self.items.values()
                         if i.location == rec.name]  # fmt: skip
            if rec.is_open and self.holding is not None:
                cmds.append(f"put {self.holding} in/on {rec.name}")
            if self.holding is not None and rec.kind in APPLIANCE:
                verb = APPLIANCE[rec.kind]
                if verb in OBJECTS[self.items[self.holding].kind]:
                    cmds.append(f"{verb} {self.holding} with {rec.name}")
        return cmds + ["look", "inventory"]

    def apply(self, command: str) -> str:
        """Perform an admissible command and return its feedback text."""
        words = command.split(" ")
        if command == "look":
            return self.look()
        if command == "inventory":
            return self.holding_text()
        if command.startswith("go to "):
            target = command[len("go to ") :]
            if target in self.rooms:
                self.room, self.at = target, None
                return f"You go to the {target}. {self.look()}"
            self.at = target
            return f"You arrive at the {target}. {self.contents(target)}"
        if words[0] in ("open", "close"):
            rec = self.receptacles[" ".join(words[1:])]
            rec.is_open = words[0] == "open"
            seen = self.contents(rec.name) if rec.is_open else ""
            return f"You {words[0]} the {rec.name}. {seen}".rstrip()
        obj = f"{words[1]} {words[2]}"
        if words[0] == "take":
            self.items[obj].location, self.holding = "agent", obj
            return f"You take the {obj} from the {self.at}."
        if words[0] == "put":
            assert self.at is not None
            self.items[obj].location, self.holding = self.at, None
            return f"You put the {obj} in/on the {self.at}."
        item = self.items[obj]
        if words[0] == "clean":
            item.dirty = False
        else:
            item.temperature = "hot" if words[0] == "heat" else "cold"
        return f"You {words[0]} the {obj} using the {self.at}."


def build_house(rng: random.Random, other_rooms: int = 3) -> House:
    """A random house: the kitchen plus 1 to ``other_rooms`` other rooms (none when it is 0),
    1-2 of each receptacle kind, objects."""
    count = rng.randint(min(1, other_rooms), other_rooms)
    others = rng.sample(sorted(set(ROOM_RECEPTACLES) - {"kitchen"}), count)
    rooms = ["kitchen", *sorted(others)]
    receptacles: dict[str, Receptacle] = {}
    counts: dict[str, int] = {}
    for room in rooms:
        for kind in ROOM_RECEPTACLES[room]:
            for _ in range(rng.randint(1, 2) if kind not in APPLIANCE else 1):
                counts[kind] = counts.get(kind, 0) + 1
                name = f"{kind} {counts[kind]}"
                receptacles[name] = Receptacle(name, kind, room, is_open=kind not in OPENABLE)
    holders = [r for r in receptacles.values() if r.kind not in APPLIANCE]
    items: dict[str, Item] = {}
    for kind in rng.sample(sorted(OBJECTS), rng.randint(5, 8)):
        for n in range(1, rng.randint(1, 2) + 1):
            item = Item(f"{kind} {n}", kind, rng.choice(holders).name)
            item.dirty = "clean" in OBJECTS[kind] and rng.random() < 0.5
            items[item.name] = item
    return House(receptacles, items, room="kitchen", rooms=rooms)
