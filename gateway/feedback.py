"""Client feedback on a live session: ``POST /v1/sessions/{id}/feedback``.

Body: ``outcome`` (a finite float), optional ``turn_rewards``, ``gold_answers`` and
``gold_tool_calls``. Turn indices count the session's turns across its segments in the order
they were recorded -- turn ``i`` is the assistant reply to the session's ``i``-th recorded
request, whichever segment it landed in. ``turn_rewards`` is either ``{index: reward}`` (JSON
keys as strings are fine) or a list by index where ``null`` means "no reward for this turn".

Where it goes, per segment: ``Trajectory.outcome`` and the last turn's ``rewards["outcome"]``
(what the reward stage's outcome scorer writes: the conversation's outcome is every segment's);
per-turn rewards in ``Turn.rewards["env"]`` -- the client plays the environment's part in live
traffic, so its turn rewards are the ``env`` source the estimators and ``rewards.weights``
already know; gold answers and calls on every segment (for the match/IG scorers). A turn with
no client reward gets no ``env`` slot (absent, never ``None``, which would mean a failed scorer
and mask the turn). Feedback sent again replaces the earlier feedback entirely.

Validation happens before any write: a bad body (unknown session, wrong types, a turn index
out of range) raises a GatewayError naming the field and leaves the session as it was.
"""

from __future__ import annotations

import json
from typing import Any

from pydantic import BaseModel, ConfigDict, FiniteFloat, ValidationError, field_validator

from envs.toolcalls import ToolCall
from gateway.errors import InvalidRequest, from_validation
from gateway.sessions import Session, SessionRecorder

FEEDBACK_SOURCE = "env"


class GoldCall(BaseModel):
    """One expected tool call; ``arguments`` as an object or OpenAI's JSON string."""

    model_config = ConfigDict(extra="forbid")

    name: str
    arguments: dict[str, Any] | str = {}

    @field_validator("arguments")
    @classmethod
    def _object(cls, value: dict[str, Any] | str) -> dict[str, Any] | str:
        if isinstance(value, str):
            try:
                parsed = json.loads(value)
            except json.JSONDecodeError as exc:
                raise ValueError(f"not valid JSON ({exc.msg} at char {exc.pos})") from None
            if not isinstance(parsed, dict):
                raise ValueError("must be a JSON object")
            return parsed
        return value


class Feedback(BaseModel):
    """A client's verdict on one session."""

    model_config = ConfigDict(extra="forbid")

    outcome: FiniteFloat
    turn_rewards: dict[int, FiniteFloat] | list[FiniteFloat | None] | None = None
    gold_answers: list[str] | None = None
    gold_tool_calls: list[GoldCall] | None = None

    def rewards_by_turn(self) -> dict[int, float]:
        """Turn index -> reward, the turns without one left out."""
        if isinstance(self.turn_rewards, list):
            return {i: r for i, r in enumerate(self.turn_rewards) if r is not None}
        return dict(self.turn_rewards or {})


def parse_feedback(body: Any) -> Feedback:
    """The body as Feedback; InvalidRequest names the first bad field."""
    if not isinstance(body, dict):
        raise InvalidRequest(None, "the feedback body must be a JSON object")
    try:
        return Feedback.model_validate(body)
    except ValidationError as exc:
        fields = frozenset({*Feedback.model_fields, *GoldCall.model_fields})
        raise from_validation(exc, fields) from None


def check_against(session: Session, feedback: Feedback) -> None:
    """Raise InvalidRequest when ``feedback`` does not fit what ``session`` recorded."""
    n = session.num_turns()
    if n == 0:
        raise InvalidRequest("session_id", f"session {session.session_id!r} has no recorded turns to rate")
    indices = range(len(feedback.turn_rewards)) if isinstance(feedback.turn_rewards, list) \
        else feedback.rewards_by_turn()
    for i in indices:
        if not 0 <= i < n:
            raise InvalidRequest(f"turn_rewards.{i}",
                                 f"turn index out of range: the session has {n} turns (0..{n - 1})")


def apply_feedback(recorder: SessionRecorder, session_id: str, body: Any) -> Feedback:
    """Validate ``body`` against the session, then write it into every segment."""
    session = recorder.get(session_id)  # UnknownSession (404) first
    feedback = parse_feedback(body)
    check_against(session, feedback)
    gold_calls = None if feedback.gold_tool_calls is None else \
        [ToolCall(name=c.name, arguments=c.arguments) for c in feedback.gold_tool_calls]
    rewards, index = feedback.rewards_by_turn(), 0
    for seg in session.segments:
        traj = seg.trajectory
        traj.gold_answers = feedback.gold_answers
        traj.gold_tool_calls = gold_calls
        for turn in traj.turns:
            turn.rewards.pop(FEEDBACK_SOURCE, None)
            if index in rewards:
                turn.rewards[FEEDBACK_SOURCE] = rewards[index]
            index += 1
        traj.set_outcome(feedback.outcome)
        if traj.live is not None:
            traj.live.feedback = True
    return feedback
