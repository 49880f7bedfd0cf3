"""The environment interface every built-in or user environment implements.

An environment instance runs one episode at a time: ``reset(task)`` then ``step(action)`` until
``done``. Tool results go back to the model as chat messages (role ``tool``), which the rollout
layer renders through the tokenizer's chat template. ``anchor`` is the raw current observation
with no history; GiGPO/HGPO group steps by its exact text.
"""

from __future__ import annotations

import re
import string
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel, ConfigDict

from envs.formats import DEFAULT_FORMAT
from envs.toolcalls import ToolCall, format_answer, format_call


class Task(BaseModel):
    """One task: the opening messages, its tools and, when known, its gold labels."""

    model_config = ConfigDict(extra="forbid")

    task_id: str
    """Stable id, unique within its environment and split."""
    messages: list[dict[str, Any]]
    """Opening chat messages (system and user) in OpenAI format."""
    tools: list[dict[str, Any]] = []
    """OpenAI JSON-schema tool definitions offered to the model."""
    gold_answers: list[str] | None = None
    """Accepted answers; the first is the one IG scores."""
    gold_tool_calls: list[ToolCall] | None = None
    """The reference tool-call trace, when the task has one."""
    metadata: dict[str, Any] = {}
    """Environment-specific data (hops, supporting documents, world seed ...)."""


@dataclass
class Observation:
    """What the environment shows the agent after reset or a step."""

    messages: list[dict[str, Any]]
    """Chat messages to append (tool results); empty when the episode ended."""
    anchor: str
    """The raw current observation text, without history."""


@dataclass
class StepResult:
    """Outcome of one agent action."""

    observation: Observation
    reward: float
    """Environment reward for this step (0 for most search steps)."""
    done: bool
    invalid_action: bool = False
    """True when the action was malformed, named an unknown tool or the tool failed."""
    tool_calls: list[ToolCall] = field(default_factory=list)
    answer: str | None = None
    """The final answer, when this step ended the episode with one."""
    info: dict[str, Any] = field(default_factory=dict)
    """Extra facts for rewards and metrics (e.g. ``label`` for PRM training; on the last step,
    ``env_metrics``: the environment's own named scores of the episode, kept in the trajectory's
    ``metadata`` and averaged by ``turnrl eval``)."""


_ARTICLES_RE = re.compile(r"\b(a|an|the)\b")
_PUNCT_TABLE = str.maketrans("", "", string.punctuation)


def normalize_answer(text: str) -> str:
    """SQuAD-style normalisation: lowercase, drop punctuation and articles, squeeze spaces.
    The one answer rule: environments' success and the outcome reward (``rewards/outcome.py``)
    both match through it. Punctuation goes before articles, so "the," still loses its article."""
    text = text.lower().translate(_PUNCT_TABLE)
    return " ".join(_ARTICLES_RE.sub(" ", text).split())


def exact_match(answer: str | None, gold_answers: list[str] | None) -> bool:
    """True when the normalised answer equals one normalised gold answer."""
    if answer is None or not gold_answers:
        return False
    norm = normalize_answer(answer)
    return any(norm == normalize_answer(gold) for gold in gold_answers)


class Environment(ABC):
    """One episode at a time. Implementations must not raise on bad model output.

    They may raise on caller bugs (``step`` before ``reset`` or after ``done``) and on broken
    inputs (a task the environment cannot run); the rollout layer then fails that episode only.
    Environments are plain objects created inside a rollout actor; they need not be picklable.
    """

    max_turns: int = 4
    """Assistant turns the episode may take; read after ``reset``, which may set it per task."""
    chat_format: str = DEFAULT_FORMAT
    """The policy's chat format (``envs.formats``): how ``step`` parses the action's tool calls
    (``parse_action(action, self.chat_format)``). The rollout sets it on each new episode."""

    @abstractmethod
    async def reset(self, task: Task) -> Observation:
        """Start an episode; the returned anchor is the first observation.

        ``messages`` is usually empty: the opening messages are ``task.messages``. An environment
        that learns its opening observation only now (an external server's ``reset``) returns it
        as ``messages``, which the prompt shows after ``task.messages``.
        """

    @abstractmethod
    async def step(self, action: str) -> StepResult:
        """Apply the assistant's message text and return what followed.

        When ``done`` is True the observation's ``messages`` is empty.
        """

    def close(self) -> None:
        """Release resources held by the episode (processes, files)."""


class SyncEnvironment(Environment):
    """An environment whose episode work is synchronous, exposed as ``start``/``act``.

    The async interface wraps the sync forms: the work takes microseconds, and the sync forms
    let ``demonstration()`` replay episodes from inside a running event loop. A subclass with
    truly asynchronous work overrides ``step`` and keeps ``act`` for replays and tests.
    """

    async def reset(self, task: Task) -> Observation:
        return self.start(task)

    async def step(self, action: str) -> StepResult:
        return self.act(action)

    @abstractmethod
    def start(self, task: Task) -> Observation:
        """Synchronous ``reset``."""

    @abstractmethod
    def act(self, action: str) -> StepResult:
        """Synchronous ``step``."""


def question_text(task: Task) -> str:
    """The last user message of ``task`` (the question), or "" when it has none."""
    return next((m["content"] for m in reversed(task.messages) if m.get("role") == "user"), "")


def step_observation(messages: list[dict[str, Any]], done: bool) -> Observation:
    """What a step shows: its messages unless the episode ended; the anchor is their text."""
    return Observation(
        messages=[] if done else messages, anchor="\n".join(m["content"] for m in messages)
    )


def tool_step(
    messages: list[dict[str, Any]],
    done: bool,
    invalid: bool,
    calls: list[ToolCall],
    info: dict[str, Any],
) -> StepResult:
    """A step that answered nothing (tool calls or a hint): no reward, ``messages`` shown."""
    return StepResult(
        observation=step_observation(messages, done),
        reward=0.0,
        done=done,
        invalid_action=invalid,
        tool_calls=calls,
        info=info,
    )


def answer_step(
    answer: str, correct: bool, calls: list[ToolCall], info: dict[str, Any], score: float | None = None
) -> StepResult:
    """The step that ends the episode with ``answer``: reward ``score`` when the environment
    grades answers (a task's own scorer may give partial credit), else 1.0 when correct."""
    return StepResult(
        observation=Observation(messages=[], anchor=""),
        reward=float(correct) if score is None else score,
        done=True,
        tool_calls=calls,
        answer=answer,
        info=info,
    )


class TaskSource(ABC):
    """Train/held-out tasks, demonstrations for SFT and a factory for episodes."""

    success_at: float = 1.0
    """With ``scores_outcome``: the outcome at or above which an episode counts as a success."""
    scores_outcome: bool = False
    """True when the environment grades episodes itself (a task family's scorer, a rubric, an
    external environment's rewards): an episode's outcome is then the sum of its steps' rewards,
    not a match of its answer against ``gold_answers`` (which IG may still use), and it succeeded
    when that sum is at least ``success_at``."""

    @abstractmethod
    def tasks(self, split: str) -> list[Task]:
        """Tasks of ``split`` ("train" or "heldout"); the two never share a task."""

    @abstractmethod
    def make_env(self) -> Environment:
        """A fresh environment able to run any task of this source."""

    @abstractmethod
    def demonstration(self, task: Task) -> list[dict[str, Any]]:
        """A successful assistant/tool message sequence for ``task`` (SFT warm start)."""

    def corpus_text(self) -> list[str]:
        """Representative text (documents, questions) to train a tokenizer on."""
        return []

    def provides(self) -> set[str]:
        """Labels this source supplies: any of gold_answers, gold_tool_calls, anchor."""
        return {"anchor"}

    def success(self, task: Task, answer: str | None) -> bool:
        """Whether ``answer`` solves ``task``: normalised exact match against gold_answers."""
        return exact_match(answer, task.gold_answers)

    def episode_metrics(self, task: Task, answer: str | None, calls: list[ToolCall],
                        labels: list[float]) -> dict[str, float]:
        """The environment's own measures of one episode beyond success (``turnrl eval``
        averages them): tool calls made and, when steps carry labels (``info["label"]``, 1 for
        a step that made progress as the environment defines it), the fraction labelled 1."""
        out = {"tool_calls": float(len(calls))}
        if labels:
            out["useful_step_rate"] = sum(labels) / len(labels)
        return out


SPLITS = ("train", "heldout")


class SplitTaskSource(TaskSource):
    """A task source holding its tasks in memory, one list per split of ``SPLITS``."""

    splits: dict[str, list[Task]]

    def tasks(self, split: str) -> list[Task]:
        if split not in self.splits:
            raise ValueError(f"unknown split {split!r}; known: {', '.join(SPLITS)}")
        return self.splits[split]


def replay_gold_calls(env: SyncEnvironment, task: Task) -> list[dict[str, Any]]:
    """Run ``task``'s gold calls, one per turn, then its first gold answer through ``env``.

    Returns the assistant/tool messages of that episode, so demonstration observations are
    exactly what the model will see. Raises ValueError when the task has no gold trace, a gold
    call fails or ends the episode, or the gold answer does not count as a success.
    """
    if not task.gold_tool_calls or not task.gold_answers:
        raise ValueError(f"task {task.task_id} has no gold tool calls or answers to replay")
    env.start(task)
    messages: list[dict[str, Any]] = []
    for call in task.gold_tool_calls:
        action = format_call(call)
        result = env.act(action)
        if result.done or result.invalid_action:
            detail = result.observation.anchor or "the episode ended"
            raise ValueError(f"task {task.task_id}: gold call {action} failed: {detail}")
        messages += [{"role": "assistant", "content": action}, *result.observation.messages]
    answer = format_answer(task.gold_answers[0])
    if not env.act(answer).info.get("correct"):
        raise ValueError(f"task {task.task_id}: the gold answer did not count as a success")
    return messages + [{"role": "assistant", "content": answer}]
