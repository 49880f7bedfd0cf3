"""The search-QA episode: search a corpus with a ``search`` tool, then answer.

One step is one assistant message. Tool calls in it run in order and come back as one tool
message each; ``<answer>...</answer>`` ends the episode; anything the model gets wrong (bad JSON,
unknown tool, wrong arguments, neither call nor answer) becomes an observation with
``invalid_action=True``, never an exception.

Step labels for PRM training (``info["label"]``): 1 when the step's searches retrieved a
supporting document not retrieved earlier in the episode, or the step gave a correct answer.
Supporting documents are ``task.metadata["supporting_docs"]`` when the task names them (the
synthetic world); otherwise (real data) any document containing a gold answer.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from envs.formats import DEFAULT_FORMAT
from envs.base import (
    Observation,
    StepResult,
    SyncEnvironment,
    Task,
    normalize_answer,
    answer_step,
    question_text,
    tool_step,
)
from envs.search_qa.retrieval import Retriever
from envs.toolcalls import ToolCall, format_call, parse_action
from envs.tools import check_arguments, tool_message, tool_name

SEARCH_TOOL: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "search",
        "description": "Search the documents; returns the best matches, one per line.",
        "parameters": {
            "type": "object",
            "properties": {"query": {"type": "string", "description": "What to look up."}},
            "required": ["query"],
        },
    },
}

def no_action_hint(chat_format: str = DEFAULT_FORMAT) -> str:
    """What the model is told when it neither called nor answered, its call in the policy's format."""
    call = format_call(ToolCall(name="search", arguments={"query": "..."}), chat_format)
    return f"No tool call or answer found. Call a tool as {call} or give the final answer as <answer>...</answer>."


NO_ACTION_HINT = no_action_hint()
NO_RESULTS = "No results."


def contains_answer(text: str, answers: list[str] | None) -> bool:
    """Whether ``text`` contains one of ``answers`` as whole words, after normalisation."""
    padded = f" {normalize_answer(text)} "
    return any(f" {g} " in padded for g in map(normalize_answer, answers or []) if g)


class SearchCorpus:
    """What the search tool needs: a retriever, the shown text and the id of each document."""

    def __init__(self, retriever: Retriever, texts: list[str], doc_ids: list[str]) -> None:
        if len(texts) != len(doc_ids):
            raise ValueError(f"{len(texts)} documents but {len(doc_ids)} ids")
        self.retriever = retriever
        self.texts = texts
        self.doc_ids = doc_ids

    def search(self, query: str, k: int) -> list[int]:
        return self.retriever.search(query, k)


class SearchEnv(SyncEnvironment):
    """One search-QA episode at a time over a shared :class:`SearchCorpus`."""

    def __init__(
        self,
        corpus: SearchCorpus,
        top_k: int,
        turn_limit: Callable[[int | None], int],
        judge: Callable[[Task, str | None], bool],
        corpora: Mapping[int, SearchCorpus] | None = None,
    ) -> None:
        """``turn_limit``: the turn limit of a question of a number of hops (None: unknown)
        (``SearchQAConfig.turn_limit``), read from the task at each ``reset``."""
        self.corpus = corpus
        self.corpora = corpora
        """World seed -> corpus, when tasks come from several worlds (``metadata["world_seed"]``)."""
        self.top_k = top_k
        self.turn_limit = turn_limit
        self.max_turns = turn_limit(None)
        self.judge = judge
        self.tools = {"search": SEARCH_TOOL}
        self.task: Task | None = None
        self.turn = 0
        self.done = True
        self.seen: set[str] = set()

    def start(self, task: Task) -> Observation:
        """Synchronous ``reset``: the anchor is the question text."""
        self.task, self.turn, self.done, self.seen = task, 0, False, set()
        self.max_turns = self.turn_limit(task.metadata.get("hops"))
        if self.corpora is not None:
            seed = task.metadata.get("world_seed")
            if seed not in self.corpora:
                raise ValueError(f"task {task.task_id}: world_seed {seed!r} is none of this "
                                 f"environment's worlds {sorted(self.corpora)}")
            self.corpus = self.corpora[seed]
        return Observation(messages=[], anchor=question_text(task))

    def act(self, action: str) -> StepResult:
        """Synchronous ``step``."""
        if self.task is None or self.done:
            raise RuntimeError("step() called with no episode running: call reset(task) first")
        self.turn += 1
        parsed = parse_action(action, self.chat_format)
        if parsed.answer is not None:
            return self._finish(parsed.answer, parsed.calls)
        if not parsed.calls and not parsed.errors:
            hint = {"role": "user", "content": no_action_hint(self.chat_format)}
            return self._observe([hint], invalid=True, calls=[], label=0, retrieved=[])
        messages: list[dict[str, Any]] = []
        hits: list[int] = []
        invalid = False
        for call in parsed.calls:
            content, found, ok = self._run_call(call)
            messages.append(tool_message(call.name, content))
            hits += found
            invalid |= not ok
        for error in parsed.errors:  # malformed calls have no trustworthy name
            messages.append(tool_message(None, f"Error: {error}"))
            invalid = True
        label = int(self._finds_new_support(hits))
        retrieved = [self.corpus.doc_ids[i] for i in hits]
        self.seen |= set(retrieved)
        return self._observe(
            messages, invalid=invalid, calls=parsed.calls, label=label, retrieved=retrieved
        )

    def _finds_new_support(self, hits: list[int]) -> bool:
        assert self.task is not None
        new = [i for i in hits if self.corpus.doc_ids[i] not in self.seen]
        supporting = self.task.metadata.get("supporting_docs")
        if supporting is not None:
            return any(self.corpus.doc_ids[i] in supporting for i in new)
        return any(contains_answer(self.corpus.texts[i], self.task.gold_answers) for i in new)

    def _run_call(self, call: ToolCall) -> tuple[str, list[int], bool]:
        """(tool message text, indices of retrieved documents, whether the call was valid)."""
        tool = self.tools.get(call.name)
        if tool is None:
            known = ", ".join(sorted(self.tools))
            return f"Error: unknown tool {call.name!r}; available tools: {known}.", [], False
        problems = check_arguments(tool, call.arguments)
        if problems:
            return f"Error: {tool_name(tool)}: " + "; ".join(problems) + ".", [], False
        hits = self.corpus.search(call.arguments["query"], self.top_k)
        if not hits:
            return NO_RESULTS, [], True
        return "\n".join(self.corpus.texts[i] for i in hits), hits, True

    def _observe(
        self,
        messages: list[dict[str, Any]],
        invalid: bool,
        calls: list[ToolCall],
        label: int,
        retrieved: list[str],
    ) -> StepResult:
        self.done = self.turn >= self.max_turns
        info = {"label": label, "retrieved": retrieved, "turn": self.turn}
        return tool_step(messages, self.done, invalid, calls, info)

    def _finish(self, answer: str, calls: list[ToolCall]) -> StepResult:
        assert self.task is not None
        correct = self.judge(self.task, answer)
        self.done = True
        info = {"label": int(correct), "retrieved": [], "turn": self.turn, "correct": correct}
        return answer_step(answer, correct, calls, info)
