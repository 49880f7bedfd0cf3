"""Placing the live gateway on Ray: an actor serving the run's OpenAI-compatible endpoint.

The gateway is a client of the run's engine group (the same engines the rollout workers use)
and hands closed sessions to the reward actor, which puts them into replay unscheduled. Its
base URL is printed and written to ``<run_dir>/live.json``, where the run service reads it;
every closed session's segments are appended to ``<run_dir>/live_sessions.jsonl``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from cluster.config import RunConfig
from envs.formats import DEFAULT_FORMAT

LIVE_FILE = "live.json"
SESSIONS_FILE = "live_sessions.jsonl"


class ActorLivePorts:
    """The reward and replay actors as the gateway's ``LivePorts``."""

    def __init__(self, reward: Any, replay: Any) -> None:
        self.reward, self.replay = reward, replay

    async def submit(self, group: Any) -> str:
        return (await self.reward.submit_live.remote(group)).status

    async def live_room(self) -> int:
        return await self.replay.live_room.remote()

    async def judge_early(self, traj: Any, turns: list[int]) -> list[dict[str, Any]]:
        return await self.reward.judge_early.remote(traj, turns)


class LocalLivePorts:
    """An in-process reward service and replay store as the gateway's ``LivePorts`` (benches,
    tests, embedding the gateway without Ray)."""

    def __init__(self, reward: Any, store: Any) -> None:
        self.reward, self.store = reward, store

    async def submit(self, group: Any) -> str:
        return (await self.reward.submit_live(group)).status

    async def live_room(self) -> int:
        return self.store.live_room()

    async def judge_early(self, traj: Any, turns: list[int]) -> list[dict[str, Any]]:
        return await self.reward.judge_early(traj, turns)

    async def close(self) -> None:
        """Stop the reward service's background tasks (on the loop that runs them)."""
        await self.reward.close()


def local_reward_service(store: Any, rewards_cfg: Any = None, judges: list[Any] = (),
                         chat_format: str = DEFAULT_FORMAT) -> Any:
    """A ``RewardService`` (no model scorers; ``judges``: ``LocalJudge`` ports) that puts into
    the in-process ``store``; ``chat_format``: the policy's (``rollout.chat_format``)."""
    from replay.client import StoreOutlet
    from replay.config import ReplayConfig
    from rewards.config import RewardsConfig
    from rewards.service import RewardService

    async def put_many(groups: list[Any], scheduled: bool = True) -> list[Any]:
        return store.put_many(groups, scheduled)

    return RewardService(rewards_cfg or RewardsConfig(), StoreOutlet(put_many, ReplayConfig()), judges=list(judges),
                         chat_format=chat_format)


def scorable_without_feedback(cfg: RunConfig) -> bool:
    """A session that never gets feedback can still be scored when a PRM or judge runs."""
    return cfg.rewards.prm is not None


def judges_early(cfg: RunConfig) -> bool:
    """A hindsight judge scores each live turn as soon as what followed it arrives."""
    return cfg.rewards.prm is not None and cfg.rewards.prm.type == "judge" and cfg.rewards.prm.hindsight


def served_model(cfg: RunConfig) -> str:
    """The OpenAI ``model`` the run's endpoint serves: on a shared engine pool, the run's
    adapter, named as its tenant knows the run (``name``: the run id the run service shows), so
    a request naming another run's adapter is a 404 here; otherwise ``live.model_name``."""
    return cfg.name if cfg.rollout.pool is not None else cfg.live.model_name


def start_gateway(cfg: RunConfig, engine_client: Any, reward: Any, replay: Any, run_dir: str,
                  run_id: str) -> tuple[Any, str]:
    """Start the gateway actor; returns (handle, base URL)."""
    import ray

    from gateway.server import LiveGateway

    # Not telemetry.instrument-ed: the gateway serves its own /metrics (it has histograms).
    # A run that trains on rollouts only serves and records sessions but never fills replay.
    ports = ActorLivePorts(reward, replay) if cfg.train.source != "rollout" else None
    live = cfg.live.model_copy(update={"model_name": served_model(cfg)})
    actor = ray.remote(LiveGateway).options(num_cpus=cfg.live.num_cpus, max_concurrency=10_000,
                                                 resources=cfg.cluster.service_resources).remote(
        live, engine_client, ports, scorable_without_feedback(cfg), run_id,
        str(Path(run_dir) / SESSIONS_FILE), judges_early(cfg), cfg.rollout.chat_format)
    url = ray.get(actor.start.remote())
    (Path(run_dir) / LIVE_FILE).write_text(json.dumps({"base_url": url, "model": live.model_name}))
    return actor, url
