"""The live service: OpenAI requests in, engine calls, recorded sessions out to replay.

``LiveService`` is the gateway minus HTTP (``gateway.app`` adds the routes). Per chat request:
parse and validate (400 naming the parameter; also when it needs constrained decoding,
``gateway.constraints``, and the engines lack the ``guided`` feature), check replay's room for
live groups (only with ``when_full: reject``: 429), build the prompt in token space through the
session recorder, sample through the engine client (the same engine group the rollout workers
use; with ``stop`` strings, streamed and cut where one is written), answer, record. A session
closes, counted by cause (``CLOSE_CAUSES``), on ``end`` plus feedback (``ended``),
``close_after_feedback_s`` after its feedback when no request follows (``feedback_idle``), after
``feedback_timeout_s`` idle (``timed_out``), when ``max_sessions`` needs its room (``evicted``),
or when the run stops (``run_ended``). It leaves the session table at once; its segments then go
to the reward service as groups of one, which scores them with the sources that apply and puts
them into replay unscheduled (they never take a rollout producer's reservation), or are dropped;
every segment is counted by what became of it (``EPISODE_RESULTS``). A refused put sheds the
recording, counted; serving never waits on it. With ``record_path`` every closed segment is also
appended there as JSONL (``{"replay": put status or why it was dropped, "trajectory": ...}``),
the run's record of what it served.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, AsyncIterator, Callable, Protocol

from envs.formats import DEFAULT_FORMAT
from gateway.admission import Admission
from gateway.config import LiveConfig
from gateway.constraints import GUIDED, Guide, guide_for
from gateway.errors import GatewayError, InvalidRequest, ModelNotFound, NoEngine, SessionClosed
from gateway.feedback import apply_feedback
from gateway.openai_types import ChatCompletionChunk, ChatCompletionRequest, ModelCard, ModelList, NamedToolChoice, \
    Usage, parse_chat_request
from gateway.responses import ChoiceStream, FirstCallWatch, StopWatch, chat_completion
from gateway.sessions import PreparedPrompt, SessionRecorder, session_id_for
from gateway.toolcalls import template_messages, thinking_off_ids
from rollout.engines.base import Chunk, Completion, SamplingParams
from rollout.engines.client import EngineClient, EngineUnavailable
from rollout.trajectory import Group, Trajectory

log = logging.getLogger(__name__)

EPISODE_RESULTS = ("recorded", "shed", "not_trained", "dropped_no_feedback", "dropped_unscorable",
                   "dropped_run_ended", "submit_failed", "client_disconnected", "client_stalled", "engine_failed")
"""What became of each closed segment: ``recorded`` into replay, ``shed`` (replay refused it:
full, stale), ``not_trained`` (the run trains on rollouts only: kept in live_sessions.jsonl),
dropped (no feedback and ``on_timeout: drop``; no feedback and no source that scores without
it; the run stopped first), ``submit_failed`` (the reward service raised; logged). And per
request: ``client_disconnected`` (a stream abandoned before its end, nothing recorded),
``client_stalled`` (a stream whose client read nothing for ``stream_stall_timeout_s``: ended,
its engine requests aborted, nothing recorded), ``engine_failed`` (no engine could serve it, or
its engine died mid-stream: the client got a 503 or an error event, nothing recorded; the
session's other turns are)."""
CLOSE_CAUSES = ("ended", "feedback_idle", "timed_out", "evicted", "run_ended")
"""Why a session closed: ``/end`` after (or before) feedback, ``close_after_feedback_s`` idle
after feedback, ``feedback_timeout_s`` idle, ``max_sessions`` needed the room, the run stopped."""


class Overloaded(GatewayError):
    """Replay has no room for live recordings and the run rejects rather than sheds."""

    status = 429

    def __init__(self, retry_after_s: int) -> None:
        super().__init__(None, "the run's replay budget for live traffic is full; retry later")
        self.retry_after_s = retry_after_s


class ClientStalled(GatewayError):
    """The client read nothing of a stream for ``stream_stall_timeout_s``: the stream ended."""

    status = 408

    def __init__(self, timeout_s: float) -> None:
        super().__init__(None, f"the client read nothing of this stream for {timeout_s:g} s; it was ended "
                               "and its engine requests aborted (live.stream_stall_timeout_s)")


class _StallWatch:
    """Ends a stream's engine work when its client stops reading: while a chunk waits to be
    taken (the consumer is suspended at ``yield``, held by the HTTP layer's back-pressure) for
    longer than ``timeout_s``, the stream's engine tasks are cancelled -- their requests aborted,
    the batch rows freed -- and the consumer raises ``ClientStalled`` when it is resumed."""

    def __init__(self, timeout_s: float, tasks: list[asyncio.Task], on_stall: Callable[[], None]) -> None:
        self.timeout_s, self.tasks, self.on_stall = timeout_s, tasks, on_stall
        self.since: float | None = None  # when the chunk now waiting was handed out
        self.stalled = False
        self._task = asyncio.get_running_loop().create_task(self._watch())

    @contextlib.contextmanager
    def sending(self):  # type: ignore[no-untyped-def]
        self.since = time.monotonic()
        yield
        self.since = None
        if self.stalled:
            raise ClientStalled(self.timeout_s)

    async def _watch(self) -> None:
        while not self.stalled:
            await asyncio.sleep(self.timeout_s / 4)
            if self.since is not None and time.monotonic() - self.since > self.timeout_s:
                self.stalled = True
                self.on_stall()  # counted now: a client that never reads again never resumes us
                for t in self.tasks:
                    t.cancel()

    def close(self) -> None:
        self._task.cancel()


class LivePorts(Protocol):
    async def submit(self, group: Group) -> str:
        """Score a live group and put it into replay unscheduled; returns the put status."""
        ...

    async def live_room(self) -> int:
        """How many more live groups replay would accept now."""
        ...

    async def judge_early(self, traj: Trajectory, turns: list[int]) -> list[dict[str, Any]]:
        """Judge ``turns`` of a session in progress (a hindsight judge, ``rewards.prm``); one
        ``{"score", "raw", "error"}`` per turn."""
        ...


@dataclass
class _Call:
    req: ChatCompletionRequest
    prepared: PreparedPrompt
    params: SamplingParams
    completion_id: str
    created: int
    guide: Guide | None = None
    completion_tokens: int = 0
    ended_early: dict[int, str] = field(default_factory=dict)
    """Choice index -> why its sampling was ended before the model ended it (``stop``: a stop
    string; ``first_tool_call``: ``parallel_tool_calls: false``)."""

    @property
    def watched(self) -> bool:
        """The decoded text is watched as it is sampled (stop strings, one call at most)."""
        return bool(self.req.stop) or self.one_call

    @property
    def one_call(self) -> bool:
        return self.req.parallel_tool_calls is False and bool(self.prepared.tools)

    @property
    def named_tool(self) -> bool:
        """``tool_choice`` names a function: its call finishes ``stop``, as OpenAI's does."""
        return isinstance(self.req.tool_choice, NamedToolChoice)

    @property
    def usage_asked(self) -> bool:
        return self.req.stream_options is not None and self.req.stream_options.include_usage


class LiveService:
    def __init__(self, cfg: LiveConfig, engine: EngineClient, ports: LivePorts | None,
                 scorable_without_feedback: bool = False, record_path: str | Path | None = None,
                 early_judge: bool = False, chat_format: str = DEFAULT_FORMAT) -> None:
        self.cfg, self.engine, self.ports = cfg, engine, ports
        self.chat_format = chat_format
        """The policy's chat format (``rollout.chat_format``): prompts, tool calls, reasoning."""
        self.early_judge = early_judge and ports is not None
        """Judge each turn as soon as its next state arrives (a hindsight judge is configured)."""
        self._early: dict[str, dict[int, asyncio.Task]] = {}
        """Segment group id -> turn index -> its early judgement in flight or done."""
        self.record_path = Path(record_path) if record_path else None
        self.scorable_without_feedback = scorable_without_feedback
        self.recorder = SessionRecorder(engine.tokenizer, chat_format=chat_format)
        self._feedback: set[str] = set()
        self._episodes = dict.fromkeys(EPISODE_RESULTS, 0)
        self._feedback_counts = {"received": 0, "invalid": 0, "timed_out": 0}
        self._closed = dict.fromkeys(CLOSE_CAUSES, 0)
        self._closed_ids: OrderedDict[str, tuple[str, int, bool]] = OrderedDict()
        """Recently closed session id -> (cause, turns, submitted with feedback), for an /end or
        feedback that comes after the close."""
        self._pending: set[asyncio.Task] = set()
        self._features: frozenset[str] | None = None
        """The engines' ``features``, asked once (the first request that needs one)."""
        self.admission = Admission(cfg.max_concurrent, cfg.max_concurrent_per_token, cfg.retry_after_s)

    # -- chat ------------------------------------------------------------------------------
    async def open_call(self, body: Any, session_header: str | None) -> _Call:
        req = parse_chat_request(body)
        if req.model is not None and req.model != self.cfg.model_name:
            raise ModelNotFound(req.model, self.cfg.model_name)
        if self.cfg.when_full == "reject" and self.ports is not None and await self.ports.live_room() <= 0:
            raise Overloaded(self.cfg.retry_after_s)
        sid = session_id_for(session_header, req.user)
        self._make_room(sid)
        prepared = self.recorder.prepare(sid, template_messages(req.messages), req.tool_dicts())
        prepared.extend(thinking_off_ids(self.engine.tokenizer, self.chat_format, req.reasoning_effort))
        max_new = req.max_new_tokens(self.cfg.default_max_tokens)
        if len(prepared.prompt_ids) + max_new > self.cfg.max_context_tokens:
            raise InvalidRequest("messages", f"the conversation is {len(prepared.prompt_ids)} tokens; with "
                                 f"max_tokens {max_new} it exceeds the server's context of "
                                 f"{self.cfg.max_context_tokens} tokens")
        guide = await self._guide(req)
        tok = self.engine.tokenizer
        params = SamplingParams(temperature=req.temperature, top_p=req.top_p, max_new_tokens=max_new,
                                stop_token_ids=req.stop_token_ids(tok), n=req.n, seed=req.seed,
                                guide=guide.tag if guide else None, logit_bias=req.bias_pairs(len(tok)),
                                presence_penalty=req.presence_penalty, frequency_penalty=req.frequency_penalty,
                                top_logprobs=req.top_logprobs or 0)
        return _Call(req, prepared, params, f"chatcmpl-{uuid.uuid4().hex}", int(time.time()), guide)

    async def _guide(self, req: ChatCompletionRequest) -> Guide | None:
        """The request's constraint; a 400 naming its parameter when the engine cannot."""
        guide = guide_for(req, self.chat_format)
        if guide is None:
            return None
        if self._features is None:
            self._features = await self.engine.features()
        if GUIDED not in self._features:
            raise InvalidRequest(guide.param, f"{guide.param} ({guide.reason.replace('_', ' ')}) needs constrained "
                                 "decoding, which this run's engine (the HF engine) does not do; serve with the "
                                 "vLLM engine (rollout.engine.type: vllm), or drop it")
        return guide

    async def _choice_chunks(self, call: _Call, i: int, request_id: str) -> AsyncIterator[Chunk]:
        """Choice ``i``'s chunks from the engine; watched (``_Call.watched``), cut at the token
        that completes the first stop string written or closes the first call (finish ``stop``,
        the cause in ``call.ended_early``) and the engine request aborted."""
        watches = []
        if call.req.stop:
            watches.append(("stop", StopWatch(self.engine.tokenizer, call.req.stop_list(), self.chat_format)))
        if call.one_call:
            watches.append(("first_tool_call", FirstCallWatch(self.engine.tokenizer, self.chat_format)))
        chunks = self.engine.stream(call.prepared.prompt_ids, call.params.choice(i), request_id,
                                    session_id=call.prepared.session_id)
        async with contextlib.aclosing(chunks):
            async for chunk in chunks:
                cuts = [(keep, cause) for cause, w in watches if (keep := w.feed(chunk.token_ids)) is not None]
                if cuts:
                    keep, call.ended_early[i] = min(cuts)
                    yield Chunk(chunk.request_id, chunk.token_ids[:keep], chunk.logprobs[:keep], chunk.version, "stop",
                                chunk.adapter, chunk.top[:keep])
                    return
                yield chunk

    async def _until_stop(self, call: _Call, i: int) -> Completion:
        comp = Completion.empty(f"{call.completion_id}-{i}")
        async for chunk in self._choice_chunks(call, i, comp.request_id):
            comp.take(chunk)
        return comp

    async def complete(self, call: _Call) -> dict[str, Any]:
        try:
            if call.watched:
                comps = list(await asyncio.gather(*[self._until_stop(call, i) for i in range(call.params.n)]))
            else:
                comps = await self.engine.generate_n(call.prepared.prompt_ids, call.params,
                                                     session_id=call.prepared.session_id)
        except EngineUnavailable as exc:
            raise self._engine_failed(exc) from exc
        response, replies = chat_completion(
            self.engine.tokenizer, call.completion_id, self.cfg.model_name, call.created,
            len(call.prepared.prompt_ids), comps, bool(call.prepared.tools), call.req.logprobs, self.chat_format,
            call.req.stop_list(), call.named_tool)
        self._judge_followed(self.recorder.record(call.prepared, comps, replies, self._constrained(call),
                                                      [call.ended_early.get(i) for i in range(len(comps))]))
        call.completion_tokens = response.usage.completion_tokens
        return response.wire()

    async def stream(self, call: _Call) -> AsyncIterator[ChatCompletionChunk]:
        """Chunks of all ``n`` choices as they are sampled; records when every choice ends.
        A consumer that stops early aborts the engine requests and records nothing."""
        tok, n = self.engine.tokenizer, call.params.n
        outs = [ChoiceStream(tok, call.completion_id, i, bool(call.prepared.tools), call.req.logprobs,
                             self.chat_format, call.req.stop_list(), call.named_tool) for i in range(n)]
        comps = [Completion.empty(f"{call.completion_id}-{i}") for i in range(n)]
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(i: int) -> None:
            try:
                async for chunk in self._choice_chunks(call, i, comps[i].request_id):
                    await queue.put((i, chunk))
            except BaseException as exc:  # noqa: BLE001 - handed to the consumer, which re-raises
                await queue.put((i, exc))

        tasks = [asyncio.create_task(pump(i)) for i in range(n)]
        stall = _StallWatch(self.cfg.stream_stall_timeout_s, tasks, lambda: self._count("client_stalled"))
        finished = 0
        try:
            while finished < n:
                i, chunk = await queue.get()
                if isinstance(chunk, BaseException):
                    raise chunk
                comps[i].take(chunk)
                choices = outs[i].push(chunk.token_ids, chunk.logprobs, chunk.top) if chunk.token_ids else []
                if chunk.finish_reason is not None:
                    closing, _ = outs[i].finish(chunk.finish_reason)
                    choices += closing
                    finished += 1
                for choice in choices:  # one choice delta per chunk, as OpenAI streams
                    with stall.sending():
                        yield self._chunk(call, [choice])
        except ClientStalled:
            raise
        except EngineUnavailable as exc:
            raise self._engine_failed(exc) from exc
        except BaseException:
            self._episodes["client_disconnected"] += finished < n
            raise
        finally:
            stall.close()
            for t in tasks:
                t.cancel()
        replies = [o.finish(c.finish_reason)[1] for o, c in zip(outs, comps)]
        self._judge_followed(self.recorder.record(call.prepared, comps, replies, self._constrained(call),
                                                      [call.ended_early.get(i) for i in range(len(comps))]))
        call.completion_tokens = sum(len(c.token_ids) for c in comps)
        if call.usage_asked:
            done = sum(len(c.token_ids) for c in comps)
            p = len(call.prepared.prompt_ids)
            yield ChatCompletionChunk(id=call.completion_id, created=call.created, model=self.cfg.model_name,
                                      choices=[], usage=Usage(prompt_tokens=p, completion_tokens=done,
                                                              total_tokens=p + done))

    @staticmethod
    def _constrained(call: _Call) -> str | None:
        """What reshaped the distribution the turn was sampled from (a grammar, the request's
        logit bias or penalties): its log-probs are not the policy's own."""
        if call.guide is not None:
            return call.guide.reason
        if call.params.logit_bias:
            return "logit_bias"
        return "penalties" if call.params.reshaped else None

    def _judge_followed(self, followed: tuple[Any, int] | None) -> None:
        """Turn t's next state just arrived: have the judge score it now (on a copy of the
        segment up to t), not when the session closes."""
        if not self.early_judge or followed is None:
            return
        seg, t = followed
        turns = [turn.model_copy(deep=True) for turn in seg.trajectory.turns[:t + 1]]
        traj = seg.trajectory.model_copy(update={"turns": turns, "live": seg.trajectory.live.model_copy(deep=True)})
        task = asyncio.get_running_loop().create_task(self.ports.judge_early(traj, [t]))
        self._early.setdefault(seg.trajectory.group_id, {})[t] = task

    async def _prejudged(self, traj: Trajectory) -> None:
        """Keep the segment's early judgements (``live.prejudged``) so the reward
        service judges only the turns left; a failed early call leaves its turn to it."""
        early = self._early.pop(traj.group_id, {})
        results = await asyncio.gather(*early.values(), return_exceptions=True)
        pre = {t: res[0] for t, res in zip(early, results)
               if isinstance(res, list) and len(res) == 1 and t < len(traj.turns)}
        if pre and traj.live is not None:
            traj.live.prejudged = pre

    def _chunk(self, call: _Call, choices: list[Any]) -> ChatCompletionChunk:
        return ChatCompletionChunk(id=call.completion_id, created=call.created, model=self.cfg.model_name,
                                   choices=choices, usage_field=call.usage_asked)

    async def models(self) -> dict[str, Any]:
        """The policy, with the weights version every engine serves now (the lowest of the
        group: a request may land on any engine), asked of the engines rather than read from
        the last response, so it moves while no traffic flows."""
        version = int(min(s["version"] for s in await self.engine.stats()))
        card = ModelCard(id=self.cfg.model_name, created=0, version=version)
        return ModelList(data=[card]).wire()

    # -- sessions --------------------------------------------------------------------------
    def feedback(self, session_id: str, body: Any) -> dict[str, Any]:
        if session_id in self._closed_ids and not self.recorder.has(session_id):
            self._feedback_counts["invalid"] += 1
            raise SessionClosed(session_id, self._closed_ids[session_id][0])
        try:
            fb = apply_feedback(self.recorder, session_id, body)
        except GatewayError:
            self._feedback_counts["invalid"] += 1
            raise
        self._feedback_counts["received"] += 1
        self._feedback.add(session_id)
        self.recorder.touch(session_id)  # close_after_feedback_s counts from here
        session = self.recorder.get(session_id)
        out = {"session_id": session_id, "turns": session.num_turns(), "outcome": fb.outcome,
               "submitted": session.ended}
        if session.ended:
            self._close_now(session_id, "ended")
        return out

    def end(self, session_id: str) -> dict[str, Any]:
        """End a session; for one the gateway closed a moment ago (after its feedback went
        idle: a client's /end racing ``close_after_feedback_s``), the same answer again."""
        if session_id in self._closed_ids and not self.recorder.has(session_id):
            cause, turns, submitted = self._closed_ids[session_id]
            return {"session_id": session_id, "turns": turns, "submitted": submitted, "closed": cause}
        self.recorder.end(session_id)
        session = self.recorder.get(session_id)
        has_feedback = session_id in self._feedback
        out = {"session_id": session_id, "turns": session.num_turns(), "submitted": has_feedback}
        if has_feedback:
            self._close_now(session_id, "ended")
        return out

    async def sweep(self) -> int:
        """Close the sessions with feedback idle past ``close_after_feedback_s`` and every
        session idle past ``feedback_timeout_s``; waits for their submissions; returns how many."""
        after_feedback = [s for s in self.recorder.idle(self.cfg.close_after_feedback_s) if s in self._feedback]
        closing = set(after_feedback)
        timed_out = [s for s in self.recorder.idle(self.cfg.feedback_timeout_s) if s not in closing]
        tasks = [self._close_now(s, "feedback_idle") for s in after_feedback]
        tasks += [self._close_now(s, "timed_out") for s in timed_out]
        await asyncio.gather(*[t for t in tasks if t is not None])
        return len(tasks)

    async def close_all(self, cause: str = "run_ended") -> int:
        """Close every open session (the run is stopping); returns how many."""
        sids = self.recorder.idle(0.0)
        await asyncio.gather(*[t for t in (self._close_now(s, cause) for s in sids) if t is not None])
        return len(sids)

    def _make_room(self, session_id: str) -> None:
        """Before ``session_id`` opens: close the least recently active sessions while the
        table is full (``max_sessions``)."""
        if session_id in self.recorder._sessions:  # noqa: SLF001 - same package
            return
        while len(self.recorder._sessions) >= self.cfg.max_sessions:  # noqa: SLF001
            self._close_now(self.recorder.idle(0.0)[0], "evicted")

    def _close_now(self, session_id: str, cause: str) -> asyncio.Task | None:
        """Take the session out of the table now (its id may open a new session at once) and
        submit, score or drop its segments in the background; None when it was closed already."""
        try:
            segments = self.recorder.close(session_id)
        except GatewayError:
            return None
        had_feedback = session_id in self._feedback
        self._feedback.discard(session_id)
        self._closed[cause] += 1
        self._closed_ids[session_id] = (cause, sum(len(s.trajectory.turns) for s in segments), had_feedback)
        while len(self._closed_ids) > self.cfg.max_sessions:  # bounded: the oldest closes are forgotten
            self._closed_ids.popitem(last=False)
        return self._spawn(self._submit(segments, had_feedback, cause))

    def _spawn(self, coro: Any) -> asyncio.Task:
        task = asyncio.get_running_loop().create_task(coro)
        self._pending.add(task)
        task.add_done_callback(self._pending.discard)
        return task

    def _dropped(self, had_feedback: bool, cause: str) -> str | None:
        """Why a closed session's segments are not submitted (None: they are)."""
        if cause == "run_ended":
            return "dropped_run_ended"  # the learner is done: recorded in the file only
        if had_feedback:
            return None
        self._feedback_counts["timed_out"] += 1  # closed without feedback (timed out, evicted)
        if self.cfg.on_timeout == "drop":
            return "dropped_no_feedback"
        return None if self.scorable_without_feedback else "dropped_unscorable"

    async def _submit(self, segments: list[Any], had_feedback: bool, cause: str) -> None:
        dropped = self._dropped(had_feedback, cause)
        for seg in segments:
            traj = seg.trajectory
            if dropped is not None:
                for task in self._early.pop(traj.group_id, {}).values():
                    task.cancel()
                status = dropped
            else:
                await self._prejudged(traj)
                status = await self._put(traj)
            self._episodes[status if status in self._episodes else
                           {"accepted": "recorded", "no_replay": "not_trained"}.get(status, "shed")] += 1
            if self.record_path is not None:  # what was served, as recorded (before scoring)
                with self.record_path.open("a") as fh:
                    fh.write(json.dumps({"replay": status, "trajectory": traj.model_dump(mode="json")}) + "\n")

    async def _put(self, traj: Trajectory) -> str:
        """Score and put one segment; the replay status (``no_replay``: not trained on)."""
        if self.ports is None:
            return "no_replay"
        try:
            return await self.ports.submit(Group(group_id=traj.group_id, task_id=traj.task_id, trajectories=[traj]))
        except Exception:  # noqa: BLE001 - counted and logged; the other segments still go
            log.exception("gateway: submitting live segment %s failed", traj.group_id)
            return "submit_failed"

    async def drain(self) -> None:
        """Wait for background submissions (tests, shutdown)."""
        while self._pending:
            await asyncio.gather(*list(self._pending), return_exceptions=True)

    def _count(self, result: str) -> None:
        self._episodes[result] += 1

    def _engine_failed(self, exc: EngineUnavailable) -> NoEngine:
        """A request no engine could finish: counted, and the client's error (a 503)."""
        self._count("engine_failed")
        return NoEngine(str(exc), self.cfg.retry_after_s)

    def stats(self) -> dict[str, Any]:
        return {"sessions_open": len(self.recorder._sessions),  # noqa: SLF001 - same package
                "closed": dict(self._closed),
                "episodes": dict(self._episodes), "feedback": dict(self._feedback_counts),
                "recorder": self.recorder.counters, "version": self.engine.version,
                "admission": {"busy": self.admission.busy, "refused": self.admission.refused},
                "engines": self.engine.health()}
