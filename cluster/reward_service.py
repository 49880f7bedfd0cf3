"""Placing the reward/judge service on Ray: a front actor, a scorer pool and a judge pool.

Layout (resources from ``cluster.reward_num_cpus`` and ``rewards.service``):

- front: ``rewards.service.RewardService``, the handle rollout actors call
  (``submit.remote(group) -> PutResult``, ``stats.remote() -> dict``); async, so many groups
  are in flight at once while it batches them;
- ``rewards.service.num_scorers`` x ``rewards.scorer.ModelScorer`` (only when IG or a PRM
  model is configured): each holds the policy copy for IG, to which the learner's weight sync
  pushes every new version, and/or the PRM;
- ``rewards.prm.num_workers`` x ``rewards.judge.JudgeWorker`` (only for a judge).

The adapters below turn actor handles into the plain ports the worker classes take, so the
classes never import Ray and run in-process in unit tests.
"""

from __future__ import annotations

from typing import Any

from cluster.config import RunConfig
from replay.client import StoreOutlet
from replay.record import GroupRecord


class ReplayPut:
    """``await put_many(groups, scheduled)`` on the replay actor, the groups encoded here
    first: Ray then carries their records' bytes, and the replay actor stores them as they are
    (replay/record.py), instead of pickling and unpickling every model and encoding it there."""

    def __init__(self, replay: Any) -> None:
        self.replay = replay

    async def __call__(self, groups: list[Any], scheduled: bool = True) -> list[Any]:
        return await self.replay.put_many.remote([GroupRecord.of(g) for g in groups], scheduled)


class ActorScorer:
    def __init__(self, handle: Any) -> None:
        self.handle = handle

    async def score(self, trajs: list[Any]) -> list[dict[str, Any]]:
        return await self.handle.score.remote(trajs)


class ActorJudge:
    def __init__(self, handle: Any) -> None:
        self.handle = handle

    async def judge(self, trajs: list[Any], turns: list[list[int] | None] | None = None) -> list[list[Any]]:
        return await self.handle.judge.remote(trajs, turns)


def reward_pools(cfg: RunConfig) -> tuple[int, int]:
    """(model scorer actors, judge actors) the reward service starts for ``cfg``: scorers when
    IG is scored by a model scorer (not ``rewards.ig.scorer: engine``) or the PRM is a model,
    judges when the PRM is a judge."""
    rc = cfg.rewards
    ig_on_scorers = rc.ig is not None and rc.ig.scorer != "engine"
    need_scorers = ig_on_scorers or (rc.prm is not None and rc.prm.type == "model")
    need_judges = rc.prm is not None and rc.prm.type == "judge"
    return (rc.service.num_scorers if need_scorers else 0,
            rc.prm.num_workers if need_judges and rc.prm is not None else 0)


def check_cpus(cfg: RunConfig, n_scorers: int, n_judges: int) -> None:
    """Fail, naming the keys, when the run's actors with the scorer and judge pools cannot fit:
    an actor that never fits would leave the run waiting forever."""
    import ray

    from cluster.actors import run_cpus

    rc = cfg.rewards.service
    need = run_cpus(cfg) + n_scorers * rc.scorer_num_cpus + n_judges * rc.judge_num_cpus
    have = ray.cluster_resources().get("CPU", 0)
    if need > have + 1e-9:
        raise RuntimeError(
            f"the run needs {need:g} Ray CPUs with {n_scorers} reward scorer(s) and {n_judges} "
            f"judge(s) but the cluster has {have:g}; lower rewards.service.scorer_num_cpus / "
            "judge_num_cpus / num_scorers (fractions are fine) or add nodes")


def start_scorers(cfg: RunConfig, policy_path: str) -> list[Any]:
    """The model scorer pool (none unless ``reward_pools`` says so): the reward service scores
    through them and the weight sync pushes new weights to them."""
    import ray

    from rewards.scorer import ModelScorer

    n_scorers, n_judges = reward_pools(cfg)
    if not n_scorers:
        return []
    check_cpus(cfg, n_scorers, n_judges)
    sc = cfg.rewards.service
    # A crashed scorer comes back (its in-flight batch is flagged missing meanwhile), holding
    # its starting weights until the weight sync pushes the next version.
    actor = ray.remote(ModelScorer).options(num_cpus=sc.scorer_num_cpus, max_restarts=2,
                                             resources=cfg.cluster.service_resources)
    return [actor.remote(scorer_rewards(cfg), policy_path, torch_threads=sc.torch_threads) for _ in range(n_scorers)]


def scorer_rewards(cfg: RunConfig) -> Any:
    """What the model scorers score: with ``rewards.ig.scorer: engine`` only the PRM."""
    rc = cfg.rewards
    return rc.model_copy(update={"ig": None}) if rc.ig is not None and rc.ig.scorer == "engine" else rc


def start_reward_service(cfg: RunConfig, replay: Any, policy_path: str, engines: Any = None,
                         scorers: list[Any] | None = None) -> Any:
    """Returns the front handle: ``submit.remote(group)`` scores a group and puts it into
    replay (returning the ``PutResult``); ``stats.remote()`` returns counters and queue depths.
    ``engines``: the run's engine client, for ``rewards.ig.scorer: engine``; ``scorers``: the
    model scorer pool (``start_scorers``; started here when None)."""
    import ray

    from rewards.judge import JudgeWorker
    from rewards.service import RewardService
    from cluster.telemetry import instrument

    rc, sc = cfg.rewards, cfg.rewards.service
    ig_on_engines = rc.ig is not None and rc.ig.scorer == "engine"
    n_scorers, n_judges = reward_pools(cfg)
    check_cpus(cfg, n_scorers, n_judges)
    scorers = start_scorers(cfg, policy_path) if scorers is None else scorers
    judges = []
    if n_judges:
        actor = ray.remote(JudgeWorker).options(num_cpus=sc.judge_num_cpus, max_restarts=2,
                                                 resources=cfg.cluster.service_resources)
        judges = [actor.remote(rc.prm, policy_path, torch_threads=sc.torch_threads,
                               chat_format=cfg.rollout.chat_format)
                  for _ in range(n_judges)]
    # Surface a bad PRM/judge path here rather than as missing rewards in every group.
    ray.get([a.__ray_ready__.remote() for a in scorers + judges])
    ports: list[Any] = [ActorScorer(a) for a in scorers]
    if ig_on_engines:
        ports = engine_ig_ports(cfg, engines, ports)
    # A killed front comes back with the same scorers and replay; groups it held are dropped
    # and counted by their producers (rollout.ports.SubmitLost).
    return ray.remote(instrument(RewardService, "reward")).options(
        num_cpus=cfg.cluster.reward_num_cpus, max_concurrency=1000, max_restarts=-1,
        resources=cfg.cluster.service_resources,
    ).remote(cfg.rewards, StoreOutlet(ReplayPut(replay), cfg.replay), ports, [ActorJudge(a) for a in judges],
              cfg.rollout.chat_format)


def engine_ig_ports(cfg: RunConfig, engines: Any, model_ports: list[Any]) -> list[Any]:
    """Scorer ports that read IG from the engine group (each merged with a model scorer's PRM
    results when there are model scorers)."""
    from rewards.ig_engine import EngineIGScorer, EngineScorerPort

    if engines is None:
        raise ValueError("rewards.ig.scorer: engine needs the run's engines (start them before the reward service)")
    scorer = EngineIGScorer(engines, engines.tokenizer, cfg.rewards.ig)
    return [EngineScorerPort(scorer, port) for port in model_ports] or [EngineScorerPort(scorer)]
