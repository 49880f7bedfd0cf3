"""Shared engine pools: engines of one base model that many LoRA runs use at once.

An operator declares pools in the run service's config (``PoolConfig``); the service starts
each as a Ray job of its own (``python -m cluster.pool <pool.json>``, ``main``) whose driver
holds an ``EnginePool`` actor, named ``pool-<name>`` in the ``turnrl-pools`` namespace, which
owns the pool's engine actors. A run that names a pool (``rollout.pool``) finds that actor,
takes its engines instead of starting its own and attaches its LoRA adapter and weight sync
(``attach``); its versions are pushed to the pool's engines like any run's, as versions of its
adapter. The pool holds at most ``max_adapters`` runs, admits requests to each engine through
a fair gate keyed by adapter (``rollout.engines.fair``), removes a run's adapter when it
detaches (its end) or when its weight sync dies (a run killed without ending), and catches a
restarted engine up on every attached adapter. Runs come and go; the pool's engines stay.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cluster.config import PoolConfig
from rollout.engines.base import AdapterSpec

_log = logging.getLogger(__name__)

POOL_NAMESPACE = "turnrl-pools"
"""The Ray namespace of every pool actor (runs' own actors live in their jobs' namespaces)."""


def pool_actor_name(name: str) -> str:
    return f"pool-{name}"


def targets_dir(spec: Path) -> Path:
    """Where a pool started from ``spec`` (``<dir>/<name>.json``) writes its engines'
    ``prometheus_targets.json``: ``<dir>/<name>/``."""
    return spec.with_suffix("")


def model_fingerprint(path: str | Path) -> str:
    """What identifies a base model folder wherever it was converted or copied to: its
    config.json and the names and sizes of its weight files (a hub id is its own)."""
    folder = Path(path)
    if not folder.is_dir():
        return str(path)
    digest = hashlib.sha256((folder / "config.json").read_bytes())
    for weights in sorted(folder.glob("*.safetensors")) + sorted(folder.glob("*.bin")):
        digest.update(f"{weights.name}:{weights.stat().st_size}".encode())
    return digest.hexdigest()[:16]


@dataclass
class Attached:
    """A run on the pool: its adapter and its weight sync (whose ``latest`` the pool reads)."""

    adapter: AdapterSpec
    weights: Any


class PoolFull(RuntimeError):
    """The pool already holds ``max_adapters`` runs."""


class PoolSource:
    """A pool engine's ``catch_up`` source (``EngineServer``): the newest version of every
    attached run's adapter, listed by the pool actor (found by name)."""

    def __init__(self, name: str) -> None:
        self.name = name

    async def versions(self) -> list[tuple[AdapterSpec | None, int, Any]]:
        import ray

        pool = ray.get_actor(pool_actor_name(self.name), namespace=POOL_NAMESPACE)
        return await pool.versions.remote()


class EnginePool:
    """The pool's Ray actor (async): owns the engines, the table of attached runs and the
    watch that detaches dead ones."""

    def __init__(self, name: str, cfg: PoolConfig, model_path: str) -> None:
        import ray

        from cluster.telemetry import instrument
        from rollout.engines.server import EngineServer

        self.name, self.cfg, self.model_path = name, cfg, model_path
        self.fingerprint = model_fingerprint(model_path)
        eng = cfg.engine
        actor = ray.remote(instrument(EngineServer, "engine")).options(
            num_cpus=eng.num_cpus, num_gpus=eng.num_gpus, resources=eng.resources,
            max_concurrency=eng.max_concurrency, max_restarts=eng.max_restarts, max_task_retries=0)
        fair = (cfg.max_running, cfg.max_running_per_adapter)
        self.engines = [actor.remote(eng, model_path, i, PoolSource(name), restarted_by_ray=True, fair=fair)
                        for i in range(eng.count)]
        self.learner = None
        """The pool's learner (``cluster.pool_learner``) when its config has one."""
        if cfg.learner is not None:
            from cluster.pool_learner import start_pool_learner

            self.learner = start_pool_learner(name, cfg.learner, model_path, cfg.max_adapters)
        self.runs: dict[str, Attached] = {}
        self.detached = 0
        self._watch: asyncio.Task | None = None

    async def start(self) -> dict[str, Any]:
        """Wait for the engines; start the watch. Returns ``describe()``."""
        await asyncio.gather(*[e.start.remote() for e in self.engines],
                             *([self.learner.stats.remote()] if self.learner is not None else []))
        self._watch = asyncio.ensure_future(self._watch_runs())
        return self.describe()

    def describe(self) -> dict[str, Any]:
        """What a run attaching needs: the engines, the learner (None: runs bring their own)
        and the model (path and fingerprint); what is attached is ``stats``'."""
        return {"engines": self.engines, "learner": self.learner, "model_path": self.model_path,
                "fingerprint": self.fingerprint}

    def attach(self, run_id: str, adapter: AdapterSpec, weights: Any) -> list[Any]:
        """Take ``run_id`` on (again, after a restart of its driver: its new sync replaces the
        old); raises PoolFull when ``max_adapters`` runs are attached. Returns the engines."""
        if run_id not in self.runs and len(self.runs) >= self.cfg.max_adapters:
            raise PoolFull(f"engine pool {self.name!r} serves {len(self.runs)} runs, its max_adapters: wait for "
                           "one to end, or ask the operator for a larger pool")
        self.runs[run_id] = Attached(adapter, weights)
        _log.info("pool %s: run %s attached (%d of %d)", self.name, run_id, len(self.runs), self.cfg.max_adapters)
        return self.engines

    async def detach(self, run_id: str) -> bool:
        """Forget ``run_id`` and unload its adapter from every engine (once its open requests
        end). False when it was not attached."""
        run = self.runs.pop(run_id, None)
        if run is None:
            return False
        self.detached += 1
        learner = [self.learner.detach.remote(run_id)] if self.learner is not None else []
        results = await asyncio.gather(*[e.remove_adapter.remote(run.adapter.name) for e in self.engines], *learner,
                                       return_exceptions=True)
        for i, res in enumerate(results):
            if isinstance(res, BaseException):
                what = f"engine {i} kept adapter" if i < len(self.engines) else "the learner kept the slot of"
                _log.warning("pool %s: %s %s: %s", self.name, what, run.adapter.name, res)
        _log.info("pool %s: run %s detached", self.name, run_id)
        return True

    async def versions(self) -> list[tuple[AdapterSpec, int, Any]]:
        """Each attached run's newest published adapter version (a restarted engine's catch-up)."""
        runs = list(self.runs.values())
        got = await asyncio.gather(*[r.weights.latest.remote() for r in runs], return_exceptions=True)
        return [(r.adapter, *latest) for r, latest in zip(runs, got)
                if latest is not None and not isinstance(latest, BaseException)]

    async def _watch_runs(self) -> None:
        """Detach runs whose weight sync died (a run killed before it could detach)."""
        import ray

        while True:
            await asyncio.sleep(self.cfg.watch_s)
            for run_id, run in list(self.runs.items()):
                try:
                    await asyncio.wait_for(run.weights.stats.remote(), timeout=max(self.cfg.watch_s, 5.0))
                except ray.exceptions.ActorDiedError:
                    _log.warning("pool %s: run %s's weight sync is gone; detaching it", self.name, run_id)
                    await self.detach(run_id)
                except Exception:  # noqa: BLE001 - busy or restarting: alive as far as the pool knows
                    continue

    async def stats(self) -> dict[str, Any]:
        learner = [self.learner.stats.remote()] if self.learner is not None else []
        got = await asyncio.gather(*[e.stats.remote() for e in self.engines], *learner, return_exceptions=True)
        got = [None if isinstance(s, BaseException) else s for s in got]
        return {"runs": sorted(self.runs), "detached": self.detached, "engines": got[:len(self.engines)],
                "learner": got[len(self.engines)] if learner else None}

    async def vigil(self) -> None:
        """Never returns: the pool job's driver waits on it and ends when the actor dies."""
        await asyncio.Event().wait()


def find_pool(name: str, timeout_s: float = 300.0) -> Any:
    """The pool actor named ``name``, waiting up to ``timeout_s`` for it to start (the service
    starts pools as it starts, maybe after a run was submitted)."""
    import ray

    deadline = time.monotonic() + timeout_s
    while True:
        try:
            pool = ray.get_actor(pool_actor_name(name), namespace=POOL_NAMESPACE)
            ray.get(pool.describe.remote(), timeout=max(deadline - time.monotonic(), 1.0))
            return pool
        except (ValueError, ray.exceptions.GetTimeoutError):
            if time.monotonic() > deadline:
                raise RuntimeError(f"rollout.pool={name!r}: no engine pool of that name answered within "
                                   f"{timeout_s:.0f}s; the run service starts the pools its config declares "
                                   "(`pools`), and `turnrl serve` lists them at GET /v1/pools") from None
            time.sleep(1.0)


def pool_engines(name: str, policy_path: str) -> tuple[Any, list[Any]]:
    """(pool actor, its engines) for a run whose policy is ``policy_path``; refuses a pool
    serving another base model."""
    import ray

    pool = find_pool(name)
    info = ray.get(pool.describe.remote())
    if model_fingerprint(policy_path) != info["fingerprint"]:
        raise RuntimeError(f"rollout.pool={name!r} serves the base model {info['model_path']}, not this run's "
                           f"policy.path ({policy_path}): an adapter trains against one base; set policy.path "
                           "to the pool's model (the run service does)")
    return pool, info["engines"]


def start_pool(name: str, cfg: PoolConfig, model_path: str) -> Any:
    """The named pool actor (owned by the calling driver: it ends with the driver's job)."""
    import ray

    return ray.remote(EnginePool).options(name=pool_actor_name(name), namespace=POOL_NAMESPACE,
                                          num_cpus=cfg.num_cpus, max_concurrency=1000).remote(name, cfg, model_path)


def resolve_model(cfg: PoolConfig) -> str:
    """The pool's model as a folder every node reads (``builtin:smollm2`` converted once)."""
    from learner.bootstrap import ensure_policy
    from learner.config import PolicyConfig

    policy = PolicyConfig(path=cfg.model, sft={"enabled": False})  # the base, as every run on it trains it
    return str(ensure_policy(policy, None, None, show_progress=False))


def main(argv: list[str] | None = None) -> int:
    """``python -m cluster.pool <pool.json>``: start the pool named there and hold it until
    the job is stopped (SIGINT or SIGTERM) or the pool actor dies."""
    import ray

    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) != 1:
        print("usage: python -m cluster.pool <pool.json>  ({\"name\": ..., \"config\": {PoolConfig}})", file=sys.stderr)
        return 2
    spec = json.loads(Path(args[0]).read_text())
    name, cfg = spec["name"], PoolConfig.model_validate(spec["config"])
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    from cluster.actors import job_env

    ray.init(address=spec.get("address") or "auto", namespace=POOL_NAMESPACE, log_to_driver=True,
             runtime_env={"env_vars": job_env()})
    model_path = resolve_model(cfg)
    pool = start_pool(name, cfg, model_path)
    info = ray.get(pool.start.remote())
    print(f"pool {name}: {len(info['engines'])} {cfg.engine.type} engine(s) of {model_path} ready", flush=True)
    from cluster.telemetry import TargetsRefresh, publish_metrics_targets

    # the engines' Prometheus endpoints, beside the pool's spec (the run service mirrors them),
    # kept current as Ray starts engines again
    targets = targets_dir(Path(args[0]))
    targets.mkdir(parents=True, exist_ok=True)
    engines = [("engine", e) for e in info["engines"]]
    publish_metrics_targets(engines, targets, pool_actor_name(name))
    refresh = TargetsRefresh(lambda: engines, targets, pool_actor_name(name))
    try:
        ray.get(pool.vigil.remote())
    except KeyboardInterrupt:
        print(f"pool {name}: stopping", flush=True)
        return 0
    except ray.exceptions.RayActorError as exc:
        print(f"pool {name}: the pool actor died: {exc}", file=sys.stderr, flush=True)
        return 1
    finally:
        refresh.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
