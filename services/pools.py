"""The engine pools an operator declares (``ServiceConfig.pools``), kept running as Ray jobs.

Each pool is a job of its own (``python -m cluster.pool <state_dir>/pools/<name>.json``,
submission id ``pool-<name>-<random>``, metadata ``turnrl_pool``) so that it outlives service
restarts like runs do; the service starts the ones not running when it starts and whenever its
status poll finds one gone. A pool whose declared config changed keeps running as it was (its
tenants' runs depend on it) until the operator stops its job (``ray job stop <id>``); the
service then starts the new one. Runs name a pool in ``rollout.pool`` (docs/tenants.md).
"""

from __future__ import annotations

import hashlib
import json
import logging
import secrets
from pathlib import Path
from typing import Any

from cluster.pool import targets_dir
from services.config import ServiceConfig
from services.jobs import RayJobs, RayUnavailable

log = logging.getLogger(__name__)
POOL_KEY = "turnrl_pool"
LIVE = ("pending", "running")


class PoolJobs:
    def __init__(self, cfg: ServiceConfig, jobs: RayJobs) -> None:
        self.cfg, self.jobs = cfg, jobs
        self.dir = cfg.state_path() / "pools"

    def spec_path(self, name: str) -> Path:
        """The pool's spec, what its job starts from (its engines' metrics targets beside it)."""
        return self.dir / f"{name}.json"

    def targets(self, name: str) -> Path:
        """The folder where the pool's job writes its engines' ``prometheus_targets.json``."""
        return targets_dir(self.spec_path(name))

    def spec(self, name: str) -> dict[str, Any]:
        return {"name": name, "config": self.cfg.pools[name].model_dump(mode="json")}

    def digest(self, name: str) -> str:
        return hashlib.sha256(json.dumps(self.spec(name), sort_keys=True).encode()).hexdigest()[:16]

    def running(self) -> dict[str, tuple[str, str, dict[str, str]]]:
        """Pool name -> (job id, status, metadata) of its live job."""
        out = {}
        for sid, status, meta in self.jobs.with_metadata(POOL_KEY):
            if status in LIVE:
                out[meta[POOL_KEY]] = (sid, status, meta)
        return out

    def ensure(self) -> list[str]:
        """Start every declared pool that has no live job; returns the job ids started."""
        if not self.cfg.pools:
            return []
        running, started = self.running(), []
        for name in self.cfg.pools:
            digest = self.digest(name)
            if name in running:
                if running[name][2].get("config") != digest:
                    log.warning("engine pool %s runs an older config (job %s); stop that job to start the new one",
                                name, running[name][0])
                continue
            self.dir.mkdir(parents=True, exist_ok=True)
            path = self.spec_path(name)
            path.write_text(json.dumps(self.spec(name), indent=2))
            sid = f"pool-{name}-{secrets.token_hex(4)}"
            self.jobs.submit(sid, path, {POOL_KEY: name, "config": digest}, module="cluster.pool")
            log.info("engine pool %s starting as Ray job %s", name, sid)
            started.append(sid)
        return started

    def describe(self, attached: dict[str, int]) -> list[dict[str, Any]]:
        """The pools as GET /v1/pools shows them; ``attached``: active runs per pool. Status
        ``unknown`` while Ray's job server does not answer."""
        try:
            running: dict[str, tuple[str, str, dict[str, str]]] | None = self.running()
        except RayUnavailable:
            running = None
        out = []
        for name, pool in self.cfg.pools.items():
            job = running.get(name) if running is not None else None
            status = "unknown" if running is None else job[1] if job else "down"
            out.append({"name": name, "model": pool.model, "engine": pool.engine.type, "engines": pool.engine.count,
                        "max_adapters": pool.max_adapters, "attached": attached.get(name, 0),
                        "learner": pool.learner is not None,
                        "status": status, "job": job[0] if job else None})
        return out

