"""The learner's ranks on Ray: one actor per rank, in a placement group when there are
several, and the calls the driver makes on all of them at once.

Rank 0 alone claims, acknowledges, publishes and commits (``learner/worker.py``); the driver
still calls every rank's ``train_step`` and ``save_checkpoint``, because each is a collective
that every rank must enter.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

from learner.config import LearnerConfig

if TYPE_CHECKING:  # its module loads torch: every actor that unpickles a cluster.actors helper would too
    from learner.deepspeed_setup import DistSpec


_PLACEMENT_WAIT_S = 300.0
"""How long the ranks' bundles may take to fit (an autoscaling cluster adds nodes meanwhile)."""


class LearnerGroup:
    """Handles of the ranks (rank 0 first) and the placement group that holds them."""

    def __init__(self, ranks: list[Any], placement_group: Any = None) -> None:
        self.ranks, self.placement_group = ranks, placement_group

    @property
    def leader(self) -> Any:
        """Rank 0: the one that talks to replay and the weight sync."""
        return self.ranks[0]

    def call(self, method: str, *args: Any) -> list[Any]:
        """``method`` on every rank; one object ref per rank, rank 0's first."""
        return [getattr(rank, method).remote(*args) for rank in self.ranks]

    def get(self, method: str, *args: Any) -> Any:
        """Rank 0's result of ``method`` called on every rank (any rank's error raises)."""
        import ray

        return ray.get(self.call(method, *args))[0]

    def interrupt(self) -> None:
        """Make a step waiting for a batch give up (rank 0 waits; it tells the others)."""
        self.leader.interrupt.options(concurrency_group="control").remote()

    def release(self) -> None:
        """Kill the ranks and free their placement group."""
        import ray

        for rank in self.ranks:
            ray.kill(rank)
        if self.placement_group is not None:
            ray.util.remove_placement_group(self.placement_group)


def start_learner(cfg: LearnerConfig, actor_cls: Any, make: Callable[[DistSpec | None], tuple[tuple, dict]]
                  ) -> LearnerGroup:
    """``learner.world_size`` actors of ``actor_cls`` (a ``ray.remote`` class), each built from
    ``make(dist)``'s positional and keyword arguments. One rank runs without a placement group;
    several get one bundle each (``num_cpus``, ``num_gpus``) under ``learner.placement``."""
    import ray
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    resources = {"num_cpus": cfg.num_cpus, "num_gpus": cfg.num_gpus, "resources": cfg.resources}
    if cfg.world_size == 1:
        args, kwargs = make(None)
        return LearnerGroup([actor_cls.options(**resources).remote(*args, **kwargs)])
    bundle = {"CPU": cfg.num_cpus, **({"GPU": cfg.num_gpus} if cfg.num_gpus else {}), **cfg.resources}
    pg = ray.util.placement_group([dict(bundle) for _ in range(cfg.world_size)], strategy=cfg.placement)
    ready, _ = ray.wait([pg.ready()], timeout=_PLACEMENT_WAIT_S)
    if not ready:
        ray.util.remove_placement_group(pg)
        raise RuntimeError(
            f"no room for the learner's {cfg.world_size} ranks ({bundle} each, strategy "
            f"learner.placement={cfg.placement}) after {_PLACEMENT_WAIT_S:.0f}s: lower learner.world_size, "
            "learner.num_cpus or learner.num_gpus, relax learner.placement, or add nodes")
    at = [PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=i) for i in range(cfg.world_size)]
    addr, port = ray.get(ray.remote(_rendezvous).options(num_cpus=0, scheduling_strategy=at[0]).remote())
    from learner.deepspeed_setup import DistSpec

    ranks = []
    for rank in range(cfg.world_size):
        args, kwargs = make(DistSpec(rank, cfg.world_size, addr, port))
        ranks.append(actor_cls.options(**resources, scheduling_strategy=at[rank]).remote(*args, **kwargs))
    return LearnerGroup(ranks, pg)


def _rendezvous() -> tuple[str, int]:
    """Rank 0's node address and a port free there (run inside rank 0's bundle)."""
    import ray

    from learner.deepspeed_setup import free_port

    return ray.util.get_node_ip_address(), free_port("")
