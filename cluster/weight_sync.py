"""The run's weight sync on Ray: the ``learner.weights.WeightSync`` actor, the adapters that
turn engine, scorer and replay actors into its plain ports, and the start step that forms the
weight broadcast group.

The learner publishes each new version to the sync, which pushes it to every model scorer and
engine and then acknowledges the batch to replay (docs/engines.md, "Weight sync").
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from cluster.config import RunConfig
from rollout.engines.base import AdapterSpec

if TYPE_CHECKING:
    from cluster.actors import RunActors

_log = logging.getLogger(__name__)


def weight_sync_name(run_id: str) -> str:
    """The weight sync's Ray actor name (restarted engines find it by name)."""
    return f"weights-{run_id}"


def run_adapter(cfg: RunConfig, run_id: str) -> AdapterSpec | None:
    """The adapter a LoRA run publishes (``learner.lora.publish: adapter``), named for the run:
    what its engines load each version of and every request of the run names. None when the
    run publishes whole weights."""
    lora = cfg.learner.lora
    if lora is None or lora.publish != "adapter":
        return None
    return AdapterSpec(name=run_id, scale=lora.alpha / lora.rank)


class ActorWeightTarget:
    """An engine or model scorer actor as a ``learner.weights.WeightTarget``. A process that
    died takes no version (None) when Ray restarts it (``restarted``): it catches up before it
    serves (an engine from the sync; a scorer at the next version). Without restarts (engines
    on the broadcast transport) the push fails, and the driver names the dead engine."""

    def __init__(self, handle: Any, restarted: bool, adapter: AdapterSpec | None = None) -> None:
        self.handle, self.restarted, self.adapter = handle, restarted, adapter

    async def update_weights(self, version: int, handle: Any) -> int | None:
        """``version`` into the actor: whole weights, or a version of the run's adapter
        (``adapter``) that the engine serves beside the others it holds."""
        import ray

        try:
            if self.adapter is not None:  # an engine's one verb for both (``EngineServer.load``)
                return await self.handle.load.remote(version, handle, self.adapter)
            return await self.handle.update_weights.remote(version, handle)
        except ray.exceptions.RayActorError as exc:
            if not self.restarted:
                raise
            _log.warning("weight sync: an actor died before it served version %d (%s); it catches up "
                         "when Ray starts it again", version, type(exc).__name__)
            return None


class ActorReplayAck:
    """The replay host as the weight sync's ``learner.weights.ReplayAck``."""

    def __init__(self, replay: Any) -> None:
        self.replay = replay

    async def ack(self, claim_id: str, version: int, commit: bool) -> None:
        await self.replay.ack.remote(claim_id, version, commit)


def start_weight_sync(cfg: RunConfig, run_id: str, engines: list[Any], scorers: list[Any], replay: Any) -> Any:
    """The run's weight sync actor (restartable like replay's host; a named async actor)."""
    import ray

    from cluster.actors import service_restarts
    from learner.weights import WeightSync

    engine_restarts = cfg.rollout.weights.transport != "broadcast" and cfg.rollout.engine.max_restarts > 0
    adapter = run_adapter(cfg, run_id)
    return ray.remote(WeightSync).options(
        num_cpus=0, resources=cfg.cluster.service_resources, name=weight_sync_name(run_id),
        **service_restarts(cfg)).remote([ActorWeightTarget(e, engine_restarts, adapter) for e in engines],
                                        [ActorWeightTarget(s, True) for s in scorers], ActorReplayAck(replay))


def form_weight_group(actors: "RunActors") -> None:
    """``rollout.weights.transport: broadcast``: learner rank 0 and every engine join the
    weight broadcast group together, once, before any version is sent (after an in-job
    learner restart too: the new rank 0 starts a new group). Nothing on other transports."""
    import ray

    init = ray.get(actors.learner.leader.weight_group.remote())
    if init is None:
        return
    ray.get([actors.learner.leader.join_weight_group.remote(),
             *[e.join_weight_group.remote({**init, "rank": i + 1}) for i, e in enumerate(actors.engines)]])
