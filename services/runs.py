"""What the API does with runs, without HTTP: validate and submit, refresh status from Ray,
read progress from the run directory, stop, delete, and reconcile after a restart.

The registry holds ownership and the last known status; Ray holds the truth about a job's
state; the run directory (written by ``turnrl train``) holds steps, metrics and checkpoints.
"""

from __future__ import annotations

import copy
import json
import logging
import math
import re
import secrets
import shutil
import threading
import time
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from cluster.config import ConfigError, RunConfig, build_config
from cluster.live import LIVE_FILE
from cluster.pool import pool_actor_name
from cluster.telemetry import TARGETS_FILE
from services.admission import Admission, InvalidRunConfig, TooManyRuns
from services.config import ServiceConfig
from services.jobs import JobNotFound, RayJobs, RayUnavailable
from services.pools import PoolJobs
from services.registry import ACTIVE, STARTED, TERMINAL, RunRecord, RunRegistry
from services.secrets import write_secrets

log = logging.getLogger(__name__)

RUN_CONFIG_FILE = "run.yaml"
RETIRED_TARGETS = TARGETS_FILE + ".finished"
_TAIL_BYTES = 256 * 1024
# A run is recorded before Ray has its job; until then a status poll finds no job. Only a
# run older than this is declared lost when Ray does not know it.
LOST_GRACE_S = 60.0


def pool_of(run_dir: str | Path) -> str | None:
    """The engine pool an admitted run names (``rollout.pool`` in its run.yaml), or None."""
    try:
        tree = yaml.safe_load((Path(run_dir) / RUN_CONFIG_FILE).read_text()) or {}
    except (OSError, yaml.YAMLError):
        return None
    return (tree.get("rollout") or {}).get("pool")


class Conflict(RuntimeError):
    """The run's state does not allow the operation (stop a finished run, delete a live one)."""


def validate_run_config(body: Any) -> RunConfig:
    """A RunConfig from a JSON body, or InvalidRunConfig listing (key path, reason) pairs."""
    if not isinstance(body, dict):
        raise InvalidRunConfig([{"loc": "<root>", "msg": "the body must be a JSON object (a RunConfig)",
                                 "type": "type_error"}])
    try:
        return build_config(copy.deepcopy(body))
    except ConfigError as exc:
        cause = exc.__context__  # build_config raises `from None`; the structured errors stay here
        if isinstance(cause, ValidationError):
            raise InvalidRunConfig([_field_error(e) for e in cause.errors()]) from None
        raise InvalidRunConfig([{"loc": "<root>", "msg": str(exc), "type": "value_error"}]) from None


def _field_error(err: dict[str, Any]) -> dict[str, str]:
    loc = ".".join(str(p) for p in err["loc"] if not str(p).startswith("function-after"))
    msg = err["msg"]
    if err["type"] == "extra_forbidden":
        msg = "unknown key (check the spelling against the RunConfig schema in /openapi.json)"
    return {"loc": loc or "<root>", "msg": msg, "type": err["type"]}


def _clean(value: Any) -> Any:
    """NaN and inf are not JSON: they become null."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _clean(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_clean(v) for v in value]
    return value


def read_metrics(path: Path, cursor: int = 0, keys: set[str] | None = None) -> tuple[list[dict], int]:
    """Complete rows of ``metrics.jsonl`` from byte offset ``cursor``; returns (rows, next cursor)."""
    try:
        with path.open("rb") as fh:
            fh.seek(cursor)
            data = fh.read()
    except FileNotFoundError:
        return [], cursor
    end = data.rfind(b"\n") + 1  # a line still being written waits for the next call
    rows = []
    for line in data[:end].splitlines():
        try:
            row = json.loads(line) if line.strip() else None
        except json.JSONDecodeError:
            continue  # a line torn by a crash (the resumed run writes that step again)
        if isinstance(row, dict):
            rows.append(_clean({k: v for k, v in row.items() if keys is None or k in keys}))
    return rows, cursor + end


def last_metrics(path: Path) -> dict[str, Any]:
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        return {}
    start = max(0, size - _TAIL_BYTES)
    if start:  # begin at the first whole line of the tail
        with path.open("rb") as fh:
            fh.seek(start - 1)
            start += len(fh.readline()) - 1
    rows, _ = read_metrics(path, start)
    return rows[-1] if rows else {}


def _checkpoints(run_dir: Path) -> list[dict[str, Any]]:
    """Finished checkpoint folders ``step_NNNNNN``, oldest first."""
    out = []
    for path in (run_dir / "checkpoints").glob("step_*"):
        match = re.fullmatch(r"step_(\d+)", path.name)
        if match and path.is_dir():
            out.append({"name": path.name, "step": int(match.group(1)), "path": str(path)})
    return sorted(out, key=lambda c: c["step"])


def _json_file(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


class RunManager:
    def __init__(self, cfg: ServiceConfig, registry: RunRegistry, jobs: RayJobs) -> None:
        self.cfg, self.registry, self.jobs = cfg, registry, jobs
        self.runs_dir = cfg.runs_path()
        self.runs_dir.mkdir(parents=True, exist_ok=True)
        self.admission = Admission(cfg)  # refuses read roots that overlap the runs
        self.pools = PoolJobs(cfg, jobs)
        # admission's demand() counts actors with cluster.actors' rules, which import torch (seconds
        # on a busy machine): imported at start, not inside the first submission's request
        import cluster.actors  # noqa: F401
        import cluster.reward_service  # noqa: F401
        self._submit_lock = threading.Lock()  # the concurrent-runs count and the new row, together

    # -- submit ----------------------------------------------------------------------------
    def submit(self, owner: str, body: Any) -> RunRecord:
        """Validate, admit (InvalidRunConfig / TooManyRuns before anything starts), record, start."""
        run_cfg = validate_run_config(body)
        slug = re.sub(r"[^A-Za-z0-9._-]+", "-", run_cfg.name).strip("-.")[:40] or "run"
        run_id = f"{slug}-{secrets.token_hex(12)}"  # 96 random bits: no run id is guessable
        run_dir = self.runs_dir / run_id
        run_cfg = self.admission.admit(run_cfg, body, owner, run_dir)
        with self._submit_lock:
            active = len(self.registry.list(owner=owner, statuses=ACTIVE))
            limit = self.cfg.limits_for(owner).max_concurrent_runs
            if active >= limit:
                raise TooManyRuns(f"{owner!r} has {active} active runs; limits.max_concurrent_runs={limit}: "
                                  "wait for one to finish or stop one")
            if run_cfg.rollout.pool is not None:
                self._pool_room(owner, run_cfg.rollout.pool)
            queued = not self._slot_free()
            self._record(owner, slug, run_cfg, run_dir, "queued" if queued else "pending")
        if queued:
            log.info("run %s submitted by %s, queued (jobs.max_running=%s)", run_id, owner, self.cfg.jobs.max_running)
            return self.registry.get(run_id)
        self._start(self.registry.get(run_id))
        log.info("run %s submitted by %s", run_id, owner)
        return self.registry.get(run_id)

    def _slot_free(self) -> bool:
        limit = self.cfg.jobs.max_running
        return limit is None or len(self.registry.list(statuses=STARTED)) < limit

    def _start(self, rec: RunRecord, fail: bool = True) -> None:
        """Submit ``rec``'s Ray job. When Ray cannot be reached it raises; with ``fail`` the run
        is failed first (a submission answered 503), else it stays as it is (a queued run: the
        next poll tries again)."""
        try:
            self.jobs.submit(rec.id, Path(rec.run_dir) / RUN_CONFIG_FILE, {"turnrl_run": rec.id, "owner": rec.owner})
        except RayUnavailable as exc:
            if fail:
                self.registry.update(rec.id, status="failed", finished_at=time.time(), message=str(exc))
            raise
        self.registry.update(rec.id, status="pending")

    def start_queued(self) -> list[str]:
        """Start queued runs, oldest first, while ``jobs.max_running`` has room; their ids."""
        started = []
        with self._submit_lock:
            queued = sorted(self.registry.list(statuses=("queued",)), key=lambda r: r.created_at)
            for rec in queued:
                if not self._slot_free():
                    break
                try:
                    self._start(rec, fail=False)
                except RayUnavailable as exc:
                    log.warning("queued runs wait: %s", exc)
                    break  # the next poll tries again
                started.append(rec.id)
        for rid in started:
            log.info("run %s started from the queue", rid)
        return started

    def pool_runs(self) -> dict[str, list[RunRecord]]:
        """Active runs by the engine pool they name."""
        out: dict[str, list[RunRecord]] = {}
        for rec in self.registry.list(statuses=ACTIVE):
            if (name := pool_of(rec.run_dir)) is not None:
                out.setdefault(name, []).append(rec)
        return out

    def _pool_room(self, owner: str, pool: str) -> None:
        """429 unless the pool and the tenant's share of it have room for one more adapter."""
        runs = self.pool_runs().get(pool, [])
        room = self.cfg.pools[pool].max_adapters
        if len(runs) >= room:
            raise TooManyRuns(f"engine pool {pool!r} serves {len(runs)} runs, its max_adapters={room}: wait for "
                              "one to finish")
        mine, limit = sum(r.owner == owner for r in runs), self.cfg.limits_for(owner).max_pool_adapters
        if mine >= limit:
            raise TooManyRuns(f"{owner!r} has {mine} runs on engine pool {pool!r}; limits.max_pool_adapters="
                              f"{limit}: wait for one to finish or stop one")

    def _record(self, owner: str, slug: str, run_cfg: RunConfig, run_dir: Path, status: str) -> RunRecord:
        run_dir.mkdir(mode=0o700)  # other users of the machine cannot look in
        config_path = run_dir / RUN_CONFIG_FILE
        # what people see: secrets masked; the job reads their real values from the 0600 file
        config_path.write_text(yaml.safe_dump(run_cfg.model_dump(mode="json", by_alias=True), sort_keys=False))
        write_secrets(run_dir, run_cfg)
        now = time.time()
        rec = RunRecord(id=run_dir.name, owner=owner, name=slug, status=status, run_dir=str(run_dir),
                        total_steps=run_cfg.train.steps, created_at=now, updated_at=now)
        self.registry.add(rec)
        return rec

    # -- status ----------------------------------------------------------------------------
    def refresh(self, rec: RunRecord, note: str | None = None) -> RunRecord:
        """Ask Ray about an active run; terminal and queued runs (no Ray job yet) are returned
        as they are."""
        if rec.terminal or rec.status == "queued":
            return rec
        try:
            status, message = self.jobs.info(rec.id)
        except JobNotFound:
            if time.time() - rec.created_at < LOST_GRACE_S:
                return rec
            status, message = "lost", "Ray no longer knows this job (the cluster was restarted or the job deleted)"
        except RayUnavailable as exc:
            log.warning("status of %s unknown: %s", rec.id, exc)
            return rec
        if status == "running" and rec.stop_requested:
            status = "stopping"
        if status == rec.status:
            return rec
        changes: dict[str, Any] = {"status": status}
        if status in TERMINAL:
            changes |= {"finished_at": time.time(), "message": note or message}
            self._retire_targets(Path(rec.run_dir))
            log.info("run %s %s%s", rec.id, status, f" ({note})" if note else "")
        return self.registry.update(rec.id, **changes) or rec

    @staticmethod
    def _retire_targets(run_dir: Path) -> None:
        """Prometheus' file_sd glob stops matching, so finished runs leave the scrape targets."""
        path = run_dir / TARGETS_FILE
        if path.exists():
            path.replace(run_dir / RETIRED_TARGETS)

    def reconcile(self, startup: bool = False) -> dict[str, list[str]]:
        """Refresh every active run; at start-up also report what changed while we were down."""
        note = "finished while the service was not running" if startup else None
        report: dict[str, list[str]] = {"still_running": [], "finished": []}
        for rec in self.registry.list(statuses=ACTIVE):
            new = self.refresh(rec, note=note)
            report["finished" if new.terminal else "still_running"].append(new.id)
        self.start_queued()  # slots the finished ones freed
        self.sync_targets()
        if startup and (report["still_running"] or report["finished"]):
            log.info("reconnected to %d active run(s) %s; %d finished meanwhile %s",
                     len(report["still_running"]), report["still_running"], len(report["finished"]),
                     report["finished"])
        return report

    def sync_targets(self) -> None:
        """Mirror active runs' targets files into one directory: Prometheus' file_sd accepts a
        wildcard only in the file name, so ``runs/*/prometheus_targets.json`` cannot be scraped."""
        sd_dir = self.cfg.prometheus_sd_path()
        sd_dir.mkdir(parents=True, exist_ok=True)
        active = {rec.id: Path(rec.run_dir) for rec in self.registry.list(statuses=ACTIVE)}
        # the engine pools' engines too, as pool-<name>.json
        active |= {pool_actor_name(name): self.pools.targets(name) for name in self.cfg.pools}
        for rec_id, folder in active.items():
            try:
                data = (folder / TARGETS_FILE).read_bytes()
            except FileNotFoundError:
                continue  # actors not started yet
            dst = sd_dir / f"{rec_id}.json"
            if not dst.exists() or dst.read_bytes() != data:
                tmp = sd_dir / f".{rec_id}.tmp"
                tmp.write_bytes(data)
                tmp.replace(dst)  # Prometheus never reads half a file
        for path in sd_dir.glob("*.json"):
            if path.stem not in active:
                path.unlink(missing_ok=True)

    def detail(self, rec: RunRecord) -> dict[str, Any]:
        run_dir = Path(rec.run_dir)
        metrics = last_metrics(run_dir / "metrics.jsonl")
        targets = _json_file(run_dir / TARGETS_FILE) or []
        return {**self.summary(rec, metrics), "metrics": metrics, "checkpoints": _checkpoints(run_dir),
                "run_dir": rec.run_dir, "ray_submission_id": rec.id, "stop_requested": rec.stop_requested,
                "result": _clean(_json_file(run_dir / "result.json")),
                "metrics_endpoints": [t for entry in targets for t in entry.get("targets", [])],
                "live_url": (_json_file(run_dir / LIVE_FILE) or {}).get("base_url")}

    def summary(self, rec: RunRecord, metrics: dict[str, Any] | None = None) -> dict[str, Any]:
        if metrics is None:
            metrics = last_metrics(Path(rec.run_dir) / "metrics.jsonl")
        return {"id": rec.id, "name": rec.name, "owner": rec.owner, "status": rec.status,
                "step": int(metrics.get("step") or 0), "total_steps": rec.total_steps,
                "created_at": rec.created_at, "updated_at": rec.updated_at, "finished_at": rec.finished_at,
                "message": rec.message}

    # -- stop / delete ---------------------------------------------------------------------
    def stop(self, rec: RunRecord) -> RunRecord:
        rec = self.refresh(rec)
        if rec.terminal:
            raise Conflict(f"run {rec.id} already {rec.status}")
        if rec.status == "queued":  # no Ray job: it never starts
            with self._submit_lock:  # not while start_queued may be starting it
                rec = self.registry.get(rec.id)
                if rec.status == "queued":
                    log.info("run %s stopped while queued", rec.id)
                    return self.registry.update(rec.id, stop_requested=1, status="stopped", finished_at=time.time(),
                                                message="stopped while queued; it never started") or rec
        try:
            self.jobs.stop(rec.id)
        except JobNotFound:
            return self.refresh(rec)
        log.info("stop requested for run %s", rec.id)
        return self.registry.update(rec.id, stop_requested=1, status="stopping") or rec

    def delete(self, rec: RunRecord, keep_files: bool = False) -> None:
        rec = self.refresh(rec)
        if not rec.terminal:
            raise Conflict(f"run {rec.id} is {rec.status}; stop it first (POST /v1/runs/{rec.id}/stop)")
        try:
            self.jobs.delete(rec.id)
        except JobNotFound:
            pass  # already gone from Ray: deleting our record is all that is left
        run_dir = Path(rec.run_dir).resolve()
        if not keep_files and run_dir.parent == self.runs_dir.resolve():  # never outside our runs dir
            shutil.rmtree(run_dir, ignore_errors=True)
        self.registry.delete(rec.id)
        log.info("run %s deleted%s", rec.id, " (files kept)" if keep_files else "")
