"""RunConfig: one pydantic model for a whole training job, loaded from YAML.

``load_config(path, overrides)`` applies ``--set a.b=c`` overrides (values parsed as YAML)
before validation, and turns pydantic errors into messages naming the key path and what is
allowed. Imports only pydantic, yaml and the component config modules (no torch, no Ray).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from envs.config import EnvConfig, SearchQAConfig
from gateway.config import LiveConfig
from learner.config import LLAMA_LINEAR_MODULES, LearnerConfig, PolicyConfig
from replay.config import ReplayConfig
from rewards.config import RewardsConfig
from rollout.config import EngineConfig, HFEngineConfig, RolloutConfig


class ClusterConfig(BaseModel):
    """Where the actors run."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    address: str | None = None
    """Ray address to join; None starts a local cluster (or joins RAY_ADDRESS when set)."""
    num_cpus: int | None = None
    """CPUs of the local cluster (None: all)."""
    cpu_affinity: list[int] | None = None
    """Cores a local cluster this run starts runs on: Ray's daemons, the driver, and every
    actor without a ``cpu_affinity`` of its own (reward service, environments, replay host).
    With the engine, rollout and learner pinned too, this says where the glue between them
    runs: on a small machine, put it with generation so the learner's cores stay its own.
    None: every core. Not allowed with ``address`` (a joined cluster's nodes are set up by
    whoever started them)."""
    services_cpu_affinity: list[int] | None = None
    """Cores the run's services run on: the replay host, the weight sync and the reward
    service's front (its scorers and judges stay on ``cpu_affinity``), on whichever node each
    runs. None: where ``cpu_affinity`` puts them. Their work (scoring, puts, claims, weight
    hand-offs) is the glue an async step must fit beside generation or training; on a small
    machine put it with the side that has slack, and Ray's daemons and the driver with the
    other (``bench/pipeline.py --glue split``)."""
    reward_num_cpus: float = Field(0.25, gt=0)
    """Ray CPUs for the reward actor."""
    replay_num_cpus: float = Field(0.25, gt=0)
    """Ray CPUs for the replay actor."""
    service_resources: dict[str, float] = {}
    """Ray custom resources each of the run's one-of-a-kind services asks for (replay host,
    weight sync, reward front and its scorers/judges, live gateway), e.g. ``{head_node:
    0.01}`` with ``ray start --head --resources='{"head_node": 1}'``: keeps them on a node that
    stays while worker nodes come and go. Engines, rollout, environment and learner actors
    have their own ``resources``."""
    service_max_restarts: int = Field(3, ge=0)
    """Times the weight sync, and the replay host of Redis replay, are started again after
    their process dies (kill -9, their node lost): a restarted sync gets the learner's
    current weights again, a restarted host finds the groups in Redis. The in-process replay
    store dies with its host (its groups lived there): that run ends naming the replay host,
    and ``turnrl train --resume`` continues it from its last checkpoint."""
    storage: str | None = None
    """Where the run's folders live for every node: an fsspec URL (``s3://bucket/turnrl``,
    ``gs://...``, ``file:///mnt/shared``). The policy folder is uploaded once under
    ``<storage>/policies/`` and each node's actors copy it to a cache of their own; checkpoints
    and run state go to ``<storage>/runs/<name>/``, from where ``--resume`` continues on any
    node. None: everything stays in the run directory (one node, or a filesystem every node
    mounts)."""


class EvalConfig(BaseModel):
    """Held-out evaluation before and after training."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    num_tasks: int = Field(200, ge=0)
    """Held-out tasks evaluated (0 disables evaluation)."""
    temperature: float = Field(1.0, ge=0)
    """Sampling temperature (0 = greedy). Default: the training temperature."""
    samples_per_task: int = Field(1, ge=1)
    """Rollouts per task; success is averaged per task before bootstrapping."""
    every_steps: int = Field(0, ge=0)
    """Also evaluate every N training steps (0: only before and after), logged as
    ``eval/success`` in metrics.jsonl for learning curves; the last step's weights are
    evaluated once, by the evaluation after training (eval.json). Every evaluation's rows per
    task go to evals.jsonl."""
    bootstrap_resamples: int = Field(2000, ge=100)
    """Resamples of the paired bootstrap interval of the success difference."""


class TrainConfig(BaseModel):
    """The run's length and schedule."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True, populate_by_name=True)

    steps: int = Field(20, ge=1)
    """Optimizer steps (the step budget)."""
    async_: bool = Field(True, alias="async")
    """True: generation and training overlap. False: they alternate (for comparison)."""
    seed: int = 0
    """Seed for task order and sampling."""
    source: Literal["rollout", "live", "mixed"] = "rollout"
    """What the learner trains on: ``rollout`` (groups the rollout workers generate in the
    environment), ``live`` (sessions served through the live endpoint, ``live.enabled``; no
    rollout loop runs) or ``mixed`` (every batch holds a fixed share of live sessions,
    ``live_fraction``, and rollout groups for the rest; the learner waits for both)."""
    live_fraction: float = Field(0.5, gt=0.0, lt=1.0)
    """``mixed`` only: the share of each batch's ``learner.batch_groups`` that are live
    sessions, rounded to a whole number of groups between 1 and batch_groups - 1."""

    def live_groups(self, batch_groups: int) -> int:
        """Live sessions in every batch of ``batch_groups`` groups."""
        if self.source == "live":
            return batch_groups
        if self.source == "mixed":
            return min(max(round(self.live_fraction * batch_groups), 1), batch_groups - 1)
        return 0


class PoolLearnerConfig(BaseModel):
    """A pool's learner (``cluster.pool_learner``): one process that holds the pool's base
    model once and trains an adapter slot per attached run (``learner.on_pool``), several
    runs' micro-batches through one base pass when their batches are ready together."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    target_modules: list[str] = Field(default_factory=lambda: list(LLAMA_LINEAR_MODULES), min_length=1)
    """The layers every run's adapter adapts (a run's ``learner.lora.target_modules`` must
    name these)."""
    coalesce_s: float = Field(0.5, ge=0, le=60)
    """How long a ready run's step waits for other runs' batches to train with it in one pass
    (the most any run waits for others)."""
    num_cpus: float = Field(1.0, gt=0)
    """Ray CPUs of the learner's process."""
    num_gpus: float = Field(0.0, ge=0)
    """Ray GPUs of the learner's process (the base model and every slot live on it)."""
    resources: dict[str, float] = {}
    """Custom Ray resources it reserves (e.g. a node label)."""
    torch_threads: int = Field(2, ge=1)
    """Intra-op threads of the learner."""
    max_restarts: int = Field(3, ge=-1)
    """Times Ray starts the learner again after its process died (-1: always); each attached
    run then attaches again from its own last checkpoint."""


class PoolConfig(BaseModel):
    """One shared engine pool (``cluster.pool``): engines of one base model that LoRA runs
    attach to, declared in the run service's ``pools``."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    model: str = Field(min_length=1)
    """The base model every run on the pool trains an adapter of: a Hugging Face folder, a hub
    id, or ``builtin:smollm2``. Runs naming the pool get it as their ``policy.path``."""
    engine: EngineConfig = HFEngineConfig()
    """The pool's engines (``type``, ``count``, resources; vLLM needs ``max_loras`` >= 1, and
    ``max_lora_rank`` bounds the runs' ``learner.lora.rank``). Runs naming the pool get it as
    their ``rollout.engine``."""
    max_adapters: int = Field(8, ge=1)
    """Runs attached at once; the service refuses one more (429) and the pool too."""
    max_running: int = Field(64, ge=1)
    """Requests one engine runs at once, all adapters together (more wait their turn)."""
    max_running_per_adapter: int = Field(16, ge=1)
    """Requests one engine runs at once for one adapter (one run): a run flooding the pool
    waits for its own requests, never for others'. A freed slot goes to the adapter with the
    fewest requests running."""
    num_cpus: float = Field(0.0, ge=0)
    """Ray CPUs of the pool's own actor (it only answers runs attaching and watches them)."""
    watch_s: float = Field(5.0, gt=0)
    """How often the pool checks that each attached run's weight sync lives; a run killed
    without detaching loses its adapter within this."""
    learner: PoolLearnerConfig | None = None
    """One learner for every run on the pool (``learner.on_pool``; the run service sets it for
    runs naming this pool); None: each run starts a learner of its own (docs/tenants.md)."""

    @model_validator(mode="after")
    def _serves_adapters(self) -> "PoolConfig":
        if self.model == "builtin:tiny":
            raise ValueError("model: builtin:tiny is built per run (SFT on the run's environment); give a pool "
                             "a model folder (a run's policy_cache folder, or `turnrl models convert`)")
        if self.engine.type == "vllm" and not self.engine.max_loras:
            raise ValueError("engine.max_loras: a pool serves LoRA adapters; vLLM needs max_loras >= 1 "
                             "(each adapter version in a batch takes one)")
        return self


class RunConfig(BaseModel):
    """A TurnRL training job."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    name: str = "run"
    """Run name; the run directory is ``output_dir/name``."""
    output_dir: str = "runs"
    """Parent of run directories."""
    policy: PolicyConfig = PolicyConfig()
    """The model trained."""
    env: EnvConfig = SearchQAConfig()
    """Environment, selected by ``type``."""
    rollout: RolloutConfig = RolloutConfig()
    """Rollout actors."""
    rewards: RewardsConfig = RewardsConfig()
    """Reward sources and their weights."""
    replay: ReplayConfig = ReplayConfig()
    """Replay store."""
    learner: LearnerConfig = LearnerConfig()
    """DeepSpeed learner."""
    train: TrainConfig = TrainConfig()
    """Schedule."""
    eval: EvalConfig = EvalConfig()
    """Held-out evaluation."""
    cluster: ClusterConfig = ClusterConfig()
    """Ray placement."""
    live: LiveConfig = LiveConfig()
    """The OpenAI-compatible endpoint that serves the policy while it trains (off by default)."""
    progress: Literal["bar", "log", "none"] = "bar"
    """Console progress: a live bar, one log line per step, or nothing."""

    @model_validator(mode="after")
    def _broadcast_reaches_every_weights_reader(self) -> "RunConfig":
        ig = self.rewards.ig
        if self.rollout.weights.transport == "broadcast" and ig is not None and ig.scorer == "model":
            raise ValueError("rollout.weights.transport=broadcast sends weights to the engines only, but "
                             "rewards.ig.scorer=model loads every version into the reward scorers' own copy: "
                             "set rewards.ig.scorer=engine, or rollout.weights.transport=object_store or file")
        return self

    @model_validator(mode="after")
    def _adapters_are_served(self) -> "RunConfig":
        lora, ig = self.learner.lora, self.rewards.ig
        if lora is None or lora.publish != "adapter":
            return self
        engine = self.rollout.engine
        if engine.type == "vllm" and not engine.max_loras:
            raise ValueError("learner.lora.publish=adapter needs engines that serve LoRA adapters, but "
                             "rollout.engine.max_loras=0 turns vLLM's off: set rollout.engine.max_loras=1 (or "
                             "more), or learner.lora.publish=merged")
        if engine.type == "vllm" and self.rollout.weights.transport == "broadcast":
            raise ValueError("learner.lora.publish=adapter on the vLLM engine reads each adapter version in the "
                             "engine's own process, where rollout.weights.transport=broadcast does not reach "
                             "(vLLM's workers receive it): set rollout.weights.transport=object_store or file")
        if engine.type == "vllm" and lora.rank > engine.max_lora_rank:
            raise ValueError(f"learner.lora.rank={lora.rank} is above rollout.engine.max_lora_rank="
                             f"{engine.max_lora_rank}, the highest rank the vLLM engine serves: raise it")
        if ig is not None and ig.scorer == "model":
            raise ValueError("learner.lora.publish=adapter publishes the adapter alone, but rewards.ig.scorer="
                             "model scores with whole weights: set rewards.ig.scorer=engine (scored by the "
                             "engines, with the adapter), or learner.lora.publish=merged")
        return self

    @model_validator(mode="after")
    def _pool_runs_train_an_adapter(self) -> "RunConfig":
        if self.rollout.pool is None:
            if self.learner.on_pool:
                raise ValueError("learner.on_pool: a pool's learner trains runs on its pool; set rollout.pool to "
                                 "the pool's name, or learner.on_pool=false")
            return self
        lora = self.learner.lora
        if lora is None or lora.publish != "adapter":
            raise ValueError(f"rollout.pool={self.rollout.pool!r}: a run on a shared engine pool trains and "
                             "publishes a LoRA adapter, which the pool's engines serve beside other runs': set "
                             "learner.lora (with publish: adapter), or remove rollout.pool")
        if self.rollout.weights.transport == "broadcast":
            raise ValueError("rollout.pool: a pool's engines join no run's weight broadcast group: set "
                             "rollout.weights.transport=object_store or file")
        if self.live.model_name != type(self.live).model_fields["model_name"].default:  # survives a dump
            raise ValueError("live.model_name: the endpoint of a run on an engine pool serves the run's adapter, "
                             "named for the run (its name; the run id over the run service): remove it")
        return self

    @model_validator(mode="after")
    def _live_source_is_served(self) -> "RunConfig":
        if self.train.source == "rollout":
            return self
        if not self.live.enabled:
            raise ValueError(f"train.source={self.train.source!r} trains on served sessions: set "
                             "live.enabled=true, or train.source=rollout")
        if not self.train.async_:
            raise ValueError(f"train.source={self.train.source!r} needs train.async=true (sync mode "
                             "collects rollouts between steps; live sessions arrive on their own)")
        if self.train.source == "mixed" and self.learner.batch_groups < 2:
            raise ValueError("train.source=mixed needs learner.batch_groups >= 2 (one live group "
                             "and one rollout group at least)")
        return self


class ConfigError(ValueError):
    """A config problem, phrased as key path + what is allowed."""


def _set_path(tree: dict[str, Any], dotted: str, value: Any) -> None:
    node = tree
    parts = dotted.split(".")
    for i, part in enumerate(parts[:-1]):
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"--set {dotted}: '{'.'.join(parts[: i + 1])}' is not a section")
        node = child
    node[parts[-1]] = value


def apply_overrides(tree: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply ``key.path=value`` strings; values are parsed as YAML (``3``, ``true``, ``[1,2]``)."""
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"--set {item!r}: expected key.path=value")
        _set_path(tree, key.strip(), yaml.safe_load(raw) if raw.strip() else "")
    return tree


def format_validation_error(exc: ValidationError) -> str:
    lines = []
    for err in exc.errors():
        loc = ".".join(str(p) for p in err["loc"] if not str(p).startswith("function-after"))
        detail = err["msg"]
        if err["type"] == "extra_forbidden":
            detail = "unknown key (check spelling; see `turnrl train --help` for the schema)"
        elif err["type"] == "union_tag_invalid":
            detail = f"{err['msg']}"
        lines.append(f"  {loc or '<root>'}: {detail}")
    return "invalid config:\n" + "\n".join(lines)


# Sections selected by a `type` discriminator: a partial section without `type` means the
# default's type, so `--set env.seed=3` works without also writing `--set env.type=search_qa`.
_TYPED_SECTIONS = ("env", "learner.estimator", "learner.loss", "rollout.engine")


def _fill_default_types(tree: dict[str, Any]) -> None:
    defaults = RunConfig()
    for dotted in _TYPED_SECTIONS:
        node: Any = tree
        default: Any = defaults
        for part in dotted.split("."):
            node = node.get(part) if isinstance(node, dict) else None
            default = getattr(default, part)
        if isinstance(node, dict) and "type" not in node:
            node["type"] = default.type


def build_config(tree: dict[str, Any]) -> RunConfig:
    _fill_default_types(tree)
    try:
        return RunConfig.model_validate(tree)
    except ValidationError as exc:
        raise ConfigError(format_validation_error(exc)) from None


def load_config(path: str | Path | None, overrides: list[str] = ()) -> RunConfig:
    """Read YAML (or start from defaults when ``path`` is None) and apply overrides."""
    tree: dict[str, Any] = {}
    if path is not None:
        try:
            tree = yaml.safe_load(Path(path).read_text()) or {}
        except FileNotFoundError:
            raise ConfigError(f"config file not found: {path}") from None
        except yaml.YAMLError as exc:
            raise ConfigError(f"{path}: not valid YAML: {exc}") from None
        if not isinstance(tree, dict):
            raise ConfigError(f"{path}: top level must be a mapping of sections")
    return build_config(apply_overrides(tree, list(overrides)))
