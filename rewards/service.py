"""The reward service's front actor: rollout actors submit groups; it scores and puts them.

Plain Python; ``cluster.reward_service`` wraps it with ``ray.remote`` and hands it ports to a
pool of model scorers, a pool of judges and the replay store. Per submitted group:

1. outcome and MatchTIR matching inline (no model, microseconds);
2. model sources (IG, PRM): the group joins a bounded queue (``service.queue_groups``; a full
   queue makes ``submit`` wait, which is replay-style backpressure). A batcher waits for an idle
   scorer, then takes every queued group up to ``max_batch_trajectories`` trajectories, so
   trajectories of many groups share one batched forward;
3. judge: turns join the judge's own queue only while it holds fewer than ``queue_size``
   turns; otherwise (or after ``timeout_s``) the turn's judgement is missing and flagged, so a
   slow judge costs a group at most ``timeout_s`` and never stalls the scorers;
4. every source's values go into their own slot; failures are ``None`` plus a flag; then the
   group goes to replay through its outlet (``rewards.ports``) and the store's answer is returned.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Any, Protocol

from envs.formats import DEFAULT_FORMAT
from rewards.combine import SourceResult, failed, missing_counts, process_result, write_source
from rewards.config import JudgeConfig, RewardsConfig
from rewards.judge import Judgement
from rewards.ports import PutOutcome, ReplayOutlet
from rewards.inline import inapplicable_sources, score_cheap
from rollout.trajectory import Group, Trajectory


class ScorerPort(Protocol):
    async def score(self, trajs: list[Trajectory]) -> list[dict[str, SourceResult]]: ...


class JudgePort(Protocol):
    async def judge(self, trajs: list[Trajectory], turns: list[list[int] | None] | None = None
                    ) -> list[list[Judgement]]: ...


class LocalScorer:
    """A ``ModelScorer`` in this process, run in a thread so the event loop stays free."""

    def __init__(self, scorer: Any) -> None:
        self.scorer = scorer

    async def score(self, trajs: list[Trajectory]) -> list[dict[str, SourceResult]]:
        return await asyncio.to_thread(self.scorer.score, trajs)


class LocalJudge:
    """A ``JudgeWorker`` in this process, run in a thread."""

    def __init__(self, judge: Any) -> None:
        self.judge_worker = judge

    async def judge(self, trajs: list[Trajectory], turns: list[list[int] | None] | None = None
                    ) -> list[list[Judgement]]:
        return await asyncio.to_thread(self.judge_worker.judge, trajs, turns)


@dataclass
class _JudgeJob:
    """Turns of one trajectory waiting for the judge."""

    traj: Trajectory
    turns: list[int] | None
    """Turn indices to judge; None: all."""
    n: int
    """How many turns (what the judge queue's bound counts)."""
    fut: asyncio.Future


class RewardService:
    """The front: ``submit`` (score, then put) for rollout actors, ``score_group`` (score only)
    for offline use, ``stats`` for the driver and metrics. See the module docstring."""

    def __init__(self, cfg: RewardsConfig, replay: ReplayOutlet | None,
                 scorers: list[ScorerPort] = (), judges: list[JudgePort] = (),
                 chat_format: str = DEFAULT_FORMAT) -> None:
        if (cfg.ig is not None or (cfg.prm is not None and cfg.prm.type == "model")) and not scorers:
            raise ValueError("rewards.ig / rewards.prm need at least one model scorer")
        if isinstance(cfg.prm, JudgeConfig) and not judges:
            raise ValueError("rewards.prm type judge needs at least one judge worker")
        self.cfg, self.replay, self.chat_format = cfg, replay, chat_format
        self.scorers, self.judges = list(scorers), list(judges)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._tasks: list[asyncio.Task] = []
        self._counts: dict[str, Any] = {
            "groups": 0, "trajectories": 0, "outcome_sum": 0.0, "batches": 0,
            "batched_trajectories": 0, "ig_values": 0, "ig_version_mismatch": 0,
            "judge_turns": 0, "judge_early_turns": 0, "judge_queue_full": 0, "judge_timeout": 0, "scorer_errors": 0,
            "score_s": 0.0, "missing": {}, "put": {}, "skipped": {}, "live_put": {}}
        self._judge_queued = 0
        self._judge_inflight = 0
        self._busy_scorers = 0

    # -- lifecycle -----------------------------------------------------------------------
    def _start(self) -> None:
        """Queues and background tasks live on the loop that first calls ``submit``."""
        loop = asyncio.get_running_loop()
        if self._loop is loop:
            return
        self._loop = loop
        self._queue: asyncio.Queue = asyncio.Queue(maxsize=self.cfg.service.queue_groups)
        self._idle: asyncio.Queue = asyncio.Queue()
        for port in self.scorers:
            self._idle.put_nowait(port)
        self._judge_q: asyncio.Queue = asyncio.Queue()
        self._tasks = [loop.create_task(self._batcher())]
        self._tasks += [loop.create_task(self._judge_loop(j)) for j in self.judges]

    async def close(self) -> None:
        """Stop the background tasks (on the loop that started them). A loop stopped with
        them pending leaves coroutines that complain when they are collected."""
        tasks, self._tasks, self._loop = self._tasks, [], None
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    # -- submit --------------------------------------------------------------------------
    async def submit(self, group: Group) -> PutOutcome:
        """Score every trajectory of ``group`` with the configured sources, then put it."""
        self._start()
        await self.score_group(group)
        if self.replay is None:
            raise RuntimeError("this RewardService has no replay; use score_group")
        result = await self.replay.put(group)
        self._counts["put"][result.status] = self._counts["put"].get(result.status, 0) + 1
        return result

    async def submit_live(self, group: Group) -> PutOutcome:
        """A live session's segment: score it with the sources that apply, then offer it to
        replay unscheduled (it holds no producer's reservation) without waiting: a full store
        refuses it at once and the gateway counts it shed."""
        self._start()
        await self.score_group(group)
        if self.replay is None:
            raise RuntimeError("this RewardService has no replay; use score_group")
        result = await self.replay.offer(group)
        self._counts["live_put"][result.status] = self._counts["live_put"].get(result.status, 0) + 1
        return result

    async def score_group(self, group: Group) -> Group:
        """Write every configured source into the group's turns in place (no replay)."""
        self._start()
        t0 = time.perf_counter()
        for traj in group.trajectories:
            score_cheap(traj, self.cfg, self.chat_format)
        model, judged = await asyncio.gather(self._model_scores(group), self._judge_scores(group))
        for i, traj in enumerate(group.trajectories):
            skip = inapplicable_sources(traj, self.cfg)
            for source, res in sorted({**model[i], **judged[i]}.items()):
                if source not in skip:
                    write_source(traj, source, res)
            for source in skip:
                self._counts["skipped"][source] = self._counts["skipped"].get(source, 0) + 1
            if skip:
                traj.skipped_sources = sorted(skip)
            self._count_versions(traj, model[i].get("ig"))
            traj.timings["reward"] = time.perf_counter() - t0
            self._count(traj)
        self._counts["groups"] += 1
        self._counts["score_s"] += time.perf_counter() - t0
        return group

    def _count_versions(self, traj: Trajectory, res: SourceResult | None) -> None:
        if res is None:
            return
        for t, version in res.versions.items():
            self._counts["ig_values"] += 1
            self._counts["ig_version_mismatch"] += traj.turns[t].policy_version != version

    def _count(self, traj: Trajectory) -> None:
        self._counts["trajectories"] += 1
        for turn in traj.turns:  # per-source sums ("<source>_sum"), so means can be graphed
            for source, value in turn.rewards.items():
                if value is not None:
                    key = f"{source}_sum"
                    self._counts[key] = self._counts.get(key, 0.0) + value
        for source, n in missing_counts(traj).items():
            self._counts["missing"][source] = self._counts["missing"].get(source, 0) + n

    # -- model scorers ---------------------------------------------------------------------
    async def _model_scores(self, group: Group) -> list[dict[str, SourceResult]]:
        if not self.scorers:
            return [{} for _ in group.trajectories]
        fut = asyncio.get_running_loop().create_future()
        await self._queue.put((group, fut))  # waits while queue_groups groups are queued
        return await fut

    async def _batcher(self) -> None:
        limit = self.cfg.service.max_batch_trajectories
        carry = None  # a group that did not fit the last batch opens the next one
        while True:
            port = await self._idle.get()  # a busy pool lets groups pile up into one batch
            batch = [carry if carry is not None else await self._queue.get()]
            carry = None
            if self.cfg.service.batch_wait_ms > 0:
                await asyncio.sleep(self.cfg.service.batch_wait_ms / 1000)
            size = len(batch[0][0].trajectories)
            while not self._queue.empty():
                item = self._queue.get_nowait()
                if size + len(item[0].trajectories) > limit:  # groups are never split
                    carry = item
                    break
                batch.append(item)
                size += len(item[0].trajectories)
            asyncio.get_running_loop().create_task(self._run_batch(port, batch))

    async def _run_batch(self, port: ScorerPort, batch: list[tuple[Group, asyncio.Future]]) -> None:
        trajs = [t for group, _ in batch for t in group.trajectories]
        self._busy_scorers += 1
        try:
            results = await port.score(trajs)
        except Exception as exc:  # noqa: BLE001 - a dead scorer leaves the rewards missing
            self._counts["scorer_errors"] += 1
            results = [self._all_failed(t, f"scorer: {type(exc).__name__}: {exc}") for t in trajs]
        finally:
            self._busy_scorers -= 1
            self._idle.put_nowait(port)
        self._counts["batches"] += 1
        self._counts["batched_trajectories"] += len(trajs)
        k = 0
        for group, fut in batch:
            n = len(group.trajectories)
            if not fut.done():
                fut.set_result(results[k: k + n])
            k += n

    def _all_failed(self, traj: Trajectory, error: str) -> dict[str, SourceResult]:
        out = {}
        if self.cfg.ig is not None:
            out["ig"] = failed(range(len(traj.turns) - 1), error)
        if self.cfg.prm is not None and self.cfg.prm.type == "model":
            out["prm"] = failed(range(len(traj.turns)), error)
        return out

    # -- judge -----------------------------------------------------------------------------
    async def judge_early(self, traj: Trajectory, turns: list[int]) -> list[dict[str, Any]]:
        """Judge ``turns`` of a session still in progress, as soon as what followed them has
        arrived (the gateway calls this when a session's next request brings the tool result or
        user reply). Returns one ``{"score", "raw", "error"}`` per turn, which the gateway
        keeps in ``traj.live.prejudged`` so the session is not judged twice at its close."""
        self._start()
        cfg = self.cfg.prm
        if not isinstance(cfg, JudgeConfig):
            raise ValueError("judge_early needs rewards.prm of type judge")
        fut = self._queue_judge(traj, turns)
        if fut is not None:
            await asyncio.wait([fut], timeout=cfg.timeout_s)
            if fut.done():
                self._counts["judge_early_turns"] += len(turns)
        return [j.as_dict() for j in self._judged(fut, len(turns))]

    def _queue_judge(self, traj: Trajectory, turns: list[int] | None) -> asyncio.Future | None:
        """Queue ``turns`` of ``traj`` (None: all) for the judge; None when the queue is full."""
        n = len(traj.turns) if turns is None else len(turns)
        if self._judge_queued + self._judge_inflight + n > self.cfg.prm.queue_size:
            self._counts["judge_queue_full"] += 1
            return None
        fut = asyncio.get_running_loop().create_future()
        self._judge_queued += n
        self._judge_q.put_nowait(_JudgeJob(traj, turns, n, fut))
        return fut

    def _judged(self, fut: asyncio.Future | None, n: int) -> list[Judgement]:
        """The ``n`` judgements of a queued job, or why there are none: the queue was full, or
        the job timed out (cancelled here; the judge loop skips it if it has not started)."""
        if fut is None:
            return [Judgement(None, error="judge_queue_full") for _ in range(n)]
        if not fut.done():
            fut.cancel()
            self._counts["judge_timeout"] += 1
            return [Judgement(None, error="judge_timeout") for _ in range(n)]
        return fut.result()

    async def _judge_scores(self, group: Group) -> list[dict[str, SourceResult]]:
        cfg = self.cfg.prm
        if not isinstance(cfg, JudgeConfig):
            return [{} for _ in group.trajectories]
        futs: list[asyncio.Future | None] = []
        todo: list[list[int]] = []
        for traj in group.trajectories:
            pre = traj.live.prejudged if traj.live is not None else {}
            todo.append([t for t in range(len(traj.turns)) if t not in pre])
            futs.append(self._queue_judge(traj, todo[-1]) if todo[-1] else None)
        live = [f for f in futs if f is not None]
        if live:
            await asyncio.wait(live, timeout=cfg.timeout_s)
        out = []
        for traj, turns, fut in zip(group.trajectories, todo, futs):
            out.append({"prm": self._judge_result(traj, turns, fut, cfg)} if traj.turns else {})
        return out

    def _judge_result(self, traj: Trajectory, turns: list[int], fut: asyncio.Future | None,
                      cfg: JudgeConfig) -> SourceResult:
        """Every turn's judgement: judged early (``prejudged``) or now (``turns``)."""
        pre = traj.live.prejudged if traj.live is not None else {}
        by_turn = {t: Judgement.from_dict(j) for t, j in pre.items()}
        if turns:
            by_turn.update(zip(turns, self._judged(fut, len(turns))))
        judgements = [by_turn[t] for t in range(len(traj.turns))]
        detail = {"judgements": [j.as_dict() for j in judgements]}
        errors = sorted({j.error for j in judgements if j.error})
        return process_result([j.score for j in judgements], cfg, None, detail,
                              "; ".join(errors) or None)

    async def _judge_loop(self, port: JudgePort) -> None:
        limit = self.cfg.prm.batch_size
        while True:
            batch = [await self._judge_q.get()]
            while not self._judge_q.empty() and sum(job.n for job in batch) < limit:
                batch.append(self._judge_q.get_nowait())
            self._judge_queued -= sum(job.n for job in batch)
            live = [job for job in batch if not job.fut.done()]  # timed-out jobs are skipped
            if not live:
                continue
            turns = sum(job.n for job in live)
            self._judge_inflight += turns
            try:
                results = await port.judge([job.traj for job in live], [job.turns for job in live])
            except Exception as exc:  # noqa: BLE001 - every judged turn stays missing
                err = f"judge: {type(exc).__name__}: {exc}"
                results = [[Judgement(None, error=err) for _ in range(job.n)] for job in live]
            finally:
                self._judge_inflight -= turns
            self._counts["judge_turns"] += turns
            for job, res in zip(live, results):
                if not job.fut.done():
                    job.fut.set_result(res)

    # -- metrics ---------------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        """Counters plus queue depths: ``queue_groups`` waiting for model scoring,
        ``judge_queue_turns`` waiting for the judge, ``judge_inflight_turns`` being judged.
        ``<source>_sum`` is the sum of the values a source gave; ``missing`` counts its Nones;
        ``judge_queue_full`` and ``judge_timeout`` count trajectories whose turns went unjudged."""
        c = self._counts
        started = self._loop is not None
        return {**{k: (dict(v) if isinstance(v, dict) else v) for k, v in c.items()},
                "queue_groups": self._queue.qsize() if started else 0,
                "judge_queue_turns": self._judge_queued,
                "judge_inflight_turns": self._judge_inflight,
                "busy_scorers": self._busy_scorers,
                "idle_scorers": len(self.scorers) - self._busy_scorers,
                "mean_batch_trajectories": c["batched_trajectories"] / max(c["batches"], 1)}
