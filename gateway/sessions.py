"""The session recorder: every live conversation becomes token-exact trajectories.

A session (``X-Session-Id``, else the request's ``user``, else one per request) groups the
requests of one conversation. For each request :meth:`SessionRecorder.prepare` decides the
prompt ids the engine will see, and :meth:`SessionRecorder.record` stores what it sampled:

- The request *extends* the session when its messages start with the previous request's
  messages plus the assistant message we returned (compared semantically: role, content, calls
  by name and parsed arguments; reasoning, which clients drop, is not compared) and it offers
  the same tools. Then the prompt is built in token space, exactly like ``rollout/episode.py``:
  previous prompt ids + previous completion ids + ``rollout.chat.observation_ids`` of the new
  messages. Nothing is re-tokenized or re-rendered; the suffix is the previous turn's
  ``observation_ids`` and the turn joins the current segment. This holds for templates that
  re-render history too (Qwen3's drops earlier ``<think>`` blocks once a user message follows):
  the segment keeps the tokens the engine saw and sampled.
- Otherwise the whole conversation is rendered by the chat template (``rollout.chat.prompt_ids``)
  and the turn opens a new segment, counted by cause:

  ``history_rewritten``        the messages (or tools) do not extend the recorded conversation;
  ``template_not_append_only`` they extend it, but the template ends an assistant turn
                               differently when messages follow (``observation_text`` raises, no
                               delta exists) and the full render's text differs from the
                               recorded prompt + completion;
  ``retokenization_drift``     as above, but the full render's text is the recorded text: only
                               its tokens differ (the model's tokens do not re-tokenize to
                               themselves).

  A full render that does start with the recorded prompt + completion ids still joins the
  segment (counted ``stitched_by_render``): its remainder is a token-exact extension.
  A stitched request whose conversation a fresh render would tokenize differently is counted
  ``stitched_over_rerender``: the recorded tokens are still the sampled ones.

``n > 1``: the client continues one choice, and only the next request says which. The segment
records choice 0 (what a client that never continues would show) and swaps in the continued
choice when the next request arrives; the other ``n - 1`` choices are counted as
``unchosen_choices`` and not recorded: they have no client feedback to train on.

A request recorded against a session that moved on since it was prepared (two requests of one
session in flight at once) opens a new segment with the prompt it was sampled from
(``concurrent_requests``). One whose session was closed while it was sampled (evicted, timed
out) opens a new session under the same id, so what was served is still recorded
(``closed_in_flight``).

Thread-safety: none needed and none provided. The gateway is one asyncio event loop on one
thread; ``prepare`` and ``record`` never await, so each runs atomically between the engine
call's awaits, and the revision check above catches interleaved requests of one session.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol, Sequence

from envs.formats import DEFAULT_FORMAT
from gateway.errors import SessionEnded, UnknownSession
from gateway.toolcalls import AssistantReply, same_message
from rollout import chat
from rollout.trajectory import LiveOrigin, Trajectory, Turn

CAUSES = ("history_rewritten", "template_not_append_only", "retokenization_drift", "concurrent_requests",
          "closed_in_flight")
COUNTERS = ("sessions_opened", "sessions_closed", "requests", "stitched", "stitched_by_render",
            "stitched_over_rerender", "segments", "unchosen_choices", "constrained", *CAUSES)


class SampledCompletion(Protocol):
    """What the recorder needs of an engine completion (``rollout.engines.base.Completion``)."""

    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str
    version_spans: list[tuple[int, int]]
    adapter: str | None


def session_id_for(header: str | None, user: str | None) -> str:
    """The ``X-Session-Id`` header, else the request's ``user``, else a fresh one-request id."""
    return header or user or f"req-{uuid.uuid4().hex}"


@dataclass
class PreparedPrompt:
    """The prompt one request sends to the engine, and how it relates to the session."""

    session_id: str
    prompt_ids: list[int]
    messages: list[dict[str, Any]]
    """The request's messages in chat-template form."""
    tools: list[dict[str, Any]]
    revision: int
    """The session's revision when prepared; ``record`` checks it has not moved."""
    serial: int = 0
    """Which opening of this session id it was prepared in; ``record`` checks it is still open."""
    continues: int | None = None
    """Which choice of the previous request this one continues (None: a new segment)."""
    observation_ids: list[int] = field(default_factory=list)
    """Tokens after the continued completion (tool results, next header); stitched only."""
    by_render: bool = False
    """Stitched from a full render that extended the recorded ids token for token."""
    over_rerender: bool = False
    """Stitched, though a fresh render of the conversation gives other ids (the template
    re-renders history, e.g. Qwen3 dropping earlier reasoning, or the sampled ids do not
    re-tokenize to themselves): what a re-tokenizing trainer would have got wrong."""
    cause: str | None = None
    """Why a new segment starts (None: stitched, or the session's first request)."""

    def extend(self, ids: list[int]) -> None:
        """Tokens the server adds after the rendered prompt (the reply's opening): part of the
        prompt, and of the observation a stitched turn records, so the record stays exact."""
        self.prompt_ids = self.prompt_ids + ids
        if self.continues is not None:
            self.observation_ids = self.observation_ids + ids


@dataclass
class LiveSegment:
    """One trajectory of a session, plus the engine's finish reason of each turn."""

    trajectory: Trajectory
    finish_reasons: list[str] = field(default_factory=list)
    """Per turn: the engine's finish reason (stop, length, abort)."""


@dataclass
class _Choice:
    turn: Turn
    finish_reason: str
    action_ended: bool
    message: dict[str, Any]
    ended_early: str | None = None
    """Why the server cut this choice's sampling (``LiveOrigin.ended_early``), if it did."""


@dataclass
class _Last:
    """The last recorded request: what the next one may extend."""

    prompt_ids: list[int]
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]]
    choices: list[_Choice]


@dataclass
class Session:
    session_id: str
    last_active: float
    """When the last request was recorded or feedback came (the idle clocks start here)."""
    serial: int = 0
    """The recorder's count of opened sessions when this one opened (ids are reused)."""
    segments: list[LiveSegment] = field(default_factory=list)
    last: _Last | None = None
    revision: int = 0
    ended: bool = False

    def num_turns(self) -> int:
        return sum(len(s.trajectory.turns) for s in self.segments)


def _turn_from_completion(comp: SampledCompletion, reply: AssistantReply) -> Turn:
    """A live completion as a Turn (``Turn.sampled``), with the reply's calls and text."""
    return Turn.sampled(comp, tool_calls=list(reply.calls), invalid_action=bool(reply.errors), text=reply.text)


class SessionRecorder:
    """Sessions of one gateway, keyed by session id."""

    def __init__(self, tokenizer: Any, clock: Callable[[], float] = time.monotonic,
                 chat_format: str = DEFAULT_FORMAT) -> None:
        self.tokenizer = tokenizer
        self.clock = clock
        self.chat_format = chat_format
        """The policy's chat format (``envs.formats``): how prompts show tools and calls."""
        self._sessions: dict[str, Session] = {}
        self._counters = dict.fromkeys(COUNTERS, 0)

    # -- sessions --------------------------------------------------------------------------
    def open(self, session_id: str) -> Session:
        """The session, created on first use."""
        if session_id not in self._sessions:
            self._counters["sessions_opened"] += 1
            self._sessions[session_id] = Session(session_id, self.clock(), self._counters["sessions_opened"])
        return self._sessions[session_id]

    def touch(self, session_id: str) -> None:
        """Activity other than a request (feedback): the session's idle time starts again."""
        self.get(session_id).last_active = self.clock()

    def has(self, session_id: str) -> bool:
        """A session with this id is open."""
        return session_id in self._sessions

    def get(self, session_id: str) -> Session:
        if session_id not in self._sessions:
            raise UnknownSession(session_id)
        return self._sessions[session_id]

    def end(self, session_id: str) -> None:
        """No more requests; feedback is still taken until ``close``."""
        self.get(session_id).ended = True

    def close(self, session_id: str) -> list[LiveSegment]:
        """Forget the session and hand back its segments (for replay)."""
        session = self.get(session_id)
        del self._sessions[session_id]
        self._counters["sessions_closed"] += 1
        return session.segments

    def segments(self, session_id: str) -> list[LiveSegment]:
        return self.get(session_id).segments

    def idle(self, older_than_s: float) -> list[str]:
        """Sessions with no request for ``older_than_s`` seconds, least recently active first."""
        now = self.clock()
        idle = [s for s in self._sessions.values() if now - s.last_active >= older_than_s]
        return [s.session_id for s in sorted(idle, key=lambda s: s.last_active)]

    @property
    def counters(self) -> dict[str, int]:
        """Totals since start, for metrics."""
        return dict(self._counters)

    # -- requests --------------------------------------------------------------------------
    def prepare(self, session_id: str, messages: list[dict[str, Any]],
                tools: list[dict[str, Any]]) -> PreparedPrompt:
        """The prompt ids for a request's template-form ``messages``. Records nothing."""
        session = self.open(session_id)
        if session.ended:
            raise SessionEnded(session_id)
        base = PreparedPrompt(session_id, [], messages, tools, session.revision, session.serial)
        last = session.last
        if last is None:
            base.prompt_ids = chat.prompt_ids(self.tokenizer, messages, tools, self.chat_format)
            return base
        k = _continued_choice(last, messages, tools)
        if k is None:
            return self._new_segment(base, "history_rewritten")
        done = last.prompt_ids + last.choices[k].turn.action_ids
        new = messages[len(last.messages) + 1:]
        try:
            obs = chat.observation_ids(self.tokenizer, new, last.choices[k].action_ended, self.chat_format)
        except ValueError:  # the template ends the turn differently now: only a full render is right
            return self._by_render(base, last, k, done)
        base.prompt_ids, base.continues, base.observation_ids = done + obs, k, obs
        base.over_rerender = chat.prompt_ids(self.tokenizer, messages, tools, self.chat_format) != base.prompt_ids
        return base

    def _new_segment(self, base: PreparedPrompt, cause: str, ids: list[int] | None = None) -> PreparedPrompt:
        base.prompt_ids = ids if ids is not None else chat.prompt_ids(self.tokenizer, base.messages, base.tools,
                                                                      self.chat_format)
        base.cause = cause
        return base

    def _by_render(self, base: PreparedPrompt, last: _Last, k: int, done: list[int]) -> PreparedPrompt:
        ids = chat.prompt_ids(self.tokenizer, base.messages, base.tools, self.chat_format)
        if ids[:len(done)] == done:
            base.prompt_ids, base.continues, base.by_render = ids, k, True
            base.observation_ids = ids[len(done):]
            return base
        same_text = self._text(ids).startswith(self._text(done))
        return self._new_segment(base, "retokenization_drift" if same_text else "template_not_append_only", ids)

    def _text(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=False)

    def record(self, prepared: PreparedPrompt, completions: Sequence[SampledCompletion],
               replies: Sequence[AssistantReply], constrained: str | None = None,
               ended_early: Sequence[str | None] = ()) -> tuple[LiveSegment, int] | None:
        """Store a request's sampled choices (``replies[i]`` is what choice ``i`` returned);
        ``constrained``: what reshaped the distribution they were sampled from (a grammar,
        ``gateway.constraints``; logit bias; penalties), kept as ``LiveOrigin.constrained`` of
        the turn; ``ended_early``: per choice, why its sampling was cut short, if it was
        (``LiveOrigin.ended_early`` of the turn, for the choice the segment holds). Returns the
        segment and the index of the turn whose next state (tool result, user reply) this
        request brought, when it was stitched on; else None."""
        if not completions or len(completions) != len(replies):
            raise ValueError(f"record needs one reply per completion ({len(completions)} completions, "
                             f"{len(replies)} replies)")
        session = self._sessions.get(prepared.session_id)
        reopened = session is None or session.serial != prepared.serial
        if session is None:  # closed while this request was sampled: keep what was served all the same
            session = self.open(prepared.session_id)
        eos = self.tokenizer.eos_token_id
        cuts = list(ended_early) + [None] * (len(completions) - len(ended_early))
        choices = [_Choice(_turn_from_completion(c, r), c.finish_reason,
                           bool(c.token_ids) and c.token_ids[-1] == eos, r.template_message(), cut)
                   for c, r, cut in zip(completions, replies, cuts)]
        followed = None
        if reopened:
            self._open_segment(session, prepared.prompt_ids, "closed_in_flight")
        elif prepared.revision != session.revision:
            self._open_segment(session, prepared.prompt_ids, "concurrent_requests")
        elif prepared.continues is not None:
            self._continue_segment(session, prepared)
            followed = (session.segments[-1], len(session.segments[-1].trajectory.turns) - 1)
        else:
            self._open_segment(session, prepared.prompt_ids, prepared.cause)
        seg = session.segments[-1]
        _append(seg, choices[0])
        if constrained is not None and seg.trajectory.live is not None:
            seg.trajectory.live.constrained[len(seg.trajectory.turns) - 1] = constrained
            self._counters["constrained"] += 1

        self._counters["requests"] += 1
        self._counters["unchosen_choices"] += len(choices) - 1
        session.last = _Last(prepared.prompt_ids, prepared.messages, prepared.tools, choices)
        session.revision += 1
        session.last_active = self.clock()
        return followed

    def _open_segment(self, session: Session, prompt_ids: list[int], cause: str | None) -> None:
        index = len(session.segments)
        traj = Trajectory(
            trajectory_id=uuid.uuid4().hex, task_id=f"live:{session.session_id}",
            group_id=f"live:{session.session_id}:{index}:{uuid.uuid4().hex[:8]}",
            prompt_ids=list(prompt_ids),
            live=LiveOrigin(session_id=session.session_id, segment=index),
        )
        session.segments.append(LiveSegment(traj))
        self._counters["segments"] += 1
        if cause is not None:
            self._counters[cause] += 1

    def _continue_segment(self, session: Session, prepared: PreparedPrompt) -> None:
        seg, last = session.segments[-1], session.last
        assert last is not None and prepared.continues is not None
        chosen = last.choices[prepared.continues]
        if prepared.continues != 0:  # the segment held choice 0 until now
            seg.trajectory.turns.pop()
            seg.finish_reasons.pop()
            _append(seg, chosen)
        seg.trajectory.turns[-1].observation_ids = list(prepared.observation_ids)
        # The invariant the whole recorder exists for: the engine's prompt is the segment so far.
        if seg.trajectory.token_ids() != prepared.prompt_ids:
            raise RuntimeError(f"session {session.session_id}: stitched prompt is not the segment's tokens")
        self._counters["stitched_by_render" if prepared.by_render else "stitched"] += 1
        self._counters["stitched_over_rerender"] += prepared.over_rerender


def _append(seg: LiveSegment, choice: _Choice) -> None:
    """The choice as the segment's last turn (replacing a sibling choice there: ``_continue_segment``)."""
    seg.trajectory.turns.append(choice.turn.model_copy(deep=True))
    seg.finish_reasons.append(choice.finish_reason)
    live, t = seg.trajectory.live, len(seg.trajectory.turns) - 1
    if live is not None:
        if choice.ended_early is not None:
            live.ended_early[t] = choice.ended_early
        else:
            live.ended_early.pop(t, None)


def _continued_choice(last: _Last, messages: list[dict[str, Any]], tools: list[dict[str, Any]]) -> int | None:
    """Index of the previous choice these messages continue, or None when they do not extend."""
    n = len(last.messages)
    if tools != last.tools or len(messages) <= n:
        return None
    if not all(same_message(a, b) for a, b in zip(messages[:n], last.messages)):
        return None
    return next((k for k, c in enumerate(last.choices) if same_message(messages[n], c.message)), None)
