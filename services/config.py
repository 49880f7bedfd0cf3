"""ServiceConfig: the run service's settings, loaded from YAML (``turnrl serve --config``).

pydantic only (plus yaml for loading); tokens are ``SecretStr`` so a dumped or printed config
never shows them, and may come from environment variables instead of the file.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, SecretStr, ValidationError, field_validator, model_validator

from cluster.config import PoolConfig
from envs.config import McpServerConfig, OpenEnvServerConfig

NAME_PATTERN = r"^[A-Za-z0-9._-]{1,64}$"


class TokenConfig(BaseModel):
    """One API client: a name (the owner recorded on its runs) and its bearer token."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    name: str = Field(pattern=NAME_PATTERN)
    """Principal name; runs submitted with this token belong to it."""
    token: SecretStr | None = None
    """The token itself (prefer ``token_env``, so it stays out of files)."""
    token_env: str | None = None
    """Name of an environment variable holding the token."""
    read_only: bool = False
    """May list, read and follow its runs but not submit, stop or delete (403)."""

    @model_validator(mode="after")
    def _one_source(self) -> "TokenConfig":
        if (self.token is None) == (self.token_env is None):
            raise ValueError(f"token {self.name!r}: set exactly one of token or token_env")
        return self


class AuthConfig(BaseModel):
    """Bearer tokens. Every endpoint but /healthz and /metrics needs one."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    tokens: list[TokenConfig] = []
    """Tokens from the config file (or pointing at environment variables)."""
    tokens_env: str | None = "TURNRL_SERVICE_TOKENS"
    """Environment variable with more tokens: ``name=token[,name=token...]``; a name ending
    in ``:ro`` (``viewer:ro=...``) is read-only. Unset or empty adds none."""
    min_token_length: int = Field(16, ge=1)
    """Shorter tokens are refused at start-up (guessable)."""
    session_ttl_s: float = Field(8 * 3600, gt=0)
    """Lifetime of a dashboard login cookie. The cookie authenticates reads (GET) only."""


class LocalRayConfig(BaseModel):
    """The Ray head the service starts when ``ray.address`` is not set."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    num_cpus: int | None = Field(None, ge=1)
    """Logical CPUs of the head (None: all cores)."""
    dashboard_port: int = Field(0, ge=0, le=65535)
    """Port of the Ray dashboard and job server (0: a free port)."""
    temp_dir: str | None = None
    """Ray's temp/session directory (None: a fresh short one under /tmp; Ray's socket paths
    must stay under ~100 characters)."""
    startup_timeout_s: float = Field(90.0, gt=0)
    """Longest wait for the job server to answer after starting the head."""


class RayConfig(BaseModel):
    """Where runs execute, as Ray jobs."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    address: str | None = None
    """HTTP address of a Ray dashboard / job server (``http://head:8265``). None: start a local
    head (or reuse the one this service started before; it outlives service restarts so runs
    keep executing). Stop that head with ``turnrl serve --stop-local-ray``."""
    local: LocalRayConfig = LocalRayConfig()
    """The local head, when ``address`` is None."""


class JobsConfig(BaseModel):
    """How a run becomes a Ray job: ``python -m services.job <run dir>/run.yaml`` (``turnrl train``
    with the run's secrets read from its 0600 ``secrets.json``)."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    python: str | None = None
    """Interpreter on the Ray head that runs ``turnrl train`` (None: the service's own)."""
    working_dir: str | None = None
    """Directory the job starts in; relative paths in run configs (policy cache) resolve from
    it (None: the service's working directory)."""
    stop_signal: Literal["SIGINT", "SIGTERM"] = "SIGINT"
    """Signal ``stop`` sends the job (Ray's RAY_JOB_STOP_SIGNAL). SIGINT because ``turnrl
    train`` checkpoints on KeyboardInterrupt, and ray.init() replaces any SIGTERM handler the
    driver set with sys.exit, so SIGTERM skips the final checkpoint's bookkeeping."""
    stop_grace_s: int = Field(300, ge=1)
    """Seconds a stopping run gets to checkpoint before Ray kills it (RAY_JOB_STOP_WAIT_TIME_S)."""
    env: dict[str, str] = {}
    """Extra environment variables for every run (e.g. HF_HOME)."""
    poll_s: float = Field(2.0, gt=0)
    """How often the service refreshes the status of active runs from Ray (and starts queued
    runs as slots free)."""
    max_running: int | None = Field(None, ge=1)
    """Runs started in Ray at once, every tenant's together (pending, running or stopping). A run
    admitted beyond it waits in the service as ``queued``, in submission order, and is started
    when one ends; a queued run that is stopped never starts. None: every admitted run starts at
    once. (A queue in Ray itself, an entrypoint resource the head has too few of, cannot stop a
    run still waiting in it.)"""

    def workdir(self) -> Path:
        """Where runs start, absolute: relative paths in their configs resolve from here."""
        return Path(self.working_dir or os.getcwd()).resolve()


class RegistryConfig(BaseModel):
    """The run registry: survives service restarts."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    type: Literal["sqlite"] = "sqlite"
    """Backend (only SQLite today)."""
    path: str | None = None
    """SQLite file (None: ``<state_dir>/registry.sqlite``)."""


class RedisServerConfig(BaseModel):
    """A Redis server runs submitted over the API may keep their replay in."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    url: str = Field(pattern=r"^rediss?://")
    """``redis://host:port/db`` exactly as a submitted ``replay.url`` must spell it."""
    password_env: str | None = None
    """Environment variable (of the run's job) holding its password; the service sets
    ``replay.password_env`` to this, a submitted value is refused."""


class AdmissionConfig(BaseModel):
    """What a RunConfig submitted over the API may reach (``turnrl train`` on the command line
    is not restricted). Everything not listed here is refused with 422, naming the field and
    what is allowed. Paths are resolved (``..``, symlinks, relative to ``jobs.working_dir``)
    before they are compared with a root."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    model_roots: list[str] = []
    """Directories models may be read from (``policy.path``, ``rewards.prm.path``,
    ``rewards.prm.train.init_from``, ``env.data.dense_model_path``). Empty: only
    ``builtin:tiny`` and ``hub_models``."""
    data_roots: list[str] = []
    """Directories data files may be read from (``env.data.*_path``, ``env.train_path``,
    ``env.heldout_path``); data fields take local paths (``file://`` too), never other URLs.
    Tool-use data files carry Python tool source that runs in a sandbox that is no security
    boundary: list only directories whose files you trust."""
    hub_models: list[str] = []
    """Hugging Face hub ids a model field may name (``Qwen/Qwen2.5-0.5B-Instruct``); fetched
    with the service user's HF cache and network settings. Any other value is a path (it must
    exist under ``model_roots``): nothing else is ever looked up on the hub."""
    storage_urls: list[str] = []
    """URL prefixes (``s3://team-models/released``, ``https://models.example.com/turnrl``) the
    model fields the runtime reads through storage (``policy.path``, ``rewards.prm.path``,
    ``rewards.prm.train.init_from``) may name: same scheme and host or bucket, path inside the
    prefix's. ``file://`` URLs are checked as paths (against the roots); loopback and
    link-local hosts are refused here and in values. Empty (the default): no URLs."""
    judge_functions: list[str] = []
    """``package.module:name`` callables a generative judge may use (``rewards.prm.function``
    with ``backend: callable``). Each runs as the service's user, with the run's prompts: list
    only functions you wrote or trust. Empty (the default): no callable judge."""
    redis_servers: list[RedisServerConfig] = []
    """Remote Redis servers ``replay.url`` may name. ``embedded`` (a redis-server of the run's
    own, data in its run directory) is always allowed."""
    env_sources: list[str] = []
    """``package.module:name`` environment sources a run's ``env.source`` (``env.type: custom``)
    may name. Each runs as the service's user in the run's actors: list only code you wrote or
    trust. Empty (the default): no custom environments."""
    verifiers_envs: list[str] = []
    """verifiers environment ids a run's ``env.id`` (``env.type: verifiers``) may name. Each
    module's ``load_environment`` and its rollouts run as the service's user in the run's
    actors: list only environments you installed and trust. Empty (the default): none."""
    mcp_servers: list[McpServerConfig] = []
    """MCP servers a run's ``env.mcp`` may name (by ``name`` alone): the command, arguments,
    environment or URL and ``stateful`` are these entries', never the submitter's (who may narrow
    ``tools`` and set ``call_timeout_s``). A stdio server runs as the service's user inside the
    run's actors: list only servers you trust. Empty (the default): no MCP servers."""
    openenv_servers: list[OpenEnvServerConfig] = []
    """OpenEnv environment servers a run's ``env.server`` (``env.type: openenv``) may name, by
    ``name`` alone: what runs or is reached is these entries'. Empty (the default): none."""
    redis_server_binary: str = "redis-server"
    """The redis-server executable embedded replay starts (``replay.server_binary``): the
    operator's choice only; a submitted ``replay.server_binary`` that differs is refused."""
    cache_dir: str | None = None
    """Where each tenant's built policies and search indexes are cached, in a subdirectory per
    token name (``<cache_dir>/<name>/policies``, ``.../search_index``) shared by that tenant's
    runs only. None: each run caches inside its own directory (rebuilt by every run)."""

    @model_validator(mode="after")
    def _check_servers(self) -> AdmissionConfig:
        for field in ("mcp_servers", "openenv_servers"):
            names = [m.name for m in getattr(self, field)]
            if len(set(names)) != len(names):
                raise ValueError(f"{field} names a server twice ({names})")
            unset = [m.name for m in getattr(self, field) if not m.launchable()]
            if unset:
                raise ValueError(f"{field} {unset}: give each a command or a url")
        return self


class LimitsConfig(BaseModel):
    """What one tenant (token name) may use; a submission over a limit is refused naming it."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    @model_validator(mode="before")
    @classmethod
    def _removed(cls, data: Any) -> Any:
        from rollout.config import PUSHED, refuse_removed

        return refuse_removed(data, "limits", {"min_poll_s": f"nothing polls for weights any more: {PUSHED}"})

    max_concurrent_runs: int = Field(4, ge=1)
    """Runs queued, pending, running or stopping at once (429 beyond)."""
    max_steps: int = Field(100_000, ge=1)
    """Largest ``train.steps`` (422 beyond)."""
    max_actors: int = Field(32, ge=1)
    """Most Ray actors one run may start (rollout workers, env actors, learner, replay, reward
    service, weight sync, reward scorers and judges)."""
    max_cpus: float = Field(16.0, gt=0)
    """Most Ray CPUs one run's actors may reserve together."""
    max_gpus: int = Field(0, ge=0)
    """Most GPUs one run may use: each engine counts its ``rollout.engine.num_gpus`` (an ``hf``
    engine whose ``device`` is not ``cpu`` at least one, a ``vllm`` engine at least its
    ``tensor_parallel_size`` when that is above 1), each learner rank its ``learner.num_gpus``.
    0 (the default): CPU-only runs. Actors that reserve no GPU see none
    (``CUDA_VISIBLE_DEVICES`` is empty for them)."""
    max_sft_steps: int = Field(2_000, ge=1)
    """Largest ``policy.sft.steps`` (the builtin policy's SFT, before training starts)."""
    max_tokens: int = Field(65_536, ge=1)
    """Largest token count of one sequence, request or pass: ``rollout.max_new_tokens`` and
    ``max_context_tokens``, ``live.default_max_tokens`` and ``max_context_tokens``, vLLM's
    ``max_model_len``, hf's ``score_batch_tokens``, ``rewards.ig.token_budget``,
    ``policy.tiny.max_positions``."""
    max_batch: int = Field(1_024, ge=1)
    """Largest count of sequences, groups or requests held or processed together (group size,
    groups in flight, learner batch and micro-batch, epochs and mini-batches, SFT batch,
    engine batches and concurrency, reward batches and queues, replay capacities, eval samples
    per task, history windows)."""
    max_items: int = Field(100_000, ge=1)
    """Largest count of tasks, demos, sessions or iterations (``env.num_*_tasks``,
    ``policy.sft.num_demos``, ``eval.num_tasks``, ``eval.bootstrap_resamples``,
    ``sinkhorn_iters``, ``live.max_sessions``, trajectory balance's ``max_tasks``)."""
    max_threads: int = Field(8, ge=1)
    """Largest ``torch_threads`` of any actor (rollout, engine, learner, reward scorers)."""
    max_wait_s: float = Field(3_600.0, gt=0)
    """Longest timeout or wait any setting asks for (``*_timeout_s``,
    ``retry_s``, ``batch_wait_ms``, ``join_wait_ms``...): a wait holds its resources idle."""
    max_restarts: int = Field(10, ge=0)
    """Most restarts any actor kind may have (``*.max_restarts``, ``cluster.service_max_restarts``)."""
    max_memory_gib: float = Field(16.0, gt=0)
    """Most memory the run's settings reserve together: engine KV caches (``count`` x vLLM
    ``cpu_kv_cache_gib`` or hf ``prefix_cache_mib``), ``replay.capacity_bytes`` and
    ``rollout.weights.bucket_mib``."""
    max_pool_adapters: int = Field(2, ge=1)
    """Runs (adapters) one tenant may have on one engine pool at once (429 beyond); the
    pool's own ``max_adapters`` bounds all tenants together."""
    max_tiny_params: int = Field(50_000_000, ge=1)
    """Most parameters of the builtin policy (``policy.tiny``) the run builds and trains by SFT."""


class ServiceConfig(BaseModel):
    """``turnrl serve``: the REST API, dashboard and metrics endpoint."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    host: str = "127.0.0.1"
    """Interface to listen on."""
    port: int = Field(8321, ge=0, le=65535)
    """Port to listen on (0: a free port, printed at start-up)."""
    state_dir: str = "runs/service"
    """Where the service keeps its registry and local-Ray state."""
    runs_dir: str | None = None
    """Parent of the run directories (None: ``<state_dir>/runs``). Must be visible to the Ray
    head's filesystem at the same path."""
    registry: RegistryConfig = RegistryConfig()
    """Run registry."""
    prometheus_sd_dir: str | None = None
    """Directory where the service mirrors every active run's ``prometheus_targets.json`` as
    ``<run id>.json``, for a Prometheus ``file_sd_configs`` glob (None: ``<state_dir>/prometheus``)."""
    auth: AuthConfig = AuthConfig()
    """Bearer tokens."""
    ray: RayConfig = RayConfig()
    """Ray cluster."""
    jobs: JobsConfig = JobsConfig()
    """Ray job settings for runs."""
    max_body_bytes: int = Field(1 << 20, ge=1024)
    """Largest request body accepted (413 beyond)."""
    log_tail_lines: int = Field(200, ge=1)
    """Lines GET /v1/runs/{id}/logs returns when ``tail`` is not given."""
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    """Service log level (uvicorn's too)."""
    admission: AdmissionConfig = AdmissionConfig()
    """What submitted run configs may reach: model and data roots, judge callables, Redis
    servers, executables, caches (docs/services.md, "Security model")."""
    limits: LimitsConfig = LimitsConfig()
    """Per-tenant limits, for every token name."""
    tenant_limits: dict[str, LimitsConfig] = {}
    """Overrides of ``limits`` by token name; only the keys written replace the defaults."""
    pools: dict[str, PoolConfig] = {}
    """Shared engine pools by name: engines of one base model that the service starts as Ray
    jobs of their own and LoRA runs attach to (``rollout.pool``) instead of starting engines;
    each run trains and serves its own adapter on them (docs/tenants.md). Empty: none."""

    @field_validator("pools")
    @classmethod
    def _pool_names(cls, pools: dict[str, PoolConfig]) -> dict[str, PoolConfig]:
        bad = [name for name in pools if not re.fullmatch(NAME_PATTERN, name)]
        if bad:
            raise ValueError(f"pool names {bad}: use letters, digits, '.', '_' and '-' (at most 64)")
        return pools

    def limits_for(self, owner: str) -> LimitsConfig:
        override = self.tenant_limits.get(owner)
        if override is None:
            return self.limits
        return self.limits.model_copy(update=override.model_dump(exclude_unset=True))

    def state_path(self) -> Path:
        return Path(self.state_dir).resolve()

    def runs_path(self) -> Path:
        return Path(self.runs_dir).resolve() if self.runs_dir else self.state_path() / "runs"

    def prometheus_sd_path(self) -> Path:
        return Path(self.prometheus_sd_dir).resolve() if self.prometheus_sd_dir else self.state_path() / "prometheus"

    def registry_path(self) -> Path:
        return Path(self.registry.path).resolve() if self.registry.path else self.state_path() / "registry.sqlite"


class ServiceConfigError(ValueError):
    """A service config problem, phrased as key path + reason."""


def load_service_config(path: str | Path | None, overrides: list[str] = ()) -> ServiceConfig:
    """Read YAML (defaults when ``path`` is None) and apply ``key.path=value`` overrides."""
    from cluster.config import ConfigError, apply_overrides, format_validation_error

    tree: dict = {}
    if path is not None:
        try:
            tree = yaml.safe_load(Path(path).read_text()) or {}
        except (OSError, yaml.YAMLError) as exc:
            raise ServiceConfigError(f"{path}: {exc}") from None
        if not isinstance(tree, dict):
            raise ServiceConfigError(f"{path}: top level must be a mapping")
    try:
        return ServiceConfig.model_validate(apply_overrides(tree, list(overrides)))
    except ConfigError as exc:
        raise ServiceConfigError(str(exc)) from None
    except ValidationError as exc:
        raise ServiceConfigError(format_validation_error(exc).replace("invalid config", "invalid service config")) from None
