"""Task sources of the search-QA environment: the synthetic world, or real-format files.

Both build their retrieval index once and share it with every episode (``make_env``), and both
produce demonstrations by running the gold searches through a real episode, so demonstration
observations are exactly what the model will see.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from envs.base import SPLITS, Environment, SplitTaskSource, Task, TaskSource, normalize_answer, replay_gold_calls
from envs.config import SearchQAConfig
from envs.search_qa.env import SearchCorpus, SearchEnv
from envs.search_qa.questions import SYSTEM_PROMPT, split_tasks
from envs.search_qa.retrieval import BM25Retriever
from envs.search_qa.world import World, build_world
from envs.toolcalls import ToolCall


class SearchTaskSource(SplitTaskSource):
    """Shared behaviour: tasks by split, episodes over one corpus, replayed demonstrations."""

    corpora: Mapping[int, SearchCorpus] | None = None
    """World seed -> corpus when tasks come from several worlds; episodes then search the
    corpus of their task's ``world_seed``."""

    def __init__(self, cfg: SearchQAConfig, corpus: SearchCorpus, splits: dict[str, list[Task]]):
        self.cfg = cfg
        self.corpus = corpus
        self.splits = splits

    def make_env(self) -> Environment:
        return self.make_search_env()

    def make_search_env(self) -> SearchEnv:
        return SearchEnv(self.corpus, self.cfg.top_k, self.cfg.turn_limit, judge=self.success,
                         corpora=self.corpora)

    def demonstration(self, task: Task) -> list[dict[str, Any]]:
        """Gold searches, each with its real result, then ``<answer>gold</answer>``.

        Raises ValueError when the task has no gold trace or the replay does not succeed
        (e.g. the gold answer is not among the retrieved documents of a real corpus).
        """
        return replay_gold_calls(self.make_search_env(), task)

    def provides(self) -> set[str]:
        return {"gold_answers", "gold_tool_calls", "anchor"}

    def episode_metrics(self, task: Task, answer: str | None, calls: list[ToolCall],
                        labels: list[float]) -> dict[str, float]:
        """Adds ``searches`` (search calls made) and, on questions that name their path
        (the synthetic world), ``query_names_entity``: the share of those searches whose query
        names an entity the question leads through (its start or an intermediate), the
        entity a hop has to look up."""
        out = super().episode_metrics(task, answer, calls, labels)
        queries = [normalize_answer(str(c.arguments.get("query", ""))) for c in calls if c.name == "search"]
        out["searches"] = float(len(queries))
        lookups = [normalize_answer(name) for name in task.metadata.get("path", [])[:-1]]
        if queries and lookups:
            out["query_names_entity"] = sum(any(e in q for e in lookups) for q in queries) / len(queries)
        return out


class SyntheticSearchQA(SearchTaskSource):
    """The synthetic world of ``cfg.seed`` (and, with ``train_worlds``, the worlds training
    questions come from): tasks, BM25 over each world's documents, demonstrations."""

    def __init__(self, cfg: SearchQAConfig) -> None:
        self.world: World = build_world(cfg.seed, cfg.num_entities)
        """The world held-out questions ask about."""
        train_worlds = [build_world(cfg.seed + k, cfg.num_entities) for k in range(1, cfg.train_worlds + 1)]
        self.corpora = {w.seed: world_corpus(w, cfg.passages) for w in [self.world, *train_worlds]}
        # The full split even when other worlds replace its train part: drawing train wordings
        # advances the rng between hop counts, so held-out tasks stay those of train_worlds=0.
        splits = split_tasks(
            self.world, cfg.hops, cfg.weights(), cfg.num_train_tasks, cfg.num_heldout_tasks,
            cfg.passages, cfg.max_train_pairs,
        )
        if train_worlds:
            splits["train"] = spread_train_tasks(train_worlds, cfg)
        super().__init__(cfg, self.corpora[cfg.seed], splits)

    def corpus_text(self) -> list[str]:
        """Documents, every question, the system prompt and demonstration-style strings."""
        out = [SYSTEM_PROMPT, *(text for c in self.corpora.values() for text in c.texts)]
        out += [t.messages[-1]["content"] for split in SPLITS for t in self.splits[split]]
        for task in self.splits["train"][:200]:
            out += [m["content"] for m in self.demonstration(task)]
        return out


def world_corpus(world: World, passages: str = "entity") -> SearchCorpus:
    """BM25 over the world's entity documents, or over its facts (``passages="fact"``)."""
    if passages == "fact":
        facts = world.facts()
        texts = [text for _, _, text in facts]
        ids = [world.entities[e].fact_id(rel) for e, rel, _ in facts]
        subjects = [world.entities[e].name for e, _, _ in facts]
    else:
        texts = world.documents()
        ids = [e.doc_id for e in world.entities]
        subjects = [e.name for e in world.entities]
    # the subject is indexed twice more (a title field): an entity's own document (or fact)
    # must outrank those that merely mention it, for every exact-name search
    indexed = [f"{name}. {name}. {text}" for name, text in zip(subjects, texts)]
    return SearchCorpus(BM25Retriever(indexed), texts, ids)


def spread_train_tasks(worlds: list[World], cfg: SearchQAConfig) -> list[Task]:
    """``cfg.num_train_tasks`` training questions dealt evenly over ``worlds``, interleaved."""
    per_world = -(-cfg.num_train_tasks // len(worlds))
    columns = [split_tasks(w, cfg.hops, cfg.weights(), per_world, 0, cfg.passages, cfg.max_train_pairs)["train"]
               for w in worlds]
    return [task for row in zip(*columns) for task in row][: cfg.num_train_tasks]


def build_search_qa(cfg: SearchQAConfig) -> TaskSource:
    """The search-QA task source ``cfg`` describes (synthetic unless ``cfg.data`` is set)."""
    if cfg.data is not None:
        from envs.search_qa.files import FileSearchQA

        return FileSearchQA(cfg)
    return SyntheticSearchQA(cfg)
