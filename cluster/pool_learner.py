"""A pool's learner on Ray: the host actor that trains every attached run's adapter, and a
run's side of it.

A pool declared with a ``learner`` (``PoolConfig.learner``) has its actor
(``cluster.pool.EnginePool``) start ``PoolLearnerHost``: one process holding the base model once
(``learner.pool.PoolLearner``) and a thread that trains rounds of the runs whose drivers wait
for a step, several runs' micro-batches in one base pass. A run with ``learner.on_pool``
starts no learner of its own: its learner group is one ``TenantLearner``, a small actor that
imports no torch and holds no model. It attaches the run (its learner settings, replay and
weight sync) to the host and answers the driver's calls as a run's own learner does
(``train_step`` asks the host for one step and returns its metrics; ``save_checkpoint``,
versions, ``settle_weights``).

When the host dies, each tenant actor exits: its driver sees its learner die and starts a new
one from the run's last checkpoint (``cluster.supervision.restart_learner``), which attaches to
the host Ray started again; replay delivers again what the lost steps trained, so nothing is
trained twice or lost. A run that ends (or dies) detaches through its pool
(``EnginePool.detach``), which frees its slot at once.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from pathlib import Path
from typing import Any

from cluster.config import PoolLearnerConfig
from cluster.pool import POOL_NAMESPACE
from cluster.survival import wait_restarted
from learner.config import LearnerConfig

_log = logging.getLogger(__name__)

_POLL_S = 1.0
"""How long one wait of a tenant for its step's result lasts (an interrupt is seen between)."""
_HOST_RESTART_S = 300.0
"""Longest a run's new learner waits for the pool's learner that Ray is restarting (its process
starts and loads the base model) before it gives up and the run's restart fails."""


def pool_learner_name(pool: str) -> str:
    return f"pool-learner-{pool}"


class NotAttached(RuntimeError):
    """The pool learner holds no slot for the run: it was restarted since the run attached
    (or the run was detached)."""


class PoolLearnerHost:
    """The pool learner's Ray actor (threaded): ``learner.pool.PoolLearner`` and the thread
    that trains it. The ``PoolLearner`` is used by one thread at a time (``_lock``); a step's
    result waits in its run's queue for that run's ``TenantLearner`` to take it."""

    def __init__(self, name: str, cfg: PoolLearnerConfig, model_path: str) -> None:
        import torch

        from learner.pool import PoolLearner

        torch.set_num_threads(cfg.torch_threads)
        self.name = name
        self.learner = PoolLearner(model_path, cfg.target_modules, coalesce_s=cfg.coalesce_s,
                                   device="cuda" if cfg.num_gpus > 0 else "cpu")
        self._lock = threading.Lock()
        self._results: dict[str, queue.Queue] = {}
        self._thread = threading.Thread(target=self._train, name="pool-learner", daemon=True)
        self._thread.start()

    # -- the training thread ------------------------------------------------------------
    def _train(self) -> None:
        while True:
            with self._lock:  # results are handed over under it too: a detach cannot slip in between
                asked = any(t.requested for t in self.learner.tenants.values())
                for name, metrics in (self._round() if asked else {}).items():
                    self._results[name].put(("ok", metrics))
                for name in [n for n in self.learner.failed if n in self._results]:
                    self._results.pop(name).put(("failed", self.learner.failed[name]))
            if not asked:
                time.sleep(0.02)

    def _round(self) -> dict[str, dict[str, float]]:
        """One round; a failure of the fused step itself fails every run in it (each attaches
        again from its checkpoint), never the thread."""
        try:
            return self.learner.train_round(wait_s=0.2)
        except Exception as exc:  # noqa: BLE001 - reported to the runs that were in the round
            _log.exception("pool %s: a fused step failed", self.name)
            for name in [t.name for t in self.learner.tenants.values() if t.requested]:
                self.learner.drop(name, exc)
            return {}

    # -- what a run's TenantLearner calls ---------------------------------------------------
    def attach(self, run_id: str, cfg: LearnerConfig, ports: Any, *, temperature: float, rewards: Any,
               run_dir: str, resume: bool, version_floor: int, live_groups: int) -> int:
        """Give ``run_id`` a slot (again, after its learner was replaced: the old one goes);
        returns the version it published."""
        with self._lock:
            if run_id in self.learner.tenants:
                self.learner.detach(run_id)
            self.learner.failed.pop(run_id, None)
            self._results[run_id] = queue.Queue()
            try:
                return self.learner.attach(run_id, cfg, ports, temperature=temperature, rewards=rewards,
                                           run_dir=run_dir, resume=resume, version_floor=version_floor,
                                           live_groups=live_groups, on_request=True)
            except BaseException:
                self._results.pop(run_id, None)
                raise

    def detach(self, run_id: str) -> bool:
        """Free ``run_id``'s slot; False when it held none."""
        with self._lock:
            self._results.pop(run_id, None)
            self.learner.failed.pop(run_id, None)
            if run_id not in self.learner.tenants:
                return False
            self.learner.detach(run_id)
            _log.info("pool %s: run %s's adapter slot freed", self.name, run_id)
            return True

    def request(self, run_id: str, steps: int) -> None:
        """``run_id``'s driver waits for ``steps`` more steps (0: it stopped waiting)."""
        with self._lock:
            self._tenant(run_id)
            self.learner.request(run_id, steps)

    def result(self, run_id: str, wait_s: float) -> tuple[str, Any] | None:
        """The next step of ``run_id``: ("ok", metrics) or ("failed", why), waiting up to
        ``wait_s``; None meanwhile."""
        results = self._results.get(run_id)
        if results is None:
            raise self._missing(run_id)
        try:
            return results.get(timeout=wait_s)
        except queue.Empty:
            return None

    def save_checkpoint(self, run_id: str) -> str:
        with self._lock:
            self._tenant(run_id)
            return str(self.learner.save_checkpoint(run_id))

    def state(self, run_id: str) -> dict[str, Any]:
        """``run_id``'s step, version and the (step, version) it attached from."""
        tenant = self._tenant(run_id)
        return {"step": tenant.step, "version": tenant.version, "resumed_from": tenant.resumed_from}

    def settle(self, run_id: str) -> None:
        """Wait until ``run_id``'s last published version is served (its driver calls it
        between steps; not under the lock, which would hold every other run's training)."""
        self._tenant(run_id).ports.settle()

    def republish(self, run_id: str) -> int:
        return self._tenant(run_id).ports.republish()

    def stats(self) -> dict[str, Any]:
        return {**self.learner.stats(), "failed": dict(self.learner.failed)}

    def _tenant(self, run_id: str) -> Any:
        tenant = self.learner.tenants.get(run_id)
        if tenant is None:
            raise self._missing(run_id)
        return tenant

    def _missing(self, run_id: str) -> Exception:
        """Why ``run_id`` has no slot: dropped (its ports failed), or never attached here."""
        why = self.learner.failed.get(run_id)
        if why is not None:
            return RuntimeError(f"pool {self.name}'s learner dropped run {run_id}: {why}")
        return NotAttached(f"pool {self.name}'s learner holds no slot for run {run_id} (restarted since it "
                           "attached, or the run was detached)")


class TenantLearner:
    """A run's learner when its pool trains it (``learner.on_pool``): the calls a run's own
    learner answers (``learner.worker.LearnerWorker``), made on the pool's learner. Imports no
    torch; holds no model."""

    def __init__(self, pool: str, run_id: str, cfg: LearnerConfig, ports: Any, run_dir: str, *,
                 temperature: float, rewards: Any, resume: bool, version_floor: int, live_groups: int) -> None:
        import ray

        self.cfg, self.run_id, self.pool = cfg, run_id, pool
        self._interrupted = threading.Event()
        try:
            self.host = ray.get_actor(pool_learner_name(pool), namespace=POOL_NAMESPACE)
        except ValueError:
            raise RuntimeError(f"learner.on_pool: engine pool {pool!r} has no learner (its config sets no "
                               "`learner`); set learner.on_pool=false to train with a learner of the run's own"
                               ) from None
        Path(run_dir).mkdir(parents=True, exist_ok=True)
        # A learner replacing one whose host died starts while Ray restarts the host: a call
        # made then fails at once (ActorUnavailableError), which is no reason to end this one.
        wait_restarted(self.host, _HOST_RESTART_S, waiting=lambda s: _log.info(
            "run %s: waiting %.0fs for pool %s's learner to start again", run_id, s, pool))
        self._call(self.host.attach.remote(
            run_id, cfg, ports, temperature=temperature, rewards=rewards, run_dir=run_dir, resume=resume,
            version_floor=version_floor, live_groups=live_groups))
        self._state = self._call(self.host.state.remote(run_id))

    def _call(self, ref: Any) -> Any:
        """The host's answer; when the host died (or was restarted since this run attached),
        this actor exits too: the driver then replaces its learner from the run's last
        checkpoint, attaching to the restarted host."""
        import ray

        try:
            return ray.get(ref)
        except (ray.exceptions.RayActorError, NotAttached) as exc:
            _log.error("run %s: pool %s's learner died or restarted (%s); ending this learner so the run starts "
                       "another from its last checkpoint", self.run_id, self.pool, exc)
            os._exit(1)

    def train_step(self) -> dict[str, float]:
        """Ask the pool learner for one step of this run and wait for it (it trains the run's
        next batch as soon as it is ready, with other runs' when theirs are too)."""
        t0 = time.perf_counter()
        self._call(self.host.request.remote(self.run_id, 1))
        deadline = t0 + self.cfg.claim_timeout_s
        while (got := self._call(self.host.result.remote(self.run_id, _POLL_S))) is None:
            if self._interrupted.is_set() or time.perf_counter() > deadline:
                self._call(self.host.request.remote(self.run_id, 0))
                if self._interrupted.is_set():
                    raise InterruptedError("the learner was told to stop waiting for a batch (the run is ending)")
                raise TimeoutError(f"the pool learner trained no step of this run in {self.cfg.claim_timeout_s:.0f}s "
                                   "(learner.claim_timeout_s): rollout actors are not producing (see their errors "
                                   "above) or replay refuses them")
        kind, value = got
        if kind == "failed":
            raise RuntimeError(f"pool {self.pool}'s learner dropped run {self.run_id}: {value}")
        self._state = {**self._state, "step": int(value["step"]), "version": int(value["version"])}
        return {**value, "time/step_s": time.perf_counter() - t0}

    def save_checkpoint(self) -> str:
        return self._call(self.host.save_checkpoint.remote(self.run_id))

    def settle_weights(self) -> None:
        """Wait for the last published version to be served. A host that died meanwhile has
        nothing left to wait for (the weight sync carries what it was handed): this returns,
        and the run's next step, which needs the host, replaces this learner."""
        import ray

        try:
            ray.get(self.host.settle.remote(self.run_id))
        except (ray.exceptions.RayActorError, NotAttached):
            _log.warning("run %s: pool %s's learner is gone; its next step replaces this learner", self.run_id,
                         self.pool)

    def republish(self) -> int:
        return self._call(self.host.republish.remote(self.run_id))

    def weight_group(self) -> None:
        """No broadcast group: a pool's runs publish through the object store or files."""
        return None

    def interrupt(self) -> None:
        self._interrupted.set()

    def get_resumed_from(self) -> tuple[int, int]:
        return tuple(self._state["resumed_from"])

    def get_version(self) -> int:
        return int(self._state["version"])

    def get_step(self) -> int:
        return int(self._call(self.host.state.remote(self.run_id))["step"])


def start_pool_learner(pool: str, cfg: PoolLearnerConfig, model_path: str, max_adapters: int) -> Any:
    """The pool's learner actor, named for the pool (runs find it by name), restarted by Ray
    up to ``cfg.max_restarts`` times. Calls run on threads: every run's wait for its step's
    result beside the others' calls."""
    import ray

    return ray.remote(PoolLearnerHost).options(
        name=pool_learner_name(pool), namespace=POOL_NAMESPACE, num_cpus=cfg.num_cpus, num_gpus=cfg.num_gpus,
        resources=cfg.resources, max_restarts=cfg.max_restarts, max_task_retries=0,
        max_concurrency=4 * max_adapters + 8).remote(pool, cfg, model_path)


def start_tenant(cfg: Any, run_id: str, ports: Any, run_dir: str, resume: bool, version_floor: int,
                 live_groups: int) -> Any:
    """Run ``run_id``'s learner group on its pool's learner: one ``TenantLearner`` (no CPU of
    its own: it waits on the pool's learner), never restarted by Ray (the driver replaces it)."""
    from cluster.actors import learner_actor_class
    from cluster.learner_group import LearnerGroup
    from cluster.telemetry import instrument

    actor = learner_actor_class(instrument(TenantLearner, "learner")).options(
        num_cpus=0, max_restarts=0, max_concurrency=4)
    return LearnerGroup([actor.remote(
        cfg.rollout.pool, run_id, cfg.learner, ports, run_dir, temperature=cfg.rollout.temperature,
        rewards=cfg.rewards, resume=resume, version_floor=version_floor, live_groups=live_groups)])
