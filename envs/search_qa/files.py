"""Search-QA on real data: Search-R1 / FlashRAG question files and a JSONL corpus.

Question records (JSONL, JSON list or parquet), one per question::

    {"id": "train_0", "question": "who wrote ...?", "golden_answers": ["..."]}

Search-R1's parquet files carry the same columns; when ``golden_answers`` is missing the answers
are read from ``reward_model.ground_truth.target``. Corpus JSONL (FlashRAG wiki dumps)::

    {"id": "0", "contents": "\\"Title\\"\\nText of the passage ..."}

Files are checked at load time: a bad record raises ValueError naming the file, the line (or
row) and the field, before any episode runs.
"""

from __future__ import annotations

from typing import Any

from envs.base import Task
from envs.config import SearchDataConfig, SearchQAConfig
from envs.records import read_records
from envs.search_qa.env import SEARCH_TOOL, SearchCorpus, contains_answer
from envs.search_qa.questions import SYSTEM_PROMPT
from envs.search_qa.retrieval import BM25Retriever, DenseRetriever, Retriever
from envs.search_qa.source import SearchTaskSource
from envs.toolcalls import ToolCall
from storage.places import local_dir


def _answers(where: str, record: dict[str, Any]) -> list[str]:
    answers = record.get("golden_answers")
    field = "golden_answers"
    if answers is None:  # Search-R1 parquet keeps them under reward_model too
        answers = ((record.get("reward_model") or {}).get("ground_truth") or {}).get("target")
        field = "reward_model.ground_truth.target"
    if answers is None:
        raise ValueError(f"{where}: field 'golden_answers' is missing")
    if isinstance(answers, str):
        answers = [answers]
    if (
        not isinstance(answers, list)
        or not answers
        or not all(isinstance(a, str) and a.strip() for a in answers)
    ):
        raise ValueError(f"{where}: field '{field}' must be a non-empty list of non-empty strings")
    return answers


def load_tasks(path: str, split: str, limit: int | None) -> list[Task]:
    """Tasks from one question file; ids are ``{split}-{record id or position}``."""
    tasks: list[Task] = []
    ids: set[str] = set()
    for where, record in read_records(path):
        if limit is not None and len(tasks) >= limit:
            break
        question = record.get("question")
        if not isinstance(question, str) or not question.strip():
            raise ValueError(f"{where}: field 'question' must be a non-empty string")
        task_id = f"{split}-{record.get('id', len(tasks))}"
        if task_id in ids:
            raise ValueError(f"{where}: field 'id' repeats task id {task_id!r}")
        ids.add(task_id)
        tasks.append(
            Task(
                task_id=task_id,
                messages=[
                    {"role": "system", "content": SYSTEM_PROMPT},
                    {"role": "user", "content": question.strip()},
                ],
                tools=[SEARCH_TOOL],
                gold_answers=_answers(where, record),
                metadata={"source": str(path), "question": question.strip()},
            )
        )
    return tasks


def load_corpus(path: str) -> tuple[list[str], list[str]]:
    """(texts, ids) of a corpus JSONL; each text on one line, as the search tool shows it."""
    texts: list[str] = []
    ids: list[str] = []
    for where, record in read_records(path):
        contents = record.get("contents")
        if contents is None and "text" in record:  # {"title", "text"} corpora
            contents = f'"{record.get("title", "")}"\n{record["text"]}'
        if not isinstance(contents, str) or not contents.strip():
            raise ValueError(f"{where}: field 'contents' must be a non-empty string")
        texts.append(" ".join(contents.split()))  # one document per line in observations
        ids.append(str(record.get("id", len(ids))))
    if not texts:
        raise ValueError(f"corpus {path} has no documents")
    return texts, ids


def make_retriever(data: SearchDataConfig, texts: list[str]) -> Retriever:
    cache = None if data.index_cache_dir is None else local_dir(data.index_cache_dir, "env.data.index_cache_dir")
    if data.retriever == "dense":
        assert data.dense_model_path is not None  # the config validator guarantees it
        return DenseRetriever(texts, data.dense_model_path, cache)
    return BM25Retriever(texts, cache)


class FileSearchQA(SearchTaskSource):
    """Tasks from question files, searching a corpus file. No gold tool calls: the answer
    alone is gold, and demonstrations search the question text itself."""

    def __init__(self, cfg: SearchQAConfig) -> None:
        if cfg.data is None:
            raise ValueError("FileSearchQA needs cfg.data (question and corpus paths)")
        data = cfg.data
        splits = {
            "train": load_tasks(data.train_path, "train", data.max_train_tasks),
            "heldout": load_tasks(data.heldout_path, "heldout", data.max_heldout_tasks),
        }
        train_questions = {t.metadata["question"] for t in splits["train"]}
        # held-out must stay unseen: drop any held-out question that train also asks
        splits["heldout"] = [
            t for t in splits["heldout"] if t.metadata["question"] not in train_questions
        ]
        texts, ids = load_corpus(data.corpus_path)
        super().__init__(cfg, SearchCorpus(make_retriever(data, texts), texts, ids), splits)

    def demonstration(self, task: Task) -> list[dict[str, Any]]:
        """Search the question, then answer; raises ValueError when the results do not
        contain a gold answer (no grounded demonstration exists at this top_k)."""
        query = ToolCall(name="search", arguments={"query": task.metadata["question"]})
        messages = super().demonstration(task.model_copy(update={"gold_tool_calls": [query]}))
        if not contains_answer(messages[1]["content"], task.gold_answers):
            raise ValueError(f"task {task.task_id}: no retrieved document contains a gold answer")
        return messages

    def corpus_text(self) -> list[str]:
        return [SYSTEM_PROMPT, *self.corpus.texts[:50_000]] + [
            t.metadata["question"] for t in self.splits["train"]
        ]

    def provides(self) -> set[str]:
        return {"gold_answers", "anchor"}
