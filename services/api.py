"""The REST API: submit, list, inspect, follow, stop and delete runs; health and metrics.

Every route but /healthz and /metrics depends on ``authenticate``; a token sees only its own
runs (another owner's run is a 404, indistinguishable from a missing one) and a read-only
token gets 403 on anything that changes state. Blocking work (SQLite, Ray's HTTP client, file
reads) runs on the thread pool.
"""

from __future__ import annotations

import asyncio
import logging
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, AsyncIterator

from fastapi import Depends, FastAPI, HTTPException, Query, Request, Response
from fastapi.concurrency import run_in_threadpool
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse

from cluster.config import RunConfig
from services import schemas
from services.auth import Principal, Sessions, TokenStore, authenticate, require_writer
from services.config import ServiceConfig
from services.http import BodyLimit, RequestMetrics, ServiceMetrics
from services.jobs import JobNotFound, RayJobs, RayUnavailable
from services.registry import RunRecord, Status
from services.admission import InvalidRunConfig, TooManyRuns
from services.runs import Conflict, RunManager, read_metrics

log = logging.getLogger(__name__)
API_VERSION = "1.0.0"
Auth = Annotated[Principal, Depends(authenticate)]


@dataclass
class ServiceState:
    cfg: ServiceConfig
    tokens: TokenStore
    jobs: RayJobs
    manager: RunManager
    sessions: Sessions
    ray_up: bool = True
    metrics: ServiceMetrics = field(init=False)

    def __post_init__(self) -> None:
        self.metrics = ServiceMetrics(self.manager.registry.count_by_status, lambda: self.ray_up)


async def _poll(state: ServiceState) -> None:
    """Keep active runs' status fresh, so finished runs are recorded even if nobody asks."""
    while True:
        await asyncio.sleep(state.cfg.jobs.poll_s)
        try:
            state.ray_up = await run_in_threadpool(state.jobs.up)
            if state.ray_up:
                await run_in_threadpool(state.manager.reconcile)
                await run_in_threadpool(_ensure_pools, state)
        except Exception:  # the poller must survive anything one round throws
            log.exception("refreshing run status failed")


def _ensure_pools(state: ServiceState) -> None:
    """Start the declared engine pools that are not running (a failure is logged, retried at
    the next poll)."""
    try:
        state.manager.pools.ensure()
    except RayUnavailable as exc:
        log.warning("engine pools not checked: %s", exc)


def _owned(state: ServiceState, run_id: str, principal: Principal) -> RunRecord:
    rec = state.manager.registry.get(run_id)
    if rec is None or rec.owner != principal.name:  # someone else's run looks like no run
        raise HTTPException(404, "run not found")
    return rec


def _known_query_only(request: Request) -> None:
    """422 for a query parameter the route does not take: a typo (``keep_file=true`` on DELETE)
    must not be silently ignored; nor one given twice, since every parameter is a scalar and
    FastAPI would keep the last (``?status=running&status=failed`` would list failed runs only)."""
    route = request.scope.get("route")
    if route is None or not getattr(route, "include_in_schema", False):
        return  # the dashboard page reads its own ?run= in the browser
    known = {p.alias for p in route.dependant.query_params}
    unknown = sorted(set(request.query_params) - known)
    if unknown:
        raise RequestValidationError([{"loc": ("query", name), "type": "extra_forbidden",
                                       "msg": f"unknown query parameter; known: {sorted(known)}"} for name in unknown])
    repeated = sorted(name for name in set(request.query_params) if len(request.query_params.getlist(name)) > 1)
    if repeated:
        raise RequestValidationError([{"loc": ("query", name), "type": "repeated",
                                       "msg": "given more than once; give it once"} for name in repeated])


def _tail(text: str, lines: int) -> str:
    return "".join(text.splitlines(keepends=True)[-lines:]) if lines else ""


def create_app(state: ServiceState) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        state.ray_up = await run_in_threadpool(state.jobs.up)
        await run_in_threadpool(state.manager.reconcile, True)  # reconnect after a restart
        if state.ray_up:
            await run_in_threadpool(_ensure_pools, state)
        poller = asyncio.create_task(_poll(state))
        yield
        poller.cancel()

    app = FastAPI(title="TurnRL run service", version=API_VERSION, lifespan=lifespan,
                  docs_url=None, redoc_url=None, openapi_url=None,  # /openapi.json needs a token (below)
                  description="Submit and manage TurnRL training runs (Ray jobs). Bearer token required "
                              "everywhere but /healthz and /metrics.",
                  dependencies=[Depends(_known_query_only)])
    app.state.tokens, app.state.sessions, app.state.service = state.tokens, state.sessions, state
    app.add_middleware(BodyLimit, max_bytes=state.cfg.max_body_bytes)
    app.add_middleware(RequestMetrics, metrics=state.metrics)
    _error_handlers(app)
    _public_routes(app, state)
    _read_routes(app, state)
    _write_routes(app, state)
    from services.dashboard import add_dashboard

    add_dashboard(app, state)
    app.openapi = lambda: _openapi(app)  # type: ignore[method-assign]
    return app


def _error_handlers(app: FastAPI) -> None:
    @app.exception_handler(InvalidRunConfig)
    async def invalid_config(request: Request, exc: InvalidRunConfig) -> JSONResponse:
        return JSONResponse({"detail": exc.errors}, status_code=422)

    @app.exception_handler(RequestValidationError)
    async def invalid_request(request: Request, exc: RequestValidationError) -> JSONResponse:
        errors = [{"loc": ".".join(str(p) for p in e["loc"]), "msg": e["msg"], "type": e["type"]}
                  for e in exc.errors()]
        return JSONResponse({"detail": errors}, status_code=422)

    @app.exception_handler(TooManyRuns)
    async def too_many(request: Request, exc: TooManyRuns) -> JSONResponse:
        return JSONResponse({"detail": str(exc)}, status_code=429)

    @app.exception_handler(Conflict)
    async def conflict(request: Request, exc: Conflict) -> JSONResponse:
        return JSONResponse({"detail": str(exc)}, status_code=409)

    @app.exception_handler(JobNotFound)
    async def job_gone(request: Request, exc: JobNotFound) -> JSONResponse:
        return JSONResponse({"detail": "Ray no longer has this run's job (deleted, or the cluster was replaced)"},
                            status_code=404)

    @app.exception_handler(RayUnavailable)
    async def ray_down(request: Request, exc: RayUnavailable) -> JSONResponse:
        return JSONResponse({"detail": str(exc)}, status_code=503)


def _public_routes(app: FastAPI, state: ServiceState) -> None:
    @app.get("/healthz", response_model=schemas.Health, operation_id="health", tags=["service"], responses=schemas.BAD_QUERY,
             openapi_extra={"security": []})
    def health() -> dict[str, Any]:
        return {"status": "ok" if state.ray_up else "degraded",
                "ray": {"address": state.jobs.address, "up": state.ray_up}}

    @app.get("/metrics", response_class=PlainTextResponse, operation_id="metrics", tags=["service"], responses=schemas.BAD_QUERY,
             openapi_extra={"security": []})
    def metrics() -> Response:
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        return Response(generate_latest(state.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/openapi.json", include_in_schema=False)
    def openapi(principal: Auth) -> dict[str, Any]:
        return app.openapi()


def _write_routes(app: FastAPI, state: ServiceState) -> None:
    """Submit, stop, delete: bearer token of a writer only."""
    manager = state.manager
    submit_body = {"requestBody": {"required": True, "content": {"application/json": {
        "schema": {"$ref": "#/components/schemas/RunConfig"}, "examples": schemas.SUBMIT_EXAMPLES}}}}

    @app.post("/v1/runs", status_code=201, response_model=schemas.RunSummary, operation_id="submitRun",
              tags=["runs"], openapi_extra=submit_body,
              responses={**schemas.ERRORS, 403: {"model": schemas.Problem, "description": "Read-only token"},
                         413: {"model": schemas.Problem, "description": "Body too large"},
                         422: {"model": schemas.ValidationFailed,
                               "description": "Invalid RunConfig, or it names what the service does not "
                                              "allow (a path, callable, executable or host) or exceeds a limit"},
                         429: {"model": schemas.Problem, "description": "Too many active runs for this token"},
                         503: {"model": schemas.Problem, "description": "Ray unavailable"}})
    async def submit_run(request: Request, response: Response, principal: Auth) -> dict[str, Any]:
        """Validate a RunConfig, admit it (paths, callables, executables and hosts against the
        operator's allowlist; per-tenant limits) and start it as a Ray job. The service sets
        ``output_dir``, ``progress``, ``cluster.address`` and the caches; ``name`` prefixes the
        run id."""
        require_writer(principal)
        try:
            body = await request.json()
        except ValueError as exc:
            raise InvalidRunConfig([{"loc": "<root>", "msg": f"body is not valid JSON: {exc}", "type": "json_invalid"}])
        rec = await run_in_threadpool(manager.submit, principal.name, body)
        response.headers["Location"] = f"/v1/runs/{rec.id}"
        return manager.summary(rec)

    @app.post("/v1/runs/{run_id}/stop", status_code=202, response_model=schemas.RunSummary, operation_id="stopRun",
              tags=["runs"], responses={**schemas.ERRORS, 403: {"model": schemas.Problem},
                                        409: {"model": schemas.Problem, "description": "Run already finished"}})
    def stop_run(run_id: str, principal: Auth) -> dict[str, Any]:
        """Graceful stop: the run stops rollouts, writes a final checkpoint and ends ``stopped``."""
        require_writer(principal)
        return manager.summary(manager.stop(_owned(state, run_id, principal)))

    @app.delete("/v1/runs/{run_id}", status_code=204, operation_id="deleteRun", tags=["runs"],
                responses={**schemas.ERRORS, 403: {"model": schemas.Problem},
                           409: {"model": schemas.Problem, "description": "Run still active"}})
    def delete_run(run_id: str, principal: Auth,
                   keep_files: Annotated[bool, Query(description="Keep the run directory")] = False) -> Response:
        """Forget a finished run: its registry entry, its Ray job record and (unless
        ``keep_files``) its run directory."""
        require_writer(principal)
        manager.delete(_owned(state, run_id, principal), keep_files=keep_files)
        return Response(status_code=204)


def _read_routes(app: FastAPI, state: ServiceState) -> None:
    """List, inspect, metrics and logs of the caller's runs."""
    manager = state.manager

    @app.get("/v1/runs", response_model=schemas.RunList, operation_id="listRuns", tags=["runs"],
             responses=schemas.ERRORS)
    def list_runs(principal: Auth, status: Annotated[Status | None, Query(description="Only runs in this status")] = None
                  ) -> dict[str, Any]:
        """The caller's runs, newest first."""
        recs = manager.registry.list(owner=principal.name, statuses=(status,) if status else None)
        return {"runs": [manager.summary(r) for r in recs]}

    @app.get("/v1/pools", response_model=schemas.PoolList, operation_id="listPools", tags=["pools"],
             responses=schemas.ERRORS)
    def list_pools(principal: Auth) -> dict[str, Any]:
        """The engine pools runs may name in ``rollout.pool``: model, engines, room, status
        (``attached`` counts every tenant's active runs; ``mine``, the caller's)."""
        runs = manager.pool_runs()
        pools = manager.pools.describe({name: len(recs) for name, recs in runs.items()})
        for pool in pools:
            pool["mine"] = sum(r.owner == principal.name for r in runs.get(pool["name"], []))
        return {"pools": pools}

    @app.get("/v1/runs/{run_id}", response_model=schemas.RunDetail, operation_id="getRun", tags=["runs"],
             responses=schemas.ERRORS)
    def get_run(run_id: str, principal: Auth) -> dict[str, Any]:
        """Status (refreshed from Ray), step, the latest metrics row and the checkpoints."""
        return manager.detail(manager.refresh(_owned(state, run_id, principal)))

    @app.get("/v1/runs/{run_id}/metrics", response_model=schemas.MetricsPage, operation_id="getRunMetrics",
             tags=["runs"], responses=schemas.ERRORS)
    def get_metrics(run_id: str, principal: Auth,
                    cursor: Annotated[int, Query(ge=0, description="Byte offset from the previous page")] = 0,
                    keys: Annotated[str | None, Query(description="Comma-separated metric keys to return")] = None,
                    ) -> dict[str, Any]:
        """Per-step metrics rows after ``cursor`` (the dashboard polls this)."""
        rec = _owned(state, run_id, principal)
        wanted = {k for k in keys.split(",") if k} | {"step"} if keys else None
        rows, next_cursor = read_metrics(Path(rec.run_dir) / "metrics.jsonl", cursor, wanted)
        return {"rows": rows, "cursor": next_cursor}

    @app.get("/v1/runs/{run_id}/logs", response_class=PlainTextResponse, operation_id="getRunLogs", tags=["runs"],
             responses=schemas.TEXT_ROUTE_ERRORS)
    async def get_logs(run_id: str, principal: Auth,
                       tail: Annotated[int | None, Query(ge=0, description="Last N lines (default from config)")] = None,
                       follow: Annotated[bool, Query(description="Keep streaming until the run ends")] = False,
                       ) -> Response:
        """The job's output (``ray job logs``): the last ``tail`` lines, then with ``follow``
        new output as it is written until the run ends."""
        rec = await run_in_threadpool(_owned, state, run_id, principal)
        text = await run_in_threadpool(state.jobs.logs, rec.id)
        lines = state.cfg.log_tail_lines if tail is None else tail
        if not follow or rec.terminal:
            return PlainTextResponse(_tail(text, lines))
        return StreamingResponse(_follow(state, rec.id, text, lines), media_type="text/plain")


async def _follow(state: ServiceState, run_id: str, text: str, lines: int) -> AsyncIterator[str]:
    yield _tail(text, lines)
    skip = len(text)  # Ray's tail stream starts at the beginning of the log: skip what we sent
    try:
        async for chunk in state.jobs.follow(run_id):
            if skip >= len(chunk):
                skip -= len(chunk)
                continue
            yield chunk[skip:]
            skip = 0
    except Exception as exc:  # the job server went away mid-stream: end the stream politely
        yield f"\n[turnrl serve: log stream ended: {exc}]\n"


def _openapi(app: FastAPI) -> dict[str, Any]:
    """FastAPI's spec plus the RunConfig schema (the submit body) and bearer security."""
    if app.openapi_schema:
        return app.openapi_schema
    spec = get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes)
    run_schema = RunConfig.model_json_schema(by_alias=True, ref_template="#/components/schemas/{model}")
    components = spec.setdefault("components", {})
    components.setdefault("schemas", {}).update(run_schema.pop("$defs", {}))
    components["schemas"]["RunConfig"] = run_schema
    components["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
    spec["security"] = [{"bearer": []}]
    app.openapi_schema = spec
    return spec
