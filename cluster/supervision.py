"""Supervision of a run's training steps: each learner step is watched together with the
rollout actors and the services (``cluster.survival``: ``watch``, ``Vigils``,
``RolloutReviver``), a dead learner is restarted inside the run from its last checkpoint
(``learner.max_restarts`` times), and a resumed run's replay store is lined up with the
checkpoint the learner resumed from.

The driver (``cluster/driver.py``) builds one ``Supervisor`` per training loop and asks it
for each step's metrics; what a run survives, and how a death is named, is
``cluster/survival.py``.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Callable, TypeVar

from cluster.config import RunConfig
from cluster.survival import LearnerDied, RolloutReviver, Vigils, name_engine_death, watch

T = TypeVar("T")


class Supervisor:
    """Watches the learner's steps, the rollout actors and the services of one training loop;
    restarts a learner that died."""

    def __init__(self, cfg: RunConfig, actors: Any, rollout_refs: list[Any], monitor: Any,
                 on_stage: Callable[[str], None]) -> None:
        """``rollout_refs``: the async rollout loops' ``run`` calls (empty when none run);
        ``monitor``: the run's progress, rewound when a learner restarts from a checkpoint."""
        self.cfg, self.actors, self.monitor, self.on_stage = cfg, actors, monitor, on_stage
        self.rollout_refs = rollout_refs
        self.revive = RolloutReviver(cfg, actors, rollout_refs, on_stage)
        """Restarts dead rollout actors; ``revive.lost`` counts the groups they took with them."""
        self.vigils = Vigils(cfg, actors, on_stage)
        self.restarts = 0
        self.restarted_at = 0
        """After ``train_step`` returned None: the checkpoint step the new learner resumed from."""

    def train_step(self) -> dict[str, float] | None:
        """One learner step's metrics, or None when the learner died and was restarted from
        its last checkpoint (at step ``restarted_at``). An error the learner raised is
        re-raised, naming the engine whose death caused it where one did."""
        import ray

        try:
            return watch(self.actors.learner.call("train_step"), self.rollout_refs, self.actors,
                         self.revive, self.vigils)
        except ray.exceptions.RayTaskError as exc:  # the learner raised: say if an engine died under it
            if (died := name_engine_death(self.cfg, self.actors, exc)) is None:
                raise
            raise died from exc
        except LearnerDied as exc:
            if self.restarts == self.cfg.learner.max_restarts:
                raise RuntimeError(f"{exc}; learner.max_restarts={self.restarts} restarts used up") from exc
            self.restarts += 1
            self.restarted_at = restart_learner(self.cfg, self.actors, self.monitor, str(exc), self.on_stage)
            return None

    def rates(self, last: dict[str, Any]) -> dict[str, float]:
        """The step's rates (``cluster.rates.step_rates``)."""
        from cluster.rates import step_rates

        return self._asking(step_rates, last)

    def mark(self, last: dict[str, Any]) -> None:
        """Start the next step's counting now (``cluster.rates.mark``)."""
        from cluster.rates import mark

        self._asking(mark, last)

    def _asking(self, ask: Callable[[Any, dict[str, Any]], T], last: dict[str, Any]) -> T:
        """``ask(actors, last)``, the driver's own calls on the actors between steps: a service
        that died since the step ended is revived first (or the run ends naming it), not left
        to fail the run with a bare actor error."""
        import ray

        try:
            return ask(self.actors, last)
        except ray.exceptions.RayActorError as exc:
            self.vigils.died(exc)
            return ask(self.actors, last)


def restart_learner(cfg: RunConfig, actors: Any, monitor: Any, reason: str,
                    on_stage: Callable[[str], None]) -> int:
    """Replace a dead learner inside the run, from its last checkpoint; replay delivers again
    what the lost steps trained. Returns the step training continues after."""
    import ray

    from cluster.actors import after_restart
    from cluster.weight_sync import form_weight_group

    t0 = time.monotonic()
    served = ray.get(actors.weights.version.remote())
    actors.learner.release()
    actors.learner = actors.make_learner(True, served)
    ray.get(actors.learner.call("get_version"))  # every rank built
    form_weight_group(actors)  # broadcast: a new rank 0, a new group
    step, version = ray.get(actors.learner.leader.get_resumed_from.remote())
    requeued = ray.get(actors.replay.recover.remote(version))
    monitor.rewind(step)
    after_restart(cfg, actors)
    on_stage(f"{reason}: restarted from step {step} (checkpoint version {version}) in "
             f"{time.monotonic() - t0:.1f}s; {requeued} groups delivered again")
    return step


def resume_replay(actors: Any, run_dir: Path, on_stage: Callable[[str], None]) -> int:
    """Line the replay store up with the checkpoint the learner resumed from; returns its step."""
    import ray

    from learner.run_files import keep_steps_through

    step, version = ray.get([actors.learner.leader.get_step.remote(), actors.learner.leader.get_version.remote()])
    requeued = ray.get(actors.replay.recover.remote(version))
    # No producer of this run is alive yet: reservations still counted are those of the dead.
    orphaned = ray.get(actors.replay.stats.remote()).running
    ray.get(actors.replay.release.remote(orphaned))
    keep_steps_through(run_dir / "metrics.jsonl", step)
    on_stage(f"resumed at step {step} (version {version}): {requeued} groups delivered again, "
             f"{orphaned} reservations of dead producers released")
    return step
