"""The trajectory schema: token in, token out.

A trajectory is the exact token sequence the engine saw and produced, never rebuilt by
re-tokenizing text::

    prompt_ids | turn 1: action_ids, observation_ids | turn 2: ... | turn T: action_ids

``action_ids`` are sampled tokens (they train); ``observation_ids`` are what the rollout appended
after the action (tool results rendered by the chat template plus the next assistant header):
attended, never trained. The final turn normally has no observation.

With a history window (``rollout.history_turns``) turn ``t`` was sampled from
``prompt_ids | turns[context_start:t]`` rather than the whole episode; ``Turn.context_start``
records where its context began, and ``segments()`` splits the trajectory into the rows the
learner trains, each the exact context its turns were sampled from.

JSONL serialisation: one ``Trajectory.model_dump_json()`` per line, ``schema_version`` = 6.
Version 6 added ``env_outcome`` (the grade of an environment that grades its own episodes);
version 5 added ``LiveOrigin.ended_early`` (turns the server cut short: stop strings,
``parallel_tool_calls: false``); version 4 added ``Turn.adapter`` (the LoRA adapter that sampled the turn); version 3 made
typed fields of what components used to keep in ``metadata`` (``producer``, ``worker``,
``labels``, ``answer_score``, ``reward_details``, ``reward_errors``, ``skipped_sources``,
``live``); version 2 added ``Turn.version_spans`` (weights versions within a
turn, for in-flight weight updates). Older files still read: ``upgrade_record`` moves a version
1-2 record's metadata keys into the typed fields (the replay codec calls it too), and version 1
turns have one version each.
Rewards live per turn in ``Turn.rewards`` keyed by source (``outcome``, ``ig``, ``prm``,
``match``, ``env``); ``None`` means the source was asked for but failed (masked, never zero).

``metadata`` is free-form data from clients and environments, carried and stored as it is: no
component reads it or depends on it. Anything code reads is a typed field.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Iterator, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from envs.toolcalls import ToolCall
from rollout.engines.base import Completion, expand_spans
from rollout.token_array import NO_INTS, FloatArray, IntArray

SCHEMA_VERSION = 6
READABLE_SCHEMA_VERSIONS = (1, 2, 3, 4, 5, 6)
REWARD_SOURCES = ("outcome", "ig", "prm", "match", "env")
FinishReason = Literal["answer", "max_turns", "max_tokens", "error"]


class Turn(BaseModel):
    """One assistant action and the observation that followed it."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    action_ids: IntArray
    """Tokens the policy sampled for this turn."""
    action_logprobs: FloatArray
    """Behaviour log-probabilities of ``action_ids`` under the sampling distribution."""
    policy_version: int
    """Weights version that generated this turn's first token."""
    version_spans: list[tuple[int, int]] = []
    """``(first action token index, version)`` spans when the weights changed while the turn
    was sampled (an in-flight update); empty: every token is ``policy_version``'s."""
    adapter: str | None = None
    """The LoRA adapter every action token was sampled with (a LoRA run's, on a shared pool);
    its versions are ``policy_version`` / ``version_spans``. None: the base model's weights."""
    observation_ids: IntArray = NO_INTS
    """Tokens appended after the action (tool results, next assistant header). No loss."""
    anchor_observation: str = ""
    """Raw text of the observation this action was taken in (no history)."""
    tool_calls: list[ToolCall] = []
    """Calls parsed from the action, in order."""
    invalid_action: bool = False
    """The action was malformed or its tool failed."""
    rewards: dict[str, float | None] = {}
    """Per-source turn rewards; ``None`` marks a failed scorer."""
    reward_versions: dict[str, int] = {}
    """Weights version used by model-based scorers (IG, PRM), per source."""
    text: str = ""
    """Decoded action, for people and judges; never used to rebuild tokens."""
    context_start: int = Field(0, ge=0)
    """First earlier turn in this action's context: the engine saw ``prompt_ids`` and turns
    ``context_start .. t-1`` (0: the whole episode so far)."""

    @model_validator(mode="after")
    def _aligned(self) -> "Turn":
        if len(self.action_ids) != len(self.action_logprobs):
            raise ValueError(
                f"action_ids has {len(self.action_ids)} tokens but action_logprobs has "
                f"{len(self.action_logprobs)}: record one behaviour log-prob per sampled token"
            )
        spans = self.version_spans
        if spans and (spans[0] != (0, self.policy_version)
                      or any(b[0] <= a[0] for a, b in zip(spans, spans[1:]))
                      or spans[-1][0] >= max(len(self.action_ids), 1)):
            raise ValueError(
                f"version_spans {spans} must start with (0, policy_version={self.policy_version}) "
                f"and have increasing token indices below the turn's {len(self.action_ids)} tokens")
        return self

    @classmethod
    def sampled(cls, comp: Completion, **fields: Any) -> "Turn":
        """The one place an engine completion becomes a Turn (rollout episodes and live
        sessions alike): its tokens, their behaviour log-probs, and ``policy_version`` the
        version that sampled the first token, with ``version_spans`` only where later versions
        took over (an in-flight weight update), and the adapter that sampled them. ``fields``:
        the rest (text, tool calls ...)."""
        spans = [tuple(s) for s in comp.version_spans]
        return cls(action_ids=comp.token_ids, action_logprobs=comp.logprobs, policy_version=spans[0][1],
                   version_spans=spans if len(spans) > 1 else [], adapter=comp.adapter, **fields)

    def versions(self) -> list[int]:
        """The weights version of each action token."""
        return expand_spans(self.version_spans or [(0, self.policy_version)], len(self.action_ids))

    def min_version(self) -> int:
        if not self.version_spans:  # the usual turn; the replay store asks for every turn
            return self.policy_version
        return min(v for _, v in self.version_spans)


def window_start(turn: int, history_turns: int | None) -> int:
    """First earlier turn kept in turn ``turn``'s context when each action sees the opening
    messages plus at most ``history_turns`` earlier turns (None: all of them)."""
    return 0 if history_turns is None else max(0, turn - history_turns)


@dataclass(frozen=True)
class Segment:
    """One training row: ``prompt_ids`` plus turns ``start .. stop-1``; turns ``first ..
    stop-1`` train, earlier ones are context (their actions attended, not trained)."""

    start: int
    first: int
    stop: int


class AnswerScore(BaseModel):
    """How the final answer matched the gold answers (the outcome stage's detail)."""

    model_config = ConfigDict(extra="forbid")

    em: float
    """Exact match (after answer normalisation): 1.0 or 0.0."""
    f1: float
    """Token F1 against the best gold answer (MatchTIR's answer-turn reward reads it)."""
    well_formed: bool
    """The answer was present and well formed (otherwise the format penalty applied)."""


class LiveOrigin(BaseModel):
    """Where a live trajectory came from: one segment of a gateway session."""

    model_config = ConfigDict(extra="forbid")

    session_id: str
    """The client's session (conversation) id."""
    segment: int = Field(0, ge=0)
    """Index of this segment within the session (a new system prompt starts a new one)."""
    feedback: bool = False
    """Client feedback set this segment's outcome (``gateway/feedback.py``)."""
    prejudged: dict[int, dict[str, Any]] = {}
    """Turn index -> judgement (``score``, ``raw``, ``error``) the judge gave while the session
    was still open, so the reward service does not judge those turns again at its close."""
    constrained: dict[int, str] = {}
    """Turn index -> what reshaped the distribution it was sampled from: a grammar masked it
    (``tool_choice_required``, ``tool_choice_named``, ``strict_tools``,
    ``response_format_json_schema``, ``response_format_json_object``; ``gateway.constraints``),
    or the request's ``logit_bias`` or ``penalties`` (presence, frequency). The tokens are exactly
    the sampled ones; the recorded log-probs are that distribution's, not the policy's own."""
    ended_early: dict[int, str] = {}
    """Turn index -> why the server ended its sampling before the model did: ``stop`` (a stop
    string was written) or ``first_tool_call`` (``parallel_tool_calls: false``). The tokens up
    to the cut are exactly the sampled ones; no end-of-turn token was sampled."""


class Trajectory(BaseModel):
    """One rollout of one task."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    schema_version: int = SCHEMA_VERSION
    trajectory_id: str
    """Globally unique; makes replay redelivery idempotent."""
    task_id: str
    group_id: str
    """Shared by the G rollouts of one task drawn together."""
    prompt_ids: IntArray
    turns: list[Turn] = []
    gold_answers: list[str] | None = None
    gold_tool_calls: list[ToolCall] | None = None
    answer: str | None = None
    """Text of the final ``<answer>``, if the rollout gave one."""
    outcome: float | None = None
    """Outcome reward, set by the reward stage."""
    success: bool = False
    """Exact-match success (or the environment's own success measure)."""
    env_outcome: float | None = None
    """The environment's own grade of the episode (the sum of its steps' rewards), set when its
    task source grades episodes itself (``TaskSource.scores_outcome``: a task family's scorer, a
    rubric, an external environment's rewards); the outcome stage takes it as the outcome instead
    of matching ``answer`` against ``gold_answers``. None: the outcome is that match."""
    finish_reason: FinishReason = "max_turns"
    error: str | None = None
    """Why the episode failed, when the environment or engine raised."""
    timings: dict[str, float] = {}
    """Seconds per stage: generate, env, reward ..."""
    producer: str | None = None
    """The rollout producer whose replay reservation this trajectory's group holds (replay
    gives the reservation back if the producer dies); None: unscheduled (live, offline)."""
    worker: int | None = None
    """Index of the rollout worker that played it (None: not played by a rollout worker)."""
    labels: list[int] | None = None
    """Per-turn step labels from the environment (``info["label"]``), for PRM training; None:
    the environment gives none."""
    answer_score: AnswerScore | None = None
    """The outcome stage's match of the answer (None: not scored yet)."""
    reward_details: dict[str, Any] = {}
    """Source -> what its scorer kept beside the values (raw judgements, untransformed PRM)."""
    reward_errors: list[dict[str, Any]] = []
    """One flag per failed source: ``{"source", "turns", "error"}`` (its values are None)."""
    skipped_sources: list[str] = []
    """Configured sources that do not apply to this trajectory (a live session without the
    feedback or gold an outcome needs), so none of its turns carries them."""
    live: LiveOrigin | None = None
    """Set on a live session's segment (the gateway recorded it); None: a scheduled rollout."""
    metadata: dict[str, Any] = {}
    """Free-form data from clients and environments, carried and stored as it is; no
    component reads it (what code reads is a typed field above)."""

    @model_validator(mode="before")
    @classmethod
    def _upgrade(cls, data: Any) -> Any:
        return upgrade_record(data) if isinstance(data, dict) else data

    @model_validator(mode="after")
    def _version(self) -> "Trajectory":
        if self.schema_version not in READABLE_SCHEMA_VERSIONS:
            raise ValueError(
                f"schema_version {self.schema_version} is not supported (this build reads "
                f"{', '.join(map(str, READABLE_SCHEMA_VERSIONS))})"
            )
        prev = 0
        for t, turn in enumerate(self.turns):
            if not prev <= turn.context_start <= t:
                raise ValueError(
                    f"turns.{t}.context_start is {turn.context_start}: it must lie in [{prev}, {t}] "
                    "(a context never starts after its own turn or before the previous turn's)"
                )
            prev = turn.context_start
        return self

    def set_outcome(self, value: float | None) -> None:
        """The outcome reward, in its two places at once: ``outcome`` and the final turn's
        ``outcome`` slot, the only turn that carries one (the reward stage scores it; a live
        client's feedback gives it). None: asked for but missing (masked, never zero)."""
        self.outcome = value
        for turn in self.turns[:-1]:
            turn.rewards.pop("outcome", None)
        if self.turns:
            self.turns[-1].rewards["outcome"] = value

    # -- token views ---------------------------------------------------------------------
    def token_ids(self) -> list[int]:
        ids = list(self.prompt_ids)
        for turn in self.turns:
            ids += turn.action_ids + turn.observation_ids
        return ids

    def loss_mask(self) -> list[int]:
        """1 on action tokens, 0 on prompt and observation tokens."""
        mask = [0] * len(self.prompt_ids)
        for turn in self.turns:
            mask += [1] * len(turn.action_ids) + [0] * len(turn.observation_ids)
        return mask

    def behaviour_logprobs(self) -> list[float]:
        """Aligned with ``token_ids``; 0.0 where the loss mask is 0."""
        out = [0.0] * len(self.prompt_ids)
        for turn in self.turns:
            out += turn.action_logprobs + [0.0] * len(turn.observation_ids)
        return out

    def turn_index(self) -> list[int]:
        """Turn number (0-based) of each token; -1 on the prompt."""
        out = [-1] * len(self.prompt_ids)
        for t, turn in enumerate(self.turns):
            out += [t] * (len(turn.action_ids) + len(turn.observation_ids))
        return out

    def context_ids(self, start: int, stop: int) -> list[int]:
        """``prompt_ids`` followed by turns ``start .. stop-1`` (actions and observations)."""
        ids = list(self.prompt_ids)
        for turn in self.turns[start:stop]:
            ids += turn.action_ids + turn.observation_ids
        return ids

    def segments(self) -> list[Segment]:
        """Training rows: maximal runs of turns sharing one ``context_start``. A whole-episode
        trajectory is one row; a window of k gives one row for turns 0..k, then one per turn."""
        out: list[Segment] = []
        for t, turn in enumerate(self.turns):
            if out and out[-1].start == turn.context_start:
                out[-1] = Segment(out[-1].start, out[-1].first, t + 1)
            else:
                out.append(Segment(turn.context_start, t, t + 1))
        return out or [Segment(0, 0, 0)]

    def row(self, seg: Segment) -> tuple[IntArray, IntArray]:
        """Token ids of ``seg``'s row and, per token, the index of the trained turn whose
        action it is (-1 on prompt, observations and context turns). The observation after
        the row's last action is left off: no trained token attends to it. Built from the
        fields' arrays without a Python number per token (the learner's batching reads
        ``.array``)."""
        ids, owner = [self.prompt_ids.array], [np.full(len(self.prompt_ids), -1)]
        for t in range(seg.start, seg.stop):
            action = self.turns[t].action_ids.array
            ids.append(action)
            owner.append(np.full(len(action), t if t >= seg.first else -1))
            if t < seg.stop - 1:
                obs = self.turns[t].observation_ids.array
                ids.append(obs)
                owner.append(np.full(len(obs), -1))
        return IntArray.frozen(np.concatenate(ids)), IntArray.frozen(np.concatenate(owner))

    def num_action_tokens(self) -> int:
        return sum(len(t.action_ids) for t in self.turns)

    def min_version(self) -> int:
        return min((t.min_version() for t in self.turns), default=0)


def upgrade_record(data: dict[str, Any]) -> dict[str, Any]:
    """A version 1-2 record's bookkeeping moved from ``metadata`` into its typed fields (a
    copy). ``reward_weights`` and ``on_missing``, which the reward service used to
    stamp, are dropped: the learner takes them from the run config. A current record, or one
    whose metadata holds none of those keys, is returned as it is."""
    if data.get("schema_version", SCHEMA_VERSION) >= 3 or not data.get("metadata"):
        return data
    data, meta = dict(data), dict(data["metadata"])
    for key in ("producer", "worker", "labels", "reward_errors", "skipped_sources"):
        if key in meta:
            data[key] = meta.pop(key)
    if {"em", "f1", "well_formed"} <= meta.keys():
        data["answer_score"] = {k: meta.pop(k) for k in ("em", "f1", "well_formed")}
    details = {s: meta.pop(f"{s}_detail") for s in REWARD_SOURCES if f"{s}_detail" in meta}
    if details:
        data["reward_details"] = details
    if meta.pop("live", False):
        data["live"] = {"session_id": meta.pop("session_id", ""), "segment": meta.pop("segment", 0),
                        "feedback": bool(meta.pop("feedback", False)), "prejudged": meta.pop("prejudged", {})}
    meta.pop("reward_weights", None)
    meta.pop("on_missing", None)
    data["metadata"] = meta
    return data


class Group(BaseModel):
    """The G rollouts of one task: the unit of replay storage and of normalisation."""

    model_config = ConfigDict(extra="forbid")

    group_id: str
    task_id: str
    trajectories: list[Trajectory] = Field(min_length=1)

    def min_version(self) -> int:
        """Oldest weights version in the group: what staleness is measured by. A rollout
        that failed before its first action has no version (no weights made anything in it)
        and does not count; a group of only such rollouts is 0."""
        return min((t.min_version() for t in self.trajectories if t.turns), default=0)


# -- JSONL ---------------------------------------------------------------------------------
def write_jsonl(path: str | Path, trajectories: Iterable[Trajectory]) -> int:
    """Write one trajectory per line; returns the count. Writes atomically (tmp + rename)."""
    path = Path(path)
    tmp = path.with_suffix(path.suffix + ".tmp")
    n = 0
    with tmp.open("w") as fh:
        for traj in trajectories:
            fh.write(traj.model_dump_json() + "\n")
            n += 1
    tmp.replace(path)
    return n


def read_jsonl(path: str | Path) -> Iterator[Trajectory]:
    """Yield trajectories; a bad line raises naming the file, line and field."""
    with Path(path).open() as fh:
        for lineno, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                yield Trajectory.model_validate_json(line)
            except ValidationError as exc:
                err = exc.errors()[0]
                loc = ".".join(str(p) for p in err["loc"]) or "<record>"
                raise ValueError(f"{path}:{lineno}: field '{loc}': {err['msg']}") from None
