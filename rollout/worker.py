"""The rollout worker: many concurrent episodes on the engine service, complete groups handed on.

Plain Python; the driver wraps it with ``ray.remote``. It holds an engine client (the run's
engine group, shared with the live gateway; or an in-process engine in tests); the learner's
weight sync pushes new weights to the engines, and replay admits groups for a version only once
the engines serve it, so nothing here touches weights. In async mode ``run()`` loops until
stopped: it asks replay for admission, starts groups and submits finished ones, never waiting
for the learner. ``collect()`` is the sync-mode counterpart and ``evaluate()`` scores held-out
tasks, both with the weights the engines serve (the driver settles the weight sync first).
"""

from __future__ import annotations

import asyncio
import random
import uuid
from typing import Any

from envs.base import Task
from envs.registry import make_task_source
from rollout import chat
from rollout.config import RolloutConfig
from rollout.engines.base import SamplingParams
from rollout.engines.client import EngineClient
from rollout.episode import run_episode, sampling_params
from rollout.ports import RolloutPorts, SubmitLost
from rollout.remote_env import EnvHostPort, HostPicker
from rollout.trajectory import Group

ADMISSION_WAIT_S = 1.0
"""Longest one admission request waits in replay for room before it is asked again (it holds
one of the replay host's threads meanwhile; ``stop()`` waits for at most this)."""

class RolloutWorker:
    def __init__(self, worker_id: int, cfg: RolloutConfig, env_cfg: Any, engine: EngineClient,
                 seed: int, ports: RolloutPorts, env_hosts: list[EnvHostPort] | None = None) -> None:
        import torch

        torch.set_num_threads(cfg.torch_threads)
        self.worker_id, self.cfg, self.ports = worker_id, cfg, ports
        self.source = make_task_source(env_cfg)
        # Episodes run here, or in environment actors when the run configures them.
        self._envs = HostPicker(env_hosts) if env_hosts else self.source
        self.engine = engine
        if getattr(env_cfg, "max_turns", 2) > 1:  # refused here, at start, not episode by episode
            chat.check_template(engine.tokenizer, cfg.chat_format)
        self._train = self.source.tasks("train")
        self._rng = random.Random(seed * 7919 + worker_id)
        self._stop = asyncio.Event()
        self._counts = {"groups": 0, "episodes": 0, "errors": 0, "tokens": 0, "successes": 0, "dropped": 0}
        """``dropped``: finished groups lost with a reward service that died holding them."""
        self._failed_in_a_row = 0

    def _params(self, temperature: float | None = None) -> SamplingParams:
        return sampling_params(self.cfg, temperature)

    async def run_group(self, task: Task, n: int, params: SamplingParams, count: bool = True) -> Group:
        """G rollouts of one task, concurrently (their turns share engine batches)."""
        gid = f"{task.task_id}:{uuid.uuid4().hex[:12]}"
        trajs = await asyncio.gather(*[
            run_episode(self.engine, self._envs.make_env(), task, params, group_id=gid,
                        max_context_tokens=self.cfg.max_context_tokens,
                        history_turns=self.cfg.history_turns, chat_format=self.cfg.chat_format)
            for _ in range(n)
        ])
        for traj in trajs:
            if self.source.scores_outcome and traj.error is None:  # the environment grades episodes
                traj.env_outcome = sum(t.rewards.get("env") or 0.0 for t in traj.turns)
                traj.success = traj.env_outcome >= self.source.success_at
            else:
                traj.success = traj.error is None and self.source.success(task, traj.answer)
            traj.worker = self.worker_id
            # Replay's reservation ledger reads it (None: ports that name no producer).
            traj.producer = getattr(self.ports, "producer", None) or None
        if count:
            self._count(trajs)
        return Group(group_id=gid, task_id=task.task_id, trajectories=list(trajs))

    def _count(self, trajs: list) -> None:
        for traj in trajs:
            self._counts["episodes"] += 1
            self._counts["errors"] += traj.error is not None
            self._counts["successes"] += traj.success
            self._counts["tokens"] += traj.num_action_tokens()
        self._counts["groups"] += 1

    async def _produce_one(self) -> None:
        task = self._rng.choice(self._train)
        try:
            group = await self.run_group(task, self.cfg.group_size, self._params())
        except BaseException:
            await self.ports.release(1)
            raise
        await self._back_off_if_all_failed(group)
        try:
            await self.ports.submit(group)
        except SubmitLost:
            # The group never reached replay (its put would have taken the reservation), and
            # the reward service restarts: count it, free the slot, keep producing.
            self._counts["dropped"] += 1
            await self.ports.release(1)

    async def _back_off_if_all_failed(self, group: Group) -> None:
        """After a group whose every episode failed (its engine or environments are down, e.g.
        restarting), wait before the next one: 0.25 s doubling to 4 s while it lasts, so a dead
        dependency is not hammered with groups that fail at once. One good group resets it."""
        if all(t.error is not None for t in group.trajectories):
            self._failed_in_a_row += 1
            await asyncio.sleep(min(4.0, 0.25 * 2 ** (self._failed_in_a_row - 1)))
        else:
            self._failed_in_a_row = 0

    async def run(self) -> dict[str, int]:
        """Produce groups until ``stop()``; re-raises the first failure of a group task.
        Admission is never polled: one request waits in replay for room (``ADMISSION_WAIT_S`` at
        a time; an ack, a put or a release wakes it) beside the running groups, so a continuous
        producer tops up the moment a slot frees and a waves producer asks only once its last
        wave has ended."""
        self._stop.clear()
        active: set[asyncio.Task] = set()
        asking: asyncio.Task | None = None
        stopping = asyncio.create_task(self._stop.wait())
        waves = self.cfg.admission == "waves"
        try:
            while not self._stop.is_set():
                want = self.cfg.groups_in_flight - len(active)
                if asking is None and want > 0 and not (waves and active):
                    asking = asyncio.create_task(self.ports.reserve(want, ADMISSION_WAIT_S))
                waiting = {*active, stopping, *([asking] if asking is not None else [])}
                done, _ = await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
                if asking in done:
                    active |= {asyncio.create_task(self._produce_one()) for _ in range(asking.result())}
                    asking = None
                for fut in done & active:
                    active.discard(fut)
                    fut.result()
        finally:
            stopping.cancel()
            await self._end_run(asking, active)
        return dict(self._counts)

    async def _end_run(self, asking: asyncio.Task | None, active: set[asyncio.Task]) -> None:
        """Cancel the groups still running (each releases its reservation) and give back what
        an admission request still waiting is granted, so no reservation outlives the loop."""
        for fut in active:
            fut.cancel()
        if active:
            await asyncio.gather(*active, return_exceptions=True)
        if asking is not None:
            try:
                granted = await asking
            except Exception:  # noqa: BLE001 - replay itself failing: nothing was granted to give back
                return
            if granted:
                await self.ports.release(granted)

    async def collect(self, n_groups: int) -> int:
        """Sync mode: generate and submit ``n_groups`` with the weights the engines serve (the
        learner's newest: the driver settles the weight sync first); returns count."""
        granted = await self.ports.reserve(n_groups)
        await asyncio.gather(*[self._produce_one() for _ in range(granted)])
        return granted

    async def evaluate(self, tasks: list[Task], samples: int, temperature: float) -> list[dict[str, Any]]:
        """Success per task (mean over ``samples``) with the weights the engines serve."""
        params = self._params(temperature)
        return list(await asyncio.gather(*[self.score_task(t, samples, params) for t in tasks]))

    async def score_task(self, task: Task, samples: int, params: SamplingParams) -> dict[str, Any]:
        """One task's ``samples`` episodes with the weights serving now: mean success and
        turns, each sample's success, and the environment's own metrics averaged."""
        group = await self.run_group(task, samples, params, count=False)
        per_episode = [
            {**self.source.episode_metrics(task, t.answer, [c for turn in t.turns for c in turn.tool_calls],
                                           t.labels or []), **t.metadata.get("env_metrics", {})}
            for t in group.trajectories
        ]
        metrics: dict[str, float] = {}
        for name in sorted({k for m in per_episode for k in m}):
            values = [m[name] for m in per_episode if name in m]  # e.g. label rates need labels
            metrics[name] = sum(values) / len(values)
        return {"task_id": task.task_id, "success": sum(t.success for t in group.trajectories) / samples,
                "turns": sum(len(t.turns) for t in group.trajectories) / samples,
                "version": group.min_version(), "samples": [float(t.success) for t in group.trajectories],
                "metrics": metrics}

    def stop(self) -> None:
        self._stop.set()

    def stats(self) -> dict[str, float]:
        return {**self._counts, "version": self.engine.version}
