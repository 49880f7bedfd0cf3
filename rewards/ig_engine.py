"""IG scored by the rollout engines: gold-answer log-probs read as prompt log-probs.

The model-copy scorer (``rewards.ig_scorer.IGScorer``) keeps its own copy of the policy and
loads every published version into it. This one asks the engines that sampled the rollouts:
each boundary row (context + answer template, the same rows ``IGScorer`` builds) is one
prompt-log-prob request, and the row's value is the mean log-prob of its gold tokens, asked
from the first gold token on. The rows of a trajectory go to the engine that generated it (its
session), whose prefix cache may still hold the context (the HF engine's until the weights
change, vLLM's while its blocks last): then a row costs a prefill of its answer template only.
The values are those of the weights the engine serves when it scores, recorded as the result's
version.
"""

from __future__ import annotations

import asyncio
from typing import Any, Sequence

from rewards.combine import SourceResult, failed, ig_gold, ig_without_gold
from rewards.config import IGConfig
from rewards.ig import IGResult
from rewards.ig_scorer import IGRows, _Row
from rewards.scorer import ig_source_result
from rollout.trajectory import Trajectory


class EngineIGScorer(IGRows):
    """IG through an ``EngineClient`` (``prompt_logprobs``); ``concurrency`` rows in flight."""

    def __init__(self, client: Any, tokenizer: Any, cfg: IGConfig, concurrency: int = 32) -> None:
        super().__init__(tokenizer, cfg)
        self.client, self.concurrency = client, concurrency

    async def score(self, trajectories: Sequence[Trajectory]) -> list[IGResult]:
        """IG for every trajectory. A trajectory whose rows were scored by two versions (an
        update landed meanwhile) records the older one."""
        rows = self.rows(trajectories)
        gate = asyncio.Semaphore(self.concurrency)

        async def one(row: _Row) -> tuple[int, float]:
            first = min(row.predict_at) + 1  # the first gold token: nothing before it is needed
            async with gate:
                # The rollout's session: the engine that generated the context, which may
                # still hold its KV (the HF engine's prefix cache, vLLM's)
                session = trajectories[row.traj].trajectory_id
                version, lps = await self.client.prompt_logprobs(row.ids, session_id=session, first=first)
            gold = [lps[p + 1 - first] for p in row.predict_at]  # lps[j] scores token first + j
            return version, sum(gold) / len(gold)

        async def in_order(mine: list[_Row]) -> list[tuple[int, float]]:
            # A trajectory's boundaries one after another, shortest context first: each
            # extends the one before, so an engine with a prefix cache computes every context
            # token once even when it no longer holds the rollout's (new weights since)
            return [await one(r) for r in mine]

        by_traj: dict[int, list[_Row]] = {}
        for r in sorted(rows, key=lambda r: (r.traj, r.boundary)):
            by_traj.setdefault(r.traj, []).append(r)
        rows = [r for mine in by_traj.values() for r in mine]
        scored = [s for done in await asyncio.gather(*map(in_order, by_traj.values())) for s in done]
        values = {(r.traj, r.boundary): v for r, (_, v) in zip(rows, scored)}
        versions: dict[int, int] = {}
        for r, (version, _) in zip(rows, scored):
            versions[r.traj] = min(version, versions.get(r.traj, version))
        return self.results(trajectories, values, [versions.get(i, 0) for i in range(len(trajectories))])


class EngineScorerPort:
    """The reward service's scorer port for ``rewards.ig.scorer: engine``: IG through the
    engines, merged with what ``others`` (model scorers for a PRM, if any) return."""

    def __init__(self, scorer: EngineIGScorer, others: Any = None) -> None:
        self.scorer, self.others = scorer, others

    async def score(self, trajs: list[Trajectory]) -> list[dict[str, SourceResult]]:
        async def ig() -> list[dict[str, SourceResult]]:
            out: list[dict[str, SourceResult]] = [{} for _ in trajs]
            ok = [i for i, t in enumerate(trajs) if ig_gold(t) is not None]
            for i in set(range(len(trajs))) - set(ok):
                out[i]["ig"] = ig_without_gold(trajs[i])
            try:
                results = await self.scorer.score([trajs[i] for i in ok])
            except Exception as exc:  # noqa: BLE001 - an engine failure leaves IG missing, flagged
                results = None
                for i in ok:
                    out[i]["ig"] = failed(range(len(trajs[i].turns) - 1), f"IG engine: {type(exc).__name__}: {exc}")
            for i, res in zip(ok, results or []):
                out[i]["ig"] = ig_source_result(res)
            return out

        mine, theirs = await asyncio.gather(ig(), self._others(trajs))
        return [{**b, **a} for a, b in zip(mine, theirs)]

    async def _others(self, trajs: list[Trajectory]) -> list[dict[str, SourceResult]]:
        if self.others is None:
            return [{} for _ in trajs]
        return await self.others.score(trajs)
