"""The synthetic search-QA environment: world, splits, retrieval, episodes, demonstrations."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from collections import Counter
from functools import cache
from pathlib import Path

import pytest
from pydantic import ValidationError

from envs.base import StepResult, Task
from envs.config import SearchQAConfig
from envs.registry import ENVS, make_task_source
from envs.search_qa.source import SyntheticSearchQA
from envs.search_qa.world import RELATIONS
from envs.toolcalls import ToolCall, format_call

ROOT = Path(__file__).resolve().parents[1]


def run_python(code: str, **env: str) -> str:
    """Run ``code`` in a fresh interpreter that imports this checkout's packages."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), **env}
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env, cwd=ROOT
    )
    return out.stdout.strip()


@cache
def source(seed: int = 0, **kw) -> SyntheticSearchQA:
    return SyntheticSearchQA(SearchQAConfig(seed=seed, **kw))


def run_episode(src: SyntheticSearchQA, task: Task, actions: list[str]) -> list[StepResult]:
    async def go() -> list[StepResult]:
        env = src.make_env()
        await env.reset(task)
        return [await env.step(a) for a in actions]

    return asyncio.run(go())


def pairs(src: SyntheticSearchQA, split: str) -> set[tuple[str, ...]]:
    """The (start entity name, *relation chain) pairs the tasks of ``split`` ask about."""
    return {(t.metadata["path"][0], *t.metadata["chain"]) for t in src.tasks(split)}


def search(query: str) -> str:
    return format_call(ToolCall(name="search", arguments={"query": query}))


def test_same_seed_same_world_tasks_and_ids():
    a, b = SyntheticSearchQA(SearchQAConfig(seed=3)), SyntheticSearchQA(SearchQAConfig(seed=3))
    assert a.world.documents() == b.world.documents()
    for split in ("train", "heldout"):
        assert [t.model_dump() for t in a.tasks(split)] == [t.model_dump() for t in b.tasks(split)]
    assert a.tasks("train")[0].task_id == "search_qa-s3-train-00000"
    assert source(4).world.documents() != a.world.documents()


def test_default_world_size_and_document_layout():
    src = source()
    kinds = Counter(e.kind for e in src.world.entities)
    # 120 entities: 120//15 = 8 countries, 120//5 = 24 cities and 24 companies, 64 people
    assert kinds == {"country": 8, "city": 24, "company": 24, "person": 64}
    person = src.world.of_kind("person")[0]
    doc = src.world.document(person.index)
    assert doc.startswith(f"{person.name} is a person. born in: ")
    assert 10 <= len(doc.split()) <= 40


def test_splits_are_disjoint_by_question_and_by_entity_chain():
    src = source()
    train, held = src.tasks("train"), src.tasks("heldout")
    assert (len(train), len(held)) == (2000, 200)
    ids = [t.task_id for t in train + held]
    assert len(set(ids)) == len(ids)
    q = lambda t: t.messages[-1]["content"]  # noqa: E731
    assert not {q(t) for t in train} & {q(t) for t in held}
    assert not pairs(src, "train") & pairs(src, "heldout")
    # default hops [1, 2] with equal weights: 1000/1000 train, 100/100 held-out
    assert Counter(t.metadata["hops"] for t in train) == {1: 1000, 2: 1000}
    assert Counter(t.metadata["hops"] for t in held) == {1: 100, 2: 100}


def test_hop_weights_and_three_hop_questions():
    src = source(1, hops=(1, 3), hop_weights=(1.0, 3.0), num_train_tasks=40, num_heldout_tasks=8)
    # 40 * 1/4 = 10 one-hop, 30 three-hop; 8 * 1/4 = 2 and 6
    assert Counter(t.metadata["hops"] for t in src.tasks("train")) == {1: 10, 3: 30}
    assert Counter(t.metadata["hops"] for t in src.tasks("heldout")) == {1: 2, 3: 6}
    three = next(t for t in src.tasks("train") if t.metadata["hops"] == 3)
    assert len(three.gold_tool_calls) == 3 and len(three.metadata["supporting_docs"]) == 3


@pytest.mark.parametrize("seed,size", [(0, 120), (1, 80), (2, 150), (5, 400)])
def test_searching_an_exact_name_returns_its_own_document_first(seed, size):
    src = source(seed, num_entities=size, num_train_tasks=10, num_heldout_tasks=10)
    for entity in src.world.entities:
        hits = src.corpus.search(entity.name, 2)
        assert src.corpus.doc_ids[hits[0]] == entity.doc_id, entity.name


def test_demonstrations_replay_to_success_through_reset_and_step():
    src = source(2, hops=(1, 2, 3), num_train_tasks=60, num_heldout_tasks=30)
    for task in src.tasks("train")[:30] + src.tasks("heldout"):
        demo = src.demonstration(task)
        actions = [m["content"] for m in demo if m["role"] == "assistant"]
        assert actions[:-1] == [format_call(c) for c in task.gold_tool_calls]
        assert actions[-1] == f"<answer>{task.gold_answers[0]}</answer>"
        results = run_episode(src, task, actions)
        assert results[-1].done and results[-1].answer == task.gold_answers[0]
        assert results[-1].reward == 1.0
        assert src.success(task, results[-1].answer)
        # every gold search finds a new supporting document: label 1 on every step
        assert [r.info["label"] for r in results] == [1] * len(results)
        tool_msgs = [m["content"] for m in demo if m["role"] == "tool"]
        assert tool_msgs == [r.observation.anchor for r in results[:-1]]


def test_observations_anchors_labels_and_retrieved_ids():
    src = source()
    task = next(t for t in src.tasks("train") if t.metadata["hops"] == 2)
    first = task.gold_tool_calls[0].arguments["query"]

    async def go():
        env = src.make_env()
        obs = await env.reset(task)
        assert obs.anchor == task.messages[-1]["content"] and obs.messages == []
        return [await env.step(search(first)), await env.step(search(first))]

    r1, r2 = asyncio.run(go())
    assert not r1.done and not r1.invalid_action and r1.reward == 0.0
    assert r1.observation.messages[0]["role"] == "tool"
    assert r1.observation.anchor == r1.observation.messages[0]["content"]
    # one line per retrieved document, at most top_k = 2 (BM25 returns only documents that match)
    assert 1 <= len(r1.observation.anchor.split("\n")) == len(r1.info["retrieved"]) <= 2
    assert r1.info["retrieved"][0] == task.metadata["supporting_docs"][0]
    assert (r1.info["label"], r2.info["label"]) == (1, 0)  # nothing new the second time


@pytest.mark.parametrize(
    "action,needle",
    [
        ('<tool_call>{"name": "search", "arguments": {"query": }</tool_call>', "not valid JSON"),
        ('<tool_call>{"name": "lookup", "arguments": {"query": "x"}}</tool_call>', "unknown tool"),
        ('<tool_call>{"name": "search", "arguments": {"query": 7}}</tool_call>', "type string"),
        ('<tool_call>{"name": "search", "arguments": {}}</tool_call>', "missing required"),
        ('<tool_call>{"name": "search", "arguments": {"query": "a", "k": 3}}</tool_call>',
         "unexpected argument"),
        ("I think the answer is Mira.", "No tool call or answer"),
        ("<tool_call>{\"name\": \"search\"", "unterminated"),
    ],
)  # fmt: skip
def test_bad_actions_become_invalid_observations(action, needle):
    src = source()
    (result,) = run_episode(src, src.tasks("train")[0], [action])
    assert result.invalid_action and not result.done and result.answer is None
    assert result.info["label"] == 0
    (message,) = result.observation.messages
    assert needle in message["content"]


def test_several_calls_in_one_message_run_in_order():
    src = source()
    names = [e.name for e in src.world.of_kind("person")[:3]]
    bad = '<tool_call>{"name": "nope", "arguments": {}}</tool_call>'
    action = search(names[0]) + "\n" + bad + search(names[1]) + search(names[2])
    (result,) = run_episode(src, src.tasks("train")[0], [action])
    contents = [m["content"] for m in result.observation.messages]
    assert len(contents) == 4 and result.invalid_action
    assert contents[0].startswith(names[0]) and contents[2].startswith(names[1])
    assert contents[3].startswith(names[2]) and "unknown tool" in contents[1]
    assert [c.name for c in result.tool_calls] == ["search", "nope", "search", "search"]


def test_turn_limit_ends_without_answer():
    src = source(max_turns=3)
    task = src.tasks("train")[0]
    results = run_episode(src, task, [search("Mira")] * 3)
    assert [r.done for r in results] == [False, False, True]
    assert results[-1].answer is None and results[-1].observation.messages == []
    env = src.make_search_env()
    env.start(task)
    for _ in range(3):
        env.act("no call")
    with pytest.raises(RuntimeError, match="reset"):
        env.act("one too many")


def test_wrong_answer_ends_with_zero_reward_and_normalised_success():
    src = source()
    task = src.tasks("heldout")[0]
    (wrong,) = run_episode(src, task, ["<answer>Nowhere</answer>"])
    assert wrong.done and wrong.reward == 0.0 and wrong.info["label"] == 0
    gold = task.gold_answers[0]
    assert src.success(task, f"  the {gold.upper()}. ") and not src.success(task, None)


def test_corpus_text_and_provides():
    src = source()
    text = src.corpus_text()
    assert src.world.document(0) in text and src.tasks("heldout")[0].messages[-1]["content"] in text
    assert any(t.startswith('<tool_call>{"name": "search"') for t in text)
    assert src.provides() == {"gold_answers", "gold_tool_calls", "anchor"}
    task = src.tasks("train")[0]
    assert task.tools[0]["function"]["name"] == "search"
    assert json.loads(json.dumps(task.tools))[0]["function"]["parameters"]["required"] == ["query"]


def test_config_validation_and_registry():
    with pytest.raises(ValidationError, match="max_turns"):
        SearchQAConfig(hops=[1, 2, 3], max_turns=3)
    with pytest.raises(ValidationError, match="hops"):
        SearchQAConfig(hops=[4])
    with pytest.raises(ValidationError, match="hop_weights"):
        SearchQAConfig(hops=[1, 2], hop_weights=[1.0])
    with pytest.raises(ValidationError):
        SearchQAConfig(topk=3)  # extra="forbid" catches typos
    with pytest.raises(ValueError, match="known types: .*search_qa"):
        make_task_source({"type": "nope"})
    assert "search_qa" in ENVS
    src = make_task_source({"type": "search_qa", "num_train_tasks": 5, "num_heldout_tasks": 5})
    assert len(src.tasks("train")) == 5
    with pytest.raises(ValueError, match="split"):
        src.tasks("test")


def test_envs_import_no_ray_torch_or_downstream_packages():
    code = (
        "import sys, envs.registry, envs.search_qa.source, envs.config\n"
        "bad = [m for m in sys.modules if m.split('.')[0] in "
        "('ray', 'torch', 'rollout', 'rewards', 'learner', 'replay', 'cluster', 'services')]\n"
        "print(bad)"
    )
    assert run_python(code) == "[]"


def test_tasks_are_identical_across_processes_and_hash_seeds():
    code = (
        "import hashlib, json\n"
        "from envs.registry import make_task_source\n"
        "h = hashlib.sha256()\n"
        "for cfg in ({'type': 'search_qa', 'num_train_tasks': 300, 'num_heldout_tasks': 30},\n"
        "            {'type': 'tool_use', 'num_train_tasks': 50, 'num_heldout_tasks': 5},\n"
        "            {'type': 'household', 'num_train_tasks': 30, 'num_heldout_tasks': 5}):\n"
        "    src = make_task_source(cfg)\n"
        "    for split in ('train', 'heldout'):\n"
        "        dumped = [t.model_dump(mode='json') for t in src.tasks(split)]\n"
        "        h.update(json.dumps(dumped).encode())\n"
        "print(h.hexdigest())"
    )
    digests = {run_python(code, PYTHONHASHSEED=seed) for seed in ("1", "2")}
    assert len(digests) == 1


def test_train_worlds_move_training_questions_to_other_worlds():
    one, spread = source(0, num_train_tasks=90), source(0, num_train_tasks=90, train_worlds=3)
    # held-out questions are unchanged: the run's world, the same tasks
    assert [t.model_dump() for t in spread.tasks("heldout")] == [t.model_dump() for t in one.tasks("heldout")]
    train = spread.tasks("train")
    assert Counter(t.metadata["world_seed"] for t in train) == {1: 30, 2: 30, 3: 30}
    assert len({t.task_id for t in train}) == 90
    # no training question or demonstration shows a fact of the held-out world
    held_docs = set(spread.world.documents())
    for task in train[:12]:
        demo = spread.demonstration(task)  # replays to success: each task searches its own world
        shown = "\n".join(m["content"] for m in demo if m["role"] == "tool").split("\n")
        assert shown and not held_docs & set(shown)
        (result,) = run_episode(spread, task, [f"<answer>{task.gold_answers[0]}</answer>"])
        assert result.done and spread.success(task, result.answer)
    stray = train[0].model_copy(update={"metadata": {**train[0].metadata, "world_seed": 99}})
    with pytest.raises(ValueError, match="world_seed 99"):
        run_episode(spread, stray, [])


def test_fact_passages_index_one_fact_per_result_and_search_entity_plus_relation():
    src = source(0, hops=(1, 2), top_k=1, passages="fact")
    world = src.world
    person = world.of_kind("person")[0]
    mentor = world.entities[person.relations["mentor"]]
    # one passage per (entity, relation), in document order, subject first
    assert f"{person.name} mentor: {mentor.name}." in src.corpus.texts
    assert len(src.corpus.texts) == sum(len(e.relations) for e in world.entities)
    # "X mentor" retrieves X's mentor fact, not the facts naming X as someone's mentor
    (res,) = run_episode(src, src.tasks("train")[0], [search(f"{person.name} mentor")])
    assert res.observation.messages[0]["content"] == f"{person.name} mentor: {mentor.name}."
    assert res.info["retrieved"] == [f"doc{person.index:04d}#mentor"]
    # gold searches name entity and relation; each hop's supporting fact is its top result
    for task in src.tasks("train")[:40] + src.tasks("heldout")[:40]:
        path, chain = task.metadata["path"], task.metadata["chain"]
        labels = [RELATIONS[r].label for r in chain]
        assert [c.arguments["query"] for c in task.gold_tool_calls] == [
            f"{n} {lab}" for n, lab in zip(path, labels)
        ]
        demo = src.demonstration(task)  # replays to success
        shown = [m["content"] for m in demo if m["role"] == "tool"]
        assert shown == [f"{n} {lab}: {nxt}." for n, lab, nxt in zip(path, labels, path[1:])]


def test_fact_passages_keep_held_out_facts_out_of_one_hop_training():
    # with 1-hop questions, no training demonstration shows a held-out question's fact: a
    # held-out answer can only come from reading the retrieved passage
    src = source(0, hops=(1,), top_k=1, passages="fact")
    held = {t.metadata["supporting_docs"][0] for t in src.tasks("heldout")}
    trained = {t.metadata["supporting_docs"][0] for t in src.tasks("train")}
    assert held and trained and not held & trained


def test_more_held_out_tasks_move_the_cut_of_one_shuffle():
    # held-out pairs are cut from the front of one seeded shuffle per hop count, so a config
    # with more held-out tasks holds out a superset and trains on a subset of the pairs: a warm
    # start with policy.sft.env {num_heldout_tasks: 250} demonstrates only pairs RL also trains
    # on, leaves 50 of RL's pairs undemonstrated and never shows a held-out one.
    kw = dict(num_entities=120, hops=(1,), passages="fact", top_k=1, max_turns=3)
    run, demo = source(0, **kw), source(0, num_heldout_tasks=250, **kw)
    assert pairs(run, "heldout") < pairs(demo, "heldout")
    assert pairs(demo, "train") < pairs(run, "train")
    assert len(pairs(run, "train") - pairs(demo, "train")) == 50


def test_max_train_pairs_makes_demonstration_rl_and_held_out_pairs_disjoint():
    # the demo's three sets: held-out = the first 100 pairs of the shuffle, RL's training
    # pairs the next 100 (max_train_pairs), the warm start's demonstrations the ones after
    kw = dict(num_entities=120, hops=(1,), passages="fact", top_k=1, max_turns=3)
    run = source(0, num_heldout_tasks=100, max_train_pairs=100, **kw)
    demo = source(0, num_heldout_tasks=200, **kw)
    held, rl, sft = pairs(run, "heldout"), pairs(run, "train"), pairs(demo, "train")
    assert (len(held), len(rl), len(sft)) == (100, 100, 336 - 200)
    assert not held & rl and not held & sft and not rl & sft
    # every wording of the kept pairs is a training task (3 per relation)
    assert len({t.metadata["question"] for t in run.tasks("train")}) == 300
