"""A deterministic synthetic world of people, companies, cities and countries.

Built for a tiny transformer trained from scratch: names are short words made of a small
syllable set (every name word is unique in the world, so a name's words point to one entity),
and each entity has one short document in a fixed layout::

    Kavo Tulen is a person. born in: Mira. lives in: Dosk. works for: Zeltra. mentor: Pila Rosk.

Everything derives from ``seed`` through ``random.Random``; no ``hash()`` is used, so worlds are
identical across processes and runs.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

SYLLABLES = (
    "ka", "vo", "tu", "len", "mi", "ra", "zel", "tra", "pi", "la", "ros", "ko",
    "na", "del", "bi", "su", "mo", "ren", "fa", "gi", "dor", "ve", "lu", "sa",
)  # fmt: skip


@dataclass(frozen=True)
class Relation:
    """A relation kind: its endpoints, how documents show it and how questions ask about it."""

    name: str
    source: str
    """Entity kind the relation starts from."""
    target: str
    """Entity kind it points to."""
    label: str
    """Field label in the source's document ("born in")."""
    phrase: str
    """Noun phrase naming the target, with ``{x}`` for the source ("the birthplace of {x}")."""
    questions: tuple[str, ...]
    """Question templates asking for the target, with ``{x}`` for the source."""


RELATIONS: dict[str, Relation] = {
    r.name: r
    for r in (
        Relation(
            "born_in", "person", "city", "born in", "the birthplace of {x}",
            ("Where was {x} born?", "In which city was {x} born?",
             "What is the birthplace of {x}?"),
        ),
        Relation(
            "lives_in", "person", "city", "lives in", "the home city of {x}",
            ("Where does {x} live?", "In which city does {x} live?",
             "What is the home city of {x}?"),
        ),
        Relation(
            "works_for", "person", "company", "works for", "the employer of {x}",
            ("Which company does {x} work for?", "Who employs {x}?",
             "What is the employer of {x}?"),
        ),
        Relation(
            "mentor", "person", "person", "mentor", "the mentor of {x}",
            ("Who is the mentor of {x}?", "Who mentors {x}?", "Name the mentor of {x}."),
        ),
        Relation(
            "based_in", "company", "city", "based in", "the headquarters city of {x}",
            ("In which city is {x} based?", "Where is {x} based?",
             "What is the headquarters city of {x}?"),
        ),
        Relation(
            "founded_by", "company", "person", "founded by", "the founder of {x}",
            ("Who founded {x}?", "Who is the founder of {x}?", "Name the founder of {x}."),
        ),
        Relation(
            "in_country", "city", "country", "country", "the country of {x}",
            ("In which country is {x}?", "Which country is {x} in?",
             "What is the country of {x}?"),
        ),
        Relation(
            "capital", "country", "city", "capital", "the capital of {x}",
            ("What is the capital of {x}?", "Which city is the capital of {x}?",
             "Name the capital of {x}."),
        ),
    )
}  # fmt: skip

KINDS = ("country", "city", "company", "person")


@dataclass
class Entity:
    """One entity: its document id is ``doc{index:04d}``."""

    index: int
    kind: str
    name: str
    relations: dict[str, int] = field(default_factory=dict)
    """Relation name -> index of the target entity, in document order."""

    @property
    def doc_id(self) -> str:
        return f"doc{self.index:04d}"

    def fact_id(self, relation: str) -> str:
        """Passage id of one of its facts (``passages: fact``): document id and relation."""
        return f"{self.doc_id}#{relation}"


@dataclass
class World:
    """The entities of one seed and their documents."""

    seed: int
    entities: list[Entity]

    def document(self, index: int) -> str:
        """The entity's document: its name, kind, then one ``label: value.`` per relation."""
        entity = self.entities[index]
        article = "an" if entity.kind[0] in "aeiou" else "a"
        parts = [f"{entity.name} is {article} {entity.kind}."]
        parts += [self.field(rel, target) for rel, target in entity.relations.items()]
        return " ".join(parts)

    def field(self, relation: str, target: int) -> str:
        """One fact as its document shows it: ``label: value.``"""
        return f"{RELATIONS[relation].label}: {self.entities[target].name}."

    def documents(self) -> list[str]:
        return [self.document(i) for i in range(len(self.entities))]

    def facts(self) -> list[tuple[int, str, str]]:
        """Every fact as (entity index, relation name, passage text), in document order."""
        return [
            (e.index, rel, f"{e.name} {self.field(rel, target)}")
            for e in self.entities
            for rel, target in e.relations.items()
        ]

    def of_kind(self, kind: str) -> list[Entity]:
        return [e for e in self.entities if e.kind == kind]


def kind_counts(num_entities: int) -> dict[str, int]:
    """How many entities of each kind a world of ``num_entities`` has (people take the rest)."""
    countries = max(2, num_entities // 15)
    cities = max(countries, num_entities // 5)
    companies = max(2, num_entities // 5)
    people = num_entities - countries - cities - companies
    if people < 4:
        raise ValueError(f"num_entities={num_entities} leaves {people} people; use at least 20")
    return {"country": countries, "city": cities, "company": companies, "person": people}


class _Namer:
    """Draws name words from the syllable set, never the same word twice."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng
        self.used: set[str] = set()

    def word(self, syllables: int) -> str:
        for _ in range(10_000):
            word = "".join(self.rng.choice(SYLLABLES) for _ in range(syllables)).capitalize()
            if word not in self.used:
                self.used.add(word)
                return word
        raise ValueError("ran out of unique names: lower num_entities")

    def name(self, kind: str) -> str:
        if kind == "person":
            return f"{self.word(2)} {self.word(2)}"
        return self.word(3 if kind in ("company", "country") else 2)


def build_world(seed: int, num_entities: int) -> World:
    """Generate the world of ``seed``: names first, then each kind's relations."""
    rng = random.Random(seed)
    namer = _Namer(rng)
    entities: list[Entity] = []
    for kind, count in kind_counts(num_entities).items():
        for _ in range(count):
            entities.append(Entity(len(entities), kind, namer.name(kind)))
    world = World(seed, entities)
    countries = [e.index for e in world.of_kind("country")]
    cities = [e.index for e in world.of_kind("city")]
    companies = [e.index for e in world.of_kind("company")]
    people = [e.index for e in world.of_kind("person")]
    # every country gets at least one city, so every country has a capital of its own
    for i, city in enumerate(cities):
        country = countries[i] if i < len(countries) else rng.choice(countries)
        entities[city].relations["in_country"] = country
    for country in countries:
        own = [c for c in cities if entities[c].relations["in_country"] == country]
        entities[country].relations["capital"] = rng.choice(own)
    for company in companies:
        entities[company].relations["based_in"] = rng.choice(cities)
        entities[company].relations["founded_by"] = rng.choice(people)
    for person in people:
        rels = entities[person].relations
        rels["born_in"] = rng.choice(cities)
        rels["lives_in"] = rng.choice(cities)
        rels["works_for"] = rng.choice(companies)
        rels["mentor"] = rng.choice([p for p in people if p != person])
    return world
