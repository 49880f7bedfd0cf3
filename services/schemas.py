"""Response bodies of the API, with the examples /openapi.json shows."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict

_CREATED = 1795297000.0
_SUMMARY_EXAMPLE = {
    "id": "demo-3f37a1c2", "name": "demo", "owner": "alice", "status": "running", "step": 12,
    "total_steps": 40, "created_at": _CREATED, "updated_at": _CREATED + 95.2, "finished_at": None, "message": None,
}

# The body of POST /v1/runs is a RunConfig (schema: components.schemas.RunConfig).
SUBMIT_EXAMPLES = {
    "tiny": {
        "summary": "A short run of the built-in search-QA task",
        "value": {"name": "demo", "env": {"type": "search_qa"}, "train": {"steps": 40},
                  "rollout": {"group_size": 8}, "learner": {"batch_groups": 4, "lr": 2.0e-4},
                  "eval": {"num_tasks": 0}},
    },
    "defaults": {"summary": "Every default (20 steps)", "value": {"name": "defaults"}},
}


class RunSummary(BaseModel):
    """One run as listed."""

    model_config = ConfigDict(json_schema_extra={"examples": [_SUMMARY_EXAMPLE]})

    id: str
    """Run id; also the Ray job's submission id (``ray job logs <id>``)."""
    name: str
    """Name from the submitted config."""
    owner: str
    """Name of the token that submitted it."""
    status: str
    """queued (waiting for ``jobs.max_running``), pending, running, stopping, succeeded, stopped,
    failed or lost (Ray forgot the job)."""
    step: int
    """Last optimizer step in metrics.jsonl."""
    total_steps: int
    """The run's step budget (train.steps)."""
    created_at: float
    """Submission time (Unix seconds)."""
    updated_at: float
    """Last change of this record."""
    finished_at: float | None
    """When the service saw it finish."""
    message: str | None
    """Ray's message for a finished run, or why it finished while the service was down."""


class Checkpoint(BaseModel):
    name: str
    """Folder name, ``step_NNNNNN``."""
    step: int
    """Optimizer step it was saved after."""
    path: str
    """Hugging Face folder on the cluster's filesystem."""


class RunDetail(RunSummary):
    """A run with its latest metrics and checkpoints."""

    model_config = ConfigDict(json_schema_extra={"examples": [{
        **_SUMMARY_EXAMPLE, "metrics": {"step": 12, "reward/outcome_mean": 0.31, "rollout/success_rate": 0.25,
                                        "throughput/gen_tokens_per_s": 512.0, "staleness/mean": 0.5},
        "checkpoints": [{"name": "step_000010", "step": 10, "path": "/srv/turnrl/runs/demo-3f37a1c2/checkpoints/step_000010"}],
        "run_dir": "/srv/turnrl/runs/demo-3f37a1c2", "ray_submission_id": "demo-3f37a1c2", "stop_requested": False,
        "result": None, "metrics_endpoints": ["10.0.0.5:40123"]}]})

    metrics: dict[str, Any]
    """The last row of metrics.jsonl (NaN as null)."""
    checkpoints: list[Checkpoint]
    """Saved checkpoints, oldest first; a stopped run ends with its final one."""
    run_dir: str
    """Run directory on the cluster's filesystem."""
    ray_submission_id: str
    """Ray job submission id (equal to ``id``)."""
    stop_requested: bool
    """A stop was requested."""
    result: dict[str, Any] | None
    """result.json of a finished run (steps, checkpoint, interrupted, timings)."""
    metrics_endpoints: list[str]
    """host:port of the run's actor metrics endpoints while it runs (Prometheus file_sd)."""
    live_url: str | None = None
    """OpenAI base URL of the run's live endpoint (``live.enabled``), once it serves."""


class RunList(BaseModel):
    model_config = ConfigDict(json_schema_extra={"examples": [{"runs": [_SUMMARY_EXAMPLE]}]})

    runs: list[RunSummary]
    """The caller's runs, newest first."""


class Pool(BaseModel):
    """A shared engine pool (``ServiceConfig.pools``) as tenants see it."""

    name: str
    """What a run names in ``rollout.pool``."""
    model: str
    """The base model every run on it trains an adapter of (its ``policy.path``)."""
    engine: str
    """Engine type (``hf`` or ``vllm``)."""
    engines: int
    """Engine actors in the pool."""
    max_adapters: int
    """Runs it serves at once, every tenant's together."""
    attached: int
    """Active runs naming it, every tenant's."""
    learner: bool
    """Whether one learner of the pool trains every run on it (``learner.on_pool``); false:
    each run starts a learner of its own."""
    mine: int
    """Active runs of the caller naming it (``limits.max_pool_adapters`` bounds them)."""
    status: str
    """Its Ray job's status: pending, running, down (the service starts it again), or unknown
    (Ray's job server does not answer)."""
    job: str | None
    """Its Ray job's submission id."""


class PoolList(BaseModel):
    pools: list[Pool]
    """Every pool the service declares."""


class MetricsPage(BaseModel):
    """Rows of metrics.jsonl after a cursor; pass ``cursor`` back to get only newer rows."""

    model_config = ConfigDict(json_schema_extra={"examples": [{
        "rows": [{"step": 1, "throughput/gen_tokens_per_s": 1348.0, "reward/outcome_mean": 0.0}], "cursor": 1024}]})

    rows: list[dict[str, Any]]
    """One object per optimizer step (NaN as null)."""
    cursor: int
    """Byte offset to continue from."""


class FieldError(BaseModel):
    loc: str
    """Dotted key path in the RunConfig (``learner.lr``)."""
    msg: str
    """What is wrong and what is allowed."""
    type: str
    """Error kind (pydantic's type)."""


class ValidationFailed(BaseModel):
    """422: the submitted RunConfig is invalid."""

    model_config = ConfigDict(json_schema_extra={"examples": [{"detail": [
        {"loc": "learner.lr", "msg": "Input should be greater than 0", "type": "greater_than"}]}]})

    detail: list[FieldError]
    """One entry per failing key."""


class Problem(BaseModel):
    """Any other error."""

    model_config = ConfigDict(json_schema_extra={"examples": [{"detail": "run not found"}]})

    detail: str
    """What went wrong."""


class Health(BaseModel):
    model_config = ConfigDict(json_schema_extra={"examples": [{"status": "ok", "ray": {"address": "http://127.0.0.1:8265", "up": True}}]})

    status: str
    """``ok``, or ``degraded`` while the Ray job server does not answer."""
    ray: dict[str, Any]
    """Job server address and whether it answered."""


# 422 on every route: a bad or unknown query parameter (FastAPI's own HTTPValidationError shape
# is not what the service sends: its handler flattens ``loc`` to a dotted string).
BAD_QUERY = {422: {"model": ValidationFailed, "description": "Invalid or unknown query parameter"}}
ERRORS = {401: {"model": Problem, "description": "Missing or invalid bearer token"},
          404: {"model": Problem, "description": "No such run for this token"}, **BAD_QUERY}

# Routes whose success body is text (logs) still answer errors as JSON: say so explicitly, since
# FastAPI would document a model-only error response with the route's text/plain media type.
TEXT_ROUTE_ERRORS = {code: {"description": spec["description"], "content": {"application/json": {
    "schema": {"$ref": f"#/components/schemas/{spec['model'].__name__}"}}}} for code, spec in ERRORS.items()}
