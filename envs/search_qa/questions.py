"""Multi-hop questions over a synthetic world, split into disjoint train and held-out sets.

A question follows a relation chain from a start entity: "In which city is the employer of
Kavo Tulen based?" is ``works_for -> based_in`` from Kavo Tulen. The gold path searches each
entity on the chain before the answer, by exact name, so copying from the retrieved document
is the skill to learn.

The split is made on (start entity, chain) pairs: a held-out question asks about a pair that no
train question asks about, in any wording.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from envs.base import Task
from envs.search_qa.env import SEARCH_TOOL
from envs.search_qa.world import RELATIONS, World
from envs.toolcalls import ToolCall

SYSTEM_PROMPT = (
    "Answer the question. Use the search tool to look up entities, "
    "then give the final answer inside <answer></answer>."
)


@dataclass(frozen=True)
class Path:
    """A start entity and the chain of relations followed from it."""

    start: int
    chain: tuple[str, ...]

    def entities(self, world: World) -> list[int]:
        """Every entity on the path: start, intermediates, answer (``len(chain) + 1``)."""
        out = [self.start]
        for rel in self.chain:
            out.append(world.entities[out[-1]].relations[rel])
        return out

    def question(self, world: World, template: int) -> str:
        subject = world.entities[self.start].name
        for rel in self.chain[:-1]:
            subject = RELATIONS[rel].phrase.format(x=subject)
        return RELATIONS[self.chain[-1]].questions[template].format(x=subject)


def chains_from(kind: str, hops: int) -> list[tuple[str, ...]]:
    """Every relation chain of length ``hops`` that can start from an entity of ``kind``."""
    if hops == 0:
        return [()]
    out = []
    for rel in RELATIONS.values():
        if rel.source == kind:
            out += [(rel.name, *rest) for rest in chains_from(rel.target, hops - 1)]
    return out


def paths(world: World, hops: int) -> list[Path]:
    """All non-degenerate paths of ``hops``: the answer is never an entity already on the way
    (e.g. "the country of the capital of X" is X, answerable without searching)."""
    out = []
    for entity in world.entities:
        for chain in chains_from(entity.kind, hops):
            path = Path(entity.index, chain)
            ents = path.entities(world)
            if ents[-1] not in ents[:-1]:
                out.append(path)
    return out


def quotas(total: int, weights: list[float]) -> list[int]:
    """Split ``total`` by ``weights`` with largest remainders, so the parts sum to ``total``."""
    raw = [total * w / sum(weights) for w in weights]
    parts = [int(r) for r in raw]
    by_remainder = sorted(range(len(raw)), key=lambda i: (parts[i] - raw[i], i))
    for i in by_remainder[: total - sum(parts)]:
        parts[i] += 1
    return parts


def make_task(world: World, path: Path, template: int, task_id: str, passages: str = "entity") -> Task:
    """The task asking ``path``'s question in wording ``template``, with its gold labels."""
    ents = path.entities(world)
    question = path.question(world, template)
    names = [world.entities[i].name for i in ents]
    if passages == "fact":  # each hop searches its entity and relation, and retrieves that fact
        queries = [f"{n} {RELATIONS[r].label}" for n, r in zip(names, path.chain)]
        support = [world.entities[e].fact_id(r) for e, r in zip(ents, path.chain)]
    else:
        queries = names[:-1]
        support = [world.entities[i].doc_id for i in ents[:-1]]
    return Task(
        task_id=task_id,
        messages=[
            {"role": "system", "content": SYSTEM_PROMPT},
            {"role": "user", "content": question},
        ],
        tools=[SEARCH_TOOL],
        gold_answers=[names[-1]],
        gold_tool_calls=[ToolCall(name="search", arguments={"query": q}) for q in queries],
        metadata={
            "hops": len(path.chain),
            "chain": list(path.chain),
            "path": names,
            "supporting_docs": support,
            "question": question,
            "world_seed": world.seed,
        },
    )


def split_tasks(
    world: World,
    hops: list[int],
    weights: list[float],
    num_train: int,
    num_heldout: int,
    passages: str = "entity",
    max_train_pairs: int | None = None,
) -> dict[str, list[Task]]:
    """Disjoint train/held-out tasks with hop mix ``weights``.

    Held-out takes ``num_heldout`` paths (one wording each); train draws from every wording of
    the remaining paths, reshuffling and repeating only once all of them were used.

    The first hop count draws from the split's own stream; each later one from a stream of its
    own, so which paths a hop count holds out (the head of its shuffled pool) depends on the
    seed and its own quota alone, not on how many train tasks an earlier hop count drew: a warm
    start built with another ``num_train_tasks`` or ``max_train_pairs`` (``policy.sft.env``)
    shuffles every pool alike, and holding out at least as many paths keeps the run's held-out
    questions out of its demonstrations.
    """
    rng = random.Random(world.seed * 7919 + 1)  # a stream apart from the world's own
    heldout: list[tuple[Path, int]] = []
    train: list[tuple[Path, int]] = []
    for k, (h, n_held, n_train) in enumerate(zip(
        hops, quotas(num_heldout, weights), quotas(num_train, weights), strict=True
    )):
        pool = paths(world, h)
        hop_rng = rng if k == 0 else random.Random((world.seed * 7919 + 1) * 31 + h)
        hop_rng.shuffle(pool)
        if n_held >= len(pool):
            raise ValueError(
                f"{h}-hop: {n_held} held-out tasks requested but the world has only "
                f"{len(pool)} {h}-hop questions; raise num_entities or lower num_heldout_tasks"
            )
        heldout += [
            (p, hop_rng.randrange(len(RELATIONS[p.chain[-1]].questions))) for p in pool[:n_held]
        ]
        kept = pool[n_held:] if max_train_pairs is None else pool[n_held : n_held + max_train_pairs]
        wordings = [(p, t) for p in kept for t in range(len(RELATIONS[p.chain[-1]].questions))]
        drawn: list[tuple[Path, int]] = []
        while len(drawn) < n_train:
            hop_rng.shuffle(wordings)
            drawn += wordings[: n_train - len(drawn)]
        train += drawn
    rng.shuffle(heldout)
    rng.shuffle(train)
    prefix = f"search_qa-s{world.seed}"
    return {
        split: [
            make_task(world, path, t, f"{prefix}-{split}-{i:05d}", passages)
            for i, (path, t) in enumerate(items)
        ]
        for split, items in (("train", train), ("heldout", heldout))
    }
