"""Admission of runs submitted over the API: what a RunConfig may reach, and tenant limits.

``RULES`` is the one list of RunConfig fields that can name code, an executable, a file, a
directory or a host, each with the check it gets; ``tests/test_services_admission.py`` walks the
RunConfig schema and fails on any free-text or path-like field missing from it, so a new field
cannot slip past unclassified. ``Admission.admit`` walks a validated config with these rules
against the operator's ``admission`` section and returns the config the run will execute, with
what the service decides filled in (run directory, caches, redis-server binary), or raises
``InvalidRunConfig`` listing every refused field and what is allowed. Paths are resolved
(``..``, symlinks, relative to the job's working directory) before they are compared with a
root. ``turnrl train`` on the command line never comes through here.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

from pydantic import BaseModel

from cluster.config import ConfigError, RunConfig, build_config
from services.config import LimitsConfig, ServiceConfig, ServiceConfigError
from services.secrets import secret_fields
from storage.places import PlaceError, check_prefix, classify, exists, local_dir, under_prefix


class InvalidRunConfig(ValueError):
    """422: one entry per refused field, ``{"loc", "msg", "type"}``."""

    def __init__(self, errors: list[dict[str, str]]) -> None:
        super().__init__("; ".join(f"{e['loc']}: {e['msg']}" for e in errors))
        self.errors = errors


class TooManyRuns(RuntimeError):
    """429: the tenant already has ``max_concurrent_runs`` active runs."""


@dataclass(frozen=True)
class Rule:
    kind: str
    """service | model | data | write | callable | executable | redis_url | redis_password |
    env_overrides | inert (see ``KINDS``)."""
    why: str = ""
    """For ``inert`` and ``service``: what the value is, and why it reaches nothing."""
    also: tuple[str, ...] = ()
    """Literal values allowed besides what the kind allows (``builtin:tiny``)."""
    cache: str | None = None
    """For ``write``: the subdirectory of the tenant cache it defaults to when not submitted."""
    hub: bool = True
    """For ``model``: the runtime may fetch an ``admission.hub_models`` id here (the dense
    retriever loads local folders only)."""
    urls: bool = False
    """For ``model`` and ``data``: the runtime also reads ``scheme://`` URLs here
    (``storage.local_model``), so one under ``admission.storage_urls`` is allowed."""
    allowlist: str = ""
    """For ``server``, ``launch`` and ``callable``: the ``admission`` list of what the operator
    allows there (servers of this kind, functions)."""


KINDS = {
    "service": "set by the service; a submitted value is replaced",
    "model": "a model read: a listed hub id, an existing path under admission.model_roots or (where the "
             "runtime reads URLs) a URL under admission.storage_urls",
    "data": "a file read: an existing path under admission.data_roots",
    "write": "a directory written: a relative path, placed inside the run's own directory",
    "callable": "code: one of the operator's (admission.judge_functions, admission.env_sources, "
                "admission.verifiers_envs)",
    "executable": "a program: admission's, never a submitted one",
    "redis_url": "a host: 'embedded' or one of admission.redis_servers",
    "redis_password": "an environment variable: the matched admission.redis_servers entry's",
    "env_overrides": "environment keys: checked as the environment config they produce",
    "server": "an external server (MCP, OpenEnv): one of the operator's, by name; their entry says what runs",
    "launch": "what an external server runs or reaches: the operator's entry, never submitted",
    "inert": "text that names no code, file or host",
}

# Keyed "<pydantic class>.<field>": a class is checked wherever it is nested.
RULES: dict[str, Rule] = {
    "RunConfig.name": Rule("service", "becomes the run id"),
    "RunConfig.output_dir": Rule("service", "the service's runs_dir"),
    "ClusterConfig.address": Rule("service", "the job joins the service's Ray cluster"),
    "ClusterConfig.storage": Rule("service", "runs keep their folders in the service's runs_dir"),
    "RolloutConfig.resources": Rule("inert", "custom Ray resource names -> amounts: which nodes may host the "
                                             "actors; no code, file or host"),
    "HFEngineConfig.resources": Rule("inert", "custom Ray resource names -> amounts (see RolloutConfig)"),
    "VLLMEngineConfig.resources": Rule("inert", "custom Ray resource names -> amounts (see RolloutConfig)"),
    "EnvActorsConfig.resources": Rule("inert", "custom Ray resource names -> amounts (see RolloutConfig)"),
    "LearnerConfig.resources": Rule("inert", "custom Ray resource names -> amounts (see RolloutConfig)"),
    "ClusterConfig.service_resources": Rule("inert", "custom Ray resource names -> amounts (see RolloutConfig)"),
    "LoRAConfig.target_modules": Rule("inert", "module names matched against the policy's linear layers "
                                               "(a list: peft compares names, never compiles a pattern)"),
    "PolicyConfig.path": Rule("model", also=("builtin:tiny", "builtin:smollm2"), urls=True),
    "PolicyConfig.cache_dir": Rule("write", cache="policies"),
    "PolicyConfig.models_dir": Rule("write", cache="models"),
    "SFTConfig.env": Rule("env_overrides"),
    "SearchDataConfig.train_path": Rule("data"),
    "SearchDataConfig.heldout_path": Rule("data"),
    "SearchDataConfig.corpus_path": Rule("data"),
    "SearchDataConfig.dense_model_path": Rule("model", hub=False),
    "SearchDataConfig.index_cache_dir": Rule("write", cache="search_index"),
    "ToolUseConfig.train_path": Rule("data"),
    "ToolUseConfig.heldout_path": Rule("data"),
    "RolloutConfig.chat_format": Rule("inert", "a name in the chat format registry (envs.formats), checked "
                                      "against it when the config is read"),
    "HFEngineConfig.device": Rule("inert", "a torch device; non-cpu devices count against limits.max_gpus"),
    "IGConfig.prefix": Rule("inert", "text put before the gold answer"),
    "IGConfig.suffix": Rule("inert", "text put after the gold answer"),
    "PRMConfig.path": Rule("model", urls=True),
    "PRMConfig.good_token": Rule("inert", "a token's text"),
    "PRMConfig.bad_token": Rule("inert", "a token's text"),
    "PRMTrainConfig.init_from": Rule("model", also=("policy",), urls=True),
    "JudgeConfig.path": Rule("model", urls=True),
    "JudgeConfig.function": Rule("callable", allowlist="judge_functions"),
    "CustomEnvConfig.source": Rule("callable", allowlist="env_sources"),
    "CustomEnvConfig.args": Rule("inert", "keyword arguments of an operator's environment source"),
    "VerifiersConfig.id": Rule("callable", allowlist="verifiers_envs"),
    "VerifiersConfig.args": Rule("inert", "keyword arguments of an operator's verifiers environment's loader"),
    "JudgeConfig.rubric": Rule("inert", "prompt text"),
    "RewardsConfig.weights": Rule("inert", "source name -> float"),
    "ReplayConfig.url": Rule("redis_url"),
    "ReplayConfig.password_env": Rule("redis_password"),
    "ReplayConfig.key_prefix": Rule("inert", "[A-Za-z0-9._-]+; every key also carries the run's own id"),
    "ReplayConfig.server_binary": Rule("executable"),
    "LiveConfig.host": Rule("inert", "an interface of the run's own node to listen on; off loopback it "
                                     "requires live.tokens"),
    "LiveConfig.model_name": Rule("inert", "the model id the endpoint reports"),
    "LiveConfig.tokens": Rule("inert", "bearer tokens the run's own endpoint accepts"),
    **{f"{cls}.{field}": Rule("server" if field == "name" else "launch", allowlist=servers)
       for cls, servers in (("McpServerConfig", "mcp_servers"), ("OpenEnvServerConfig", "openenv_servers"))
       for field in ("name", "command", "args", "env", "cwd", "url")},
    "OpenEnvConfig.tool_name": Rule("inert", "the name the policy calls the action tool by"),
    "OpenEnvConfig.tool_description": Rule("inert", "tool description text"),
    "OpenEnvConfig.text_field": Rule("inert", "an action field's name"),
    "OpenEnvConfig.observation_field": Rule("inert", "an observation field's name"),
    "OpenEnvConfig.system_prompt": Rule("inert", "prompt text"),
    "OpenEnvConfig.reset_args": Rule("inert", "keyword arguments of the operator's environment's own reset"),
    "McpServerConfig.tools": Rule("inert", "names of the server's tools to offer, matched against its list_tools"),
    "McpTasksConfig.train_path": Rule("data"),
    "McpTasksConfig.heldout_path": Rule("data"),
    "McpTasksConfig.system_prompt": Rule("inert", "prompt text"),
    "ReasoningGymTask.name": Rule("inert", "a reasoning-gym family name, looked up in its registry"),
    "ReasoningGymTask.config": Rule("inert", "keyword arguments of the family's config dataclass (sizes, "
                                             "ranges, word lists), checked against its fields; no code, file or host"),
    "RolloutConfig.pool": Rule("inert", "the name of an engine pool the operator declared (ServiceConfig.pools), "
                                        "checked against them; the pool sets policy.path and rollout.engine"),
}


def _children(value: Any, loc: tuple[str, ...]) -> Iterator[tuple[BaseModel, tuple[str, ...]]]:
    if isinstance(value, BaseModel):
        yield value, loc
    elif isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            yield from _children(item, (*loc, str(i)))
    elif isinstance(value, dict):
        for key, item in value.items():
            yield from _children(item, (*loc, str(key)))


def sensitive_fields(model: BaseModel, loc: tuple[str, ...] = ()) -> Iterator[tuple[tuple[str, ...], str, Rule, BaseModel]]:
    """(key path, field name, rule, the model holding it) for every non-inert classified field."""
    for name, info in type(model).model_fields.items():
        here = (*loc, info.alias or name)
        rule = RULES.get(f"{type(model).__name__}.{name}")
        if rule is not None and rule.kind != "inert":
            yield here, name, rule, model
        for child, child_loc in _children(getattr(model, name), here):
            yield from sensitive_fields(child, child_loc)


def _has(tree: Any, loc: tuple[str, ...]) -> bool:
    for part in loc:
        if isinstance(tree, list) and part.isdigit() and int(part) < len(tree):
            tree = tree[int(part)]
        elif isinstance(tree, dict) and part in tree:
            tree = tree[part]
        else:
            return False
    return True


def _set(tree: dict[str, Any], loc: tuple[str, ...], value: Any) -> None:
    """Set ``value`` at ``loc`` (a list's items by their index), making the sections missing."""
    node: Any = tree
    for part in loc[:-1]:
        node = node[int(part)] if isinstance(node, list) else node.setdefault(part, {})
    node[loc[-1]] = value


def _within(path: Path, root: Path) -> bool:
    return path == root or root in path.parents


def _resolve(value: str, base: Path) -> Path | None:
    """Absolute, ``..`` and symlinks resolved; None for what is no path (a NUL byte)."""
    try:
        return (base / value).resolve()  # an absolute value replaces base
    except (ValueError, OSError, RuntimeError):  # NUL byte, symlink loop
        return None


def demand(cfg: RunConfig) -> dict[str, float]:
    """Ray actors, CPUs and GPUs the run asks for: the actors ``cluster.actors.start_actors``
    and ``cluster.reward_service.start_reward_service`` create, with their resources."""
    from cluster.actors import own_engines, own_learner_ranks, run_cpus
    from cluster.reward_service import reward_pools

    sc, ro = cfg.rewards.service, cfg.rollout
    scorers, judges = reward_pools(cfg)
    cpus = run_cpus(cfg) + scorers * sc.scorer_num_cpus + judges * sc.judge_num_cpus
    # replay, weight sync and reward service, plus the learner's ranks, the reward pools, the
    # engines (none on a shared engine pool) and gateway
    engines = own_engines(cfg)
    actors = (3 + cfg.learner.world_size + ro.num_workers + ro.env_actors.count + scorers + judges
              + engines + cfg.live.enabled)
    return {"actors": actors, "cpus": cpus,
            "gpus": engines * ro.engine.gpus_per_engine() + own_learner_ranks(cfg) * cfg.learner.num_gpus}


def limit_errors(cfg: RunConfig, limits: LimitsConfig, owner: str) -> list[dict[str, str]]:
    """One 422 entry per per-run limit the config exceeds, naming the limit."""
    from services.limits import number_errors, summed_errors

    errors = number_errors(cfg, limits) + summed_errors(cfg, limits)
    need = demand(cfg)
    what = {"actors": ("max_actors", "rollout.num_workers + rollout.engine.count + rollout.env_actors.count + "
                                     "reward scorers/judges + live gateway + learner.world_size + 3"),
            "cpus": ("max_cpus", "the num_cpus of every actor"),
            "gpus": ("max_gpus", "rollout.engine.count x rollout.engine.num_gpus (an hf engine whose "
                                 "device is not cpu counts at least 1, a vllm engine at least its "
                                 "tensor_parallel_size above 1) + learner.world_size x learner.num_gpus")}
    for key, (limit, how) in what.items():
        allowed = getattr(limits, limit)
        if need[key] > allowed + 1e-9:
            errors.append(("<root>", f"the run asks for {need[key]:g} {key} ({how}); limits.{limit}={allowed:g}"))
    out = [{"loc": loc, "msg": f"{msg} for tenant {owner!r}", "type": "limit_exceeded"} for loc, msg in errors]
    eng = cfg.rollout.engine
    if eng.type == "hf" and eng.device != "cpu" and eng.num_gpus == 0:
        # an actor reserving no GPU sees none (cluster.actors sets CUDA_VISIBLE_DEVICES empty)
        out.append({"loc": "rollout.engine.num_gpus", "type": "value_error",
                    "msg": f"rollout.engine.device={eng.device!r} needs rollout.engine.num_gpus >= 1 (or a "
                           "fraction): an engine that reserves no GPU sees none"})
    return out


class Admission:
    """The operator's ``admission`` section, with its roots resolved once at start-up."""

    def __init__(self, cfg: ServiceConfig) -> None:
        self.cfg, self.adm = cfg, cfg.admission
        self.workdir = cfg.jobs.workdir()
        self.model_roots = [Path(r).resolve() for r in self.adm.model_roots]
        self.data_roots = [Path(r).resolve() for r in self.adm.data_roots]
        self.cache_dir = Path(self.adm.cache_dir).resolve() if self.adm.cache_dir else None
        self.redis = {s.url: s for s in self.adm.redis_servers}
        for prefix in self.adm.storage_urls:
            try:
                check_prefix(prefix)
            except PlaceError as exc:
                raise ServiceConfigError(f"admission.storage_urls: {exc}") from None
        protected = {"state_dir": cfg.state_path(), "runs_dir": cfg.runs_path(), "registry.path": cfg.registry_path()}
        if self.cache_dir:
            protected["admission.cache_dir"] = self.cache_dir
        for field, roots in (("model_roots", self.model_roots), ("data_roots", self.data_roots)):
            for root in roots:
                for name, path in protected.items():
                    if _within(path, root) or _within(root, path):
                        raise ServiceConfigError(
                            f"admission.{field}: {root} overlaps {name} ({path}); a read root there would "
                            "let one tenant read another's runs: list narrower directories")

    def admit(self, run_cfg: RunConfig, body: dict[str, Any], owner: str, run_dir: Path) -> RunConfig:
        """The config the run executes, or InvalidRunConfig naming every refused field."""
        tree = run_cfg.model_dump(mode="json", by_alias=True)
        for loc, real in secret_fields(run_cfg):  # JSON mode masks them: the job needs the real ones
            _set(tree, loc, real)
        errors: list[dict[str, str]] = []
        ctx = _Walk(self, run_cfg, body, owner, run_dir, tree, errors)
        on_pool = self._pool(run_cfg, body, tree, errors)
        for loc, name, rule, holder in sensitive_fields(run_cfg):
            if on_pool and loc == ("policy", "path"):
                continue  # the pool's model, set by the operator
            ctx.check(loc, rule, getattr(holder, name), holder)
        # The service decides where the run writes, how it reports and which cluster it joins.
        _set(tree, ("name",), run_dir.name)
        _set(tree, ("output_dir",), str(run_dir.parent))
        _set(tree, ("progress",), "log")
        _set(tree, ("cluster", "address"), None)
        _set(tree, ("cluster", "storage"), None)
        try:
            admitted = build_config(tree) if not errors else run_cfg
        except ConfigError as exc:  # the pool's engine refuses the run's adapter (its rank)
            raise InvalidRunConfig([*errors, {"loc": "rollout.pool", "msg": str(exc), "type": "value_error"}]) from None
        errors += limit_errors(admitted, self.cfg.limits_for(owner), owner)
        if errors:
            raise InvalidRunConfig(errors)
        return admitted

    def _pool(self, run_cfg: RunConfig, body: dict[str, Any], tree: dict[str, Any],
              errors: list[dict[str, str]]) -> bool:
        """A run naming an engine pool gets the pool's model and engine settings (a submitted
        value that differs is refused, never silently replaced). True when it names one."""
        name = run_cfg.rollout.pool
        if name is None:
            return False
        pool = self.cfg.pools.get(name)
        if pool is None:
            errors.append({"loc": "rollout.pool", "type": "not_allowed_pool",
                           "msg": f"no engine pool {name!r}; this service's pools are {sorted(self.cfg.pools)} "
                                  "(GET /v1/pools)"})
            return True
        if _has(body, ("policy", "path")) and run_cfg.policy.path != pool.model:
            errors.append({"loc": "policy.path", "type": "not_allowed_pool",
                           "msg": f"a run on engine pool {name!r} trains an adapter of the pool's model "
                                  f"{pool.model!r}: remove policy.path"})
        if _has(body, ("policy", "sft")):
            errors.append({"loc": "policy.sft", "type": "not_allowed_pool",
                           "msg": f"a run on engine pool {name!r} trains its adapter on the pool's model as it is "
                                  "(no warm start): remove policy.sft"})
        if _has(body, ("rollout", "engine")):
            errors.append({"loc": "rollout.engine", "type": "not_allowed_pool",
                           "msg": f"a run on engine pool {name!r} uses the pool's engines: remove rollout.engine"})
        self._pool_learner(name, pool, run_cfg, body, tree, errors)
        _set(tree, ("policy", "path"), pool.model)
        _set(tree, ("policy", "sft", "enabled"), False)  # the adapter trains on the pool's base as it is
        _set(tree, ("rollout", "engine"), pool.engine.model_dump(mode="json"))
        _set(tree, ("learner", "on_pool"), pool.learner is not None)
        return True

    @staticmethod
    def _pool_learner(name: str, pool: Any, run_cfg: RunConfig, body: dict[str, Any], tree: dict[str, Any],
                      errors: list[dict[str, str]]) -> None:
        """A pool with a learner trains its runs there (``learner.on_pool``, set by the
        caller), their adapters on its layers (set here unless submitted; submitted others are
        refused); a submitted ``on_pool`` that says otherwise is refused."""
        if _has(body, ("learner", "on_pool")) and run_cfg.learner.on_pool != (pool.learner is not None):
            has = "trains its runs in its learner" if pool.learner is not None else "has no learner"
            errors.append({"loc": "learner.on_pool", "type": "not_allowed_pool",
                           "msg": f"engine pool {name!r} {has}: remove learner.on_pool"})
        lora, targets = run_cfg.learner.lora, ("learner", "lora", "target_modules")
        if pool.learner is None or lora is None:
            return
        if not _has(body, targets):
            _set(tree, targets, list(pool.learner.target_modules))
        elif sorted(lora.target_modules) != sorted(pool.learner.target_modules):
            errors.append({"loc": "learner.lora.target_modules", "type": "not_allowed_pool",
                           "msg": f"engine pool {name!r}'s learner adapts {pool.learner.target_modules}: every "
                                  "adapter on it adapts those layers; remove learner.lora.target_modules"})


@dataclass
class _Walk:
    """One admission pass: collects refusals into ``errors`` and rewrites into ``tree``."""

    adm: Admission
    run_cfg: RunConfig
    body: dict[str, Any]
    owner: str
    run_dir: Path
    tree: dict[str, Any]
    errors: list[dict[str, str]]

    def refuse(self, loc: tuple[str, ...], msg: str, kind: str) -> None:
        self.errors.append({"loc": ".".join(loc), "msg": msg, "type": f"not_allowed_{kind}"})

    def check(self, loc: tuple[str, ...], rule: Rule, value: Any, holder: BaseModel) -> None:
        if rule.kind == "service":
            return
        if value is None and rule.kind in ("model", "data", "write", "callable"):
            return  # unset: nothing is read, written or called
        getattr(self, f"_{rule.kind}")(loc, rule, value, holder)

    def _model(self, loc: tuple[str, ...], rule: Rule, value: str, holder: BaseModel) -> None:
        hub = self.adm.adm.hub_models if rule.hub else []
        if value in rule.also or value in hub:
            return
        self._read(loc, value, self.adm.model_roots, "model_roots", urls=rule.urls,
                   extra=[*rule.also, *(f"hub id {h}" for h in hub)])

    def _data(self, loc: tuple[str, ...], rule: Rule, value: str, holder: BaseModel) -> None:
        self._read(loc, value, self.adm.data_roots, "data_roots", urls=rule.urls)

    def _read(self, loc: tuple[str, ...], value: str, roots: list[Path], field: str, urls: bool,
              extra: list[str] = ()) -> None:
        """storage.places' rule: a URL under admission.storage_urls (where the runtime reads URLs),
        else a path (file:// included) under a root that exists; the runtime gets it resolved."""
        try:
            place = classify(value, self.adm.workdir)
        except PlaceError as exc:
            self.refuse(loc, f"{exc}", "host")
            return
        if place.kind == "url":
            prefixes = self.adm.adm.storage_urls
            if urls and any(under_prefix(place.url, p) for p in prefixes):
                return
            where = f"URLs under admission.storage_urls {prefixes}" if urls else "local paths only (the run reads " \
                "this field as a file, not through storage)"
            self.refuse(loc, f"{value!r} is not allowed: this field takes {where}", "url")
            return
        path = place.path if place.path is not None else _resolve(value, self.adm.workdir)
        if path is None or not any(_within(path, root) for root in roots):
            where = f"a path under admission.{field} {[str(r) for r in roots]}" if roots else \
                f"no admission.{field} are configured"
            allowed = "; ".join([*(repr(e) for e in extra), where])
            shown = f" (resolves to {path})" if path is not None and str(path) != value else ""
            self.refuse(loc, f"{value!r}{shown} is not allowed: allowed are {allowed}", "path")
        elif not exists(path):
            self.errors.append({"loc": ".".join(loc), "msg": f"{value!r} (resolves to {path}) does not exist; a "
                                "path is never looked up on the Hugging Face hub", "type": "missing_path"})
        else:
            _set(self.tree, loc, str(path))  # the runtime loads exactly what was checked

    def _write(self, loc: tuple[str, ...], rule: Rule, value: str, holder: BaseModel) -> None:
        if not _has(self.body, loc) and self.adm.cache_dir is not None and rule.cache:
            _set(self.tree, loc, str(self.adm.cache_dir / self.owner / rule.cache))  # the tenant's own cache
            return
        try:  # storage.places' rule, as for read fields: a URL is no folder, file:// is its path
            path = local_dir(value, ".".join(loc), self.run_dir)
        except PlaceError as exc:
            self.refuse(loc, str(exc), "path")
            return
        if Path(value).is_absolute() or not _within(path, self.run_dir) or path == self.run_dir:
            self.refuse(loc, f"{value!r} is not allowed: runs write only inside their own directory; give a "
                             "relative path without '..' (or leave it unset)", "path")
            return
        _set(self.tree, loc, str(path))

    def _callable(self, loc: tuple[str, ...], rule: Rule, value: str, holder: BaseModel) -> None:
        allowed = getattr(self.adm.adm, rule.allowlist)
        if value not in allowed:
            what = {"judge_functions": "judge functions", "verifiers_envs": "verifiers environments"}.get(
                rule.allowlist, "environment sources")
            self.refuse(loc, f"{value!r} is not allowed: allowed {what} are {allowed} "
                             f"(admission.{rule.allowlist})", "callable")

    def _server(self, loc: tuple[str, ...], rule: Rule, value: str, holder: BaseModel) -> None:
        allowed = {s.name: s for s in getattr(self.adm.adm, rule.allowlist)}
        if value not in allowed:
            self.refuse(loc, f"{value!r} is not allowed: allowed servers are {sorted(allowed)} "
                             f"(admission.{rule.allowlist})", "server")
            return
        operators = allowed[value].model_dump(mode="json")
        for field in ("command", "args", "env", "cwd", "url", "stateful", "start_timeout_s"):
            if field in operators:  # what runs, and how, is the operator's
                _set(self.tree, (*loc[:-1], field), operators[field])

    def _launch(self, loc: tuple[str, ...], rule: Rule, value: Any, holder: BaseModel) -> None:
        if value not in (None, [], {}):
            self.refuse(loc, f"servers are the operator's: give only their name (one of admission.{rule.allowlist}) "
                             f"and remove {loc[-1]}", "launch")

    def _executable(self, loc: tuple[str, ...], rule: Rule, value: str, holder: BaseModel) -> None:
        binary = self.adm.adm.redis_server_binary
        if _has(self.body, loc) and value != binary:
            self.refuse(loc, f"{value!r} is not allowed: the service's operator sets it "
                             f"(admission.redis_server_binary={binary!r}); remove it", "executable")
        _set(self.tree, loc, binary)

    def _redis_url(self, loc: tuple[str, ...], rule: Rule, value: str, holder: BaseModel) -> None:
        if value != "embedded" and value not in self.adm.redis:
            self.refuse(loc, f"{value!r} is not allowed: allowed are 'embedded' and {sorted(self.adm.redis)} "
                             "(admission.redis_servers)", "host")

    def _redis_password(self, loc: tuple[str, ...], rule: Rule, value: str | None, holder: BaseModel) -> None:
        server = self.adm.redis.get(getattr(holder, "url", ""))
        wanted = server.password_env if server else None
        if _has(self.body, loc) and value != wanted:
            self.refuse(loc, f"{value!r} is not allowed: the service sets it from admission.redis_servers "
                             f"({wanted!r} for this url); remove it", "secret")
        _set(self.tree, loc, wanted)

    def _env_overrides(self, loc: tuple[str, ...], rule: Rule, value: dict[str, Any], holder: BaseModel) -> None:
        """Check the environment ``policy.sft.env`` produces; only the keys it replaces are its own
        (the rest are the run's ``env``, checked there)."""
        from learner.bootstrap import demo_env_config

        try:
            env = demo_env_config(self.run_cfg.policy, self.run_cfg.env)
        except ValueError as exc:
            self.errors.append({"loc": ".".join(loc), "msg": str(exc), "type": "value_error"})
            return
        for sub, name, sub_rule, sub_holder in sensitive_fields(env, loc) if env is not None else ():
            if sub[len(loc)] in value:
                self.check(sub, sub_rule, getattr(sub_holder, name), sub_holder)
