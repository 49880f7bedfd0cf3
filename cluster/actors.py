"""Placing the run's actors on Ray: replay, engine group, reward, weight sync, rollout
workers, learner.

Every worker class is plain Python; this module is the one place that wraps them with
``ray.remote`` and gives them resources from the config.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cluster.config import RunConfig
from cluster.learner_group import LearnerGroup, start_learner
from rollout.cores import pin_process, thread_policy_env
from storage import atomic_write

_log = logging.getLogger(__name__)

# RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO: Ray (2.60) leaves CUDA_VISIBLE_DEVICES alone for an actor
# that reserves no GPU, so a learner on device auto or an engine with num_gpus 0 would take
# cuda:0 unreserved; with it, Ray sets CUDA_VISIBLE_DEVICES="" for such actors (and the GPU ids
# it assigned for the others).
_ENV = {"TOKENIZERS_PARALLELISM": "false", "RAY_USAGE_STATS_ENABLED": "0", "PYTHONWARNINGS": "ignore",
        "RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO": "1"}


def job_env() -> dict[str, str]:
    """The environment every actor of a run gets (Ray's runtime env): the settings above and
    the thread policy."""
    return {**_ENV, **thread_policy_env()}


def init_ray(cfg: RunConfig) -> None:
    """Join ``cluster.address`` or RAY_ADDRESS, else start a local cluster."""
    import ray

    if ray.is_initialized():
        # Ray started by this process with the same pin (an earlier run) already holds it.
        if cfg.cluster.cpu_affinity and set(cfg.cluster.cpu_affinity) != os.sched_getaffinity(0):
            raise ValueError(f"cluster.cpu_affinity={cfg.cluster.cpu_affinity} pins a local cluster this run "
                             "starts, but Ray already runs in this process: drop the setting, or let the "
                             "run start Ray")
        check_resources(cfg)  # an attached cluster too short of CPUs would hang actor creation
        return
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")  # local clusters; real ones configure auth themselves
    address = cfg.cluster.address or os.environ.get("RAY_ADDRESS")
    kwargs: dict[str, Any] = {"include_dashboard": False, "log_to_driver": True,
                              "runtime_env": {"env_vars": job_env()}}
    # ray.init installs its own SIGTERM handler (sys.exit); keep ours, which stops gracefully.
    term_handler = signal.getsignal(signal.SIGTERM)
    if address:
        if cfg.cluster.cpu_affinity:
            raise ValueError(f"cluster.cpu_affinity={cfg.cluster.cpu_affinity} pins a local cluster "
                             f"this run starts, but it joins {address}: drop the setting (pin that "
                             "cluster's nodes where they are started)")
        ray.init(address=address, **kwargs)
    else:
        if cfg.cluster.cpu_affinity:
            # Ray's daemons and workers inherit the driver's affinity; actors with a
            # cpu_affinity of their own are re-pinned once started (``pin``).
            pin_process(cfg.cluster.cpu_affinity, "cluster.cpu_affinity")
        ray.init(num_cpus=cfg.cluster.num_cpus or os.cpu_count(), **kwargs)
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, term_handler)
    check_resources(cfg)


def check_resources(cfg: RunConfig) -> None:
    """Fail fast, naming the keys, when the cluster has fewer CPUs than the run's actors ask."""
    import ray

    need, res = run_cpus(cfg), ray.cluster_resources()
    have = res.get("CPU", 0)
    if need > have + 1e-9:
        raise RuntimeError(
            f"the run needs {need:g} Ray CPUs (rollout.num_workers x rollout.num_cpus + "
            "rollout.engine.count x rollout.engine.num_cpus + learner.world_size x learner.num_cpus "
            f"+ cluster.reward_num_cpus + cluster.replay_num_cpus + rollout.env_actors.count x "
            f"rollout.env_actors.num_cpus + live.num_cpus when live.enabled) but the cluster has "
            f"{have:g}; lower them (fractions are fine) or add nodes"
        )
    for name, (need_r, keys) in custom_resources(cfg).items():
        if need_r > res.get(name, 0) + 1e-9:
            raise RuntimeError(f"the run reserves {need_r:g} of the custom resource {name!r} ({', '.join(keys)}) but "
                               f"the cluster's nodes advertise {res.get(name, 0):g}; start "
                               f"nodes with `ray start --resources '{{\"{name}\": N}}'` or change those keys")
    gpus = own_engines(cfg) * cfg.rollout.engine.num_gpus + own_learner_ranks(cfg) * cfg.learner.num_gpus
    if gpus > res.get("GPU", 0) + 1e-9:
        raise RuntimeError(f"the run needs {gpus:g} GPUs (rollout.engine.count x rollout.engine.num_gpus + "
                           f"learner.world_size x learner.num_gpus) but the cluster has "
                           f"{res.get('GPU', 0):g}")


def custom_resources(cfg: RunConfig) -> dict[str, tuple[float, list[str]]]:
    """Custom Ray resource -> (total the run's actors reserve, the config keys asking)."""
    from cluster.reward_service import reward_pools

    ro = cfg.rollout
    services = 3 + sum(reward_pools(cfg)) + int(cfg.live.enabled)  # replay, weight sync, reward front
    groups = [("cluster.service_resources", services, cfg.cluster.service_resources),
              ("rollout.resources", ro.num_workers, ro.resources),
              ("rollout.engine.resources", own_engines(cfg), ro.engine.resources),
              ("rollout.env_actors.resources", ro.env_actors.count, ro.env_actors.resources),
              ("learner.resources", own_learner_ranks(cfg), cfg.learner.resources)]
    out: dict[str, tuple[float, list[str]]] = {}
    for key, count, resources in groups:
        for name, amount in resources.items():
            total, keys = out.get(name, (0.0, []))
            out[name] = (total + count * amount, [*keys, key] if count else keys)
    return out


def own_engines(cfg: RunConfig) -> int:
    """Engine actors the run starts: none on a shared pool (``rollout.pool``), whose engines
    the pool's own job holds."""
    return 0 if cfg.rollout.pool is not None else cfg.rollout.engine.count


def own_learner_ranks(cfg: RunConfig) -> int:
    """Learner ranks the run starts that hold the model and reserve ``learner.num_cpus``:
    none when its pool's learner trains it (``learner.on_pool``; its one ``TenantLearner``
    reserves nothing)."""
    return 0 if cfg.learner.on_pool else cfg.learner.world_size


def run_cpus(cfg: RunConfig) -> float:
    """Ray CPUs the run's core actors reserve (reward scorers and judges come on top)."""
    envs, eng = cfg.rollout.env_actors, cfg.rollout.engine
    return (cfg.rollout.num_workers * cfg.rollout.num_cpus + own_engines(cfg) * eng.num_cpus
            + own_learner_ranks(cfg) * cfg.learner.num_cpus
            + cfg.cluster.reward_num_cpus + cfg.cluster.replay_num_cpus + envs.count * envs.num_cpus
            + (cfg.live.num_cpus if cfg.live.enabled else 0.0))


@dataclass
class RunActors:
    replay: Any
    weights: Any
    """The run's ``learner.weights.WeightSync`` actor."""
    reward: Any
    rollouts: list[Any]
    learner: LearnerGroup
    envs: list[Any]
    engines: list[Any]
    engine_client: Any
    gateway: Any = None
    live_url: str | None = None
    make_learner: Any = None
    """``make_learner(resume, version_floor=0)``: a new learner group like the run's (what an
    in-job restart of a dead learner uses)."""
    run_dir: str = ""
    run_id: str = ""
    pool: Any = None
    """The shared engine pool's actor (``cluster.pool``) whose engines the run uses, or None
    when ``engines`` are the run's own."""
    targets: Any = None
    """The ``cluster.telemetry.TargetsRefresh`` keeping the run's Prometheus targets current."""

    @property
    def owned_engines(self) -> list[Any]:
        """The engines the run started (a shared pool's are not the run's: it neither starts,
        kills nor reports them)."""
        return self.engines if self.pool is None else []

    def all(self) -> list[Any]:
        """Every actor of the run, callers before what they call (the order they are killed
        in): the weight sync goes after the learner, whose publish may be calling it, and
        replay comes last."""
        return [*([self.gateway] if self.gateway is not None else []), *self.rollouts, *self.owned_engines,
                *self.learner.ranks, self.reward, *self.envs, self.weights, self.replay]

    def release(self) -> None:
        """Kill every actor of the run and free the learner's placement group; on a pool,
        detach from it (its adapter leaves the pool's engines), which goes on serving others.
        Replay goes last and is closed first: an embedded redis-server gets its clean shutdown
        (a flushed append-only file) instead of dying some time after its host, which a
        process opening the store just then would see as a live server that refuses
        connections."""
        import ray

        if self.targets is not None:
            self.targets.stop()
        for actor in self.all():
            if actor is not self.replay:
                ray.kill(actor)
        if self.pool is not None:
            try:
                ray.get(self.pool.detach.remote(self.run_id), timeout=120)
            except Exception as exc:  # noqa: BLE001 - the pool's watch detaches a run whose sync is gone
                _log.warning("detaching run %s from its engine pool failed: %s", self.run_id, exc)
        self.learner.release()
        _close_replay(self.replay)


def start_env_hosts(cfg: RunConfig) -> list[Any]:
    """The run's environment actors (none unless ``rollout.env_actors.count`` > 0)."""
    import ray

    from envs.host import EnvHost

    spec = cfg.rollout.env_actors
    host = ray.remote(EnvHost).options(num_cpus=spec.num_cpus, resources=spec.resources,
                                       max_concurrency=spec.max_concurrency,
                                       max_restarts=spec.max_restarts, max_task_retries=0)
    return [host.remote(cfg.env) for _ in range(spec.count)]


def start_engines(cfg: RunConfig, policy_path: str, run_id: str) -> list[Any]:
    """The run's engine group: ``rollout.engine.count`` actors. The weight sync pushes new
    weights to them; one that Ray starts again catches up from the sync (found by its name)."""
    import ray

    from cluster.telemetry import instrument
    from cluster.weight_sync import run_adapter, weight_sync_name
    from rollout.engines.server import EngineServer
    from rollout.ports import WeightSyncSource

    eng = cfg.rollout.engine
    # A restarted engine cannot rejoin the learner's broadcast group (its peers joined once).
    restarts = 0 if cfg.rollout.weights.transport == "broadcast" else eng.max_restarts
    actor = ray.remote(instrument(EngineServer, "engine")).options(
        num_cpus=eng.num_cpus, num_gpus=eng.num_gpus, resources=eng.resources, max_concurrency=eng.max_concurrency,
        max_restarts=restarts, max_task_retries=0)
    source = WeightSyncSource(weight_sync_name(run_id), run_adapter(cfg, run_id))
    return [actor.remote(eng, policy_path, cfg.train.seed * 1000 + i, source, restarted_by_ray=True)
            for i in range(eng.count)]


def producer_id(worker: int) -> str:
    """Rollout worker ``worker``'s name in replay's reservation ledger."""
    return f"rollout-{worker}"


def learner_actor_class(learner_cls: Any) -> Any:
    """The learner as a Ray actor class. Its ``control`` concurrency group runs ``interrupt()``
    beside a ``train_step`` blocked waiting for a batch, and the driver's questions about the
    process (placement, its metrics endpoint) beside any step: a step that waits for rollout
    actors the driver is restarting must not hold the restart's bookkeeping behind it.
    Everything else stays serial."""
    import ray

    attrs: dict[str, Any] = {"__doc__": learner_cls.__doc__}
    if hasattr(learner_cls, "start_metrics_server"):  # instrumented (cluster.telemetry)
        def start_metrics_server(self: Any, run_id: str) -> str | None:
            return learner_cls.start_metrics_server(self, run_id)

        attrs["start_metrics_server"] = ray.method(concurrency_group="control")(start_metrics_server)
    # keep the class's name: Ray prefixes actor log lines and dashboard rows with it
    return ray.remote(concurrency_groups={"control": 1})(type(learner_cls.__name__, (learner_cls,), attrs))


def start_actors(cfg: RunConfig, policy_path: str, run_dir: str, run_id: str, resume: bool = False,
                 storage_url: str | None = None) -> RunActors:
    """``policy_path``: a folder every node reads, or its stored copy's URL; ``storage_url``:
    where the learner keeps checkpoints and run state (None: ``run_dir``)."""
    import ray

    from learner.ports import ActorLearnerPorts
    from learner.worker import LearnerWorker
    from cluster.reward_service import start_reward_service, start_scorers
    from cluster.weight_sync import form_weight_group, run_adapter, start_weight_sync
    from rollout.engines.client import AdapterClient, RayEngineClient
    from cluster.telemetry import instrument

    # A subclass that adds a Prometheus endpoint (cluster/telemetry.py); the worker stays plain.
    Learner = instrument(LearnerWorker, "learner")
    live_groups = cfg.train.live_groups(cfg.learner.batch_groups)
    made: list[Any] = []  # started so far (replay first): stopped again if a later start fails
    try:
        replay = _start_replay(cfg, run_dir, run_id, live_groups)
        made.append(replay)
        pool = None
        if cfg.rollout.pool is not None:  # a shared pool's engines, serving this run's adapter
            from cluster.pool import pool_engines

            pool, engines = pool_engines(cfg.rollout.pool, str(policy_path))
        else:
            engines = start_engines(cfg, str(policy_path), run_id)
            made += engines
        client = RayEngineClient(engines, str(policy_path))
        if (adapter := run_adapter(cfg, run_id)) is not None:  # every request of the run names it
            client = AdapterClient(client, adapter)
        scorers = start_scorers(cfg, str(policy_path))
        made += scorers
        reward = start_reward_service(cfg, replay, str(policy_path), client, scorers)
        made.append(reward)
        weights = start_weight_sync(cfg, run_id, engines, scorers, replay)
        made.append(weights)
        envs = start_env_hosts(cfg)
        made += envs
        rollouts = _start_rollouts(cfg, client, replay, reward, envs)
        made += rollouts
    except BaseException:
        _stop_started(made)
        raise
    ports = ActorLearnerPorts(replay, weights, cfg.rollout.weights, run_dir, cfg.rollout.engine.count)

    def make_learner(resume: bool, version_floor: int = 0) -> LearnerGroup:
        if cfg.learner.on_pool:  # the pool's learner trains the run's adapter
            from cluster.pool_learner import start_tenant

            return start_tenant(cfg, run_id, ports, run_dir, resume, version_floor, live_groups)
        group = start_learner(cfg.learner, learner_actor_class(Learner), lambda dist: (
            (cfg.learner, str(policy_path), run_dir, ports if dist is None or dist.rank == 0 else None),
            {"group_size": cfg.rollout.group_size, "temperature": cfg.rollout.temperature, "resume": resume,
             "live_groups": live_groups, "dist": dist, "storage_url": storage_url, "version_floor": version_floor,
             "rewards": cfg.rewards}))
        pin(group.ranks, cfg.learner.cpu_affinity, "learner.cpu_affinity")
        return group

    started = RunActors(replay, weights, reward, rollouts, LearnerGroup([]), envs, engines, client,
                        make_learner=make_learner, run_dir=run_dir, run_id=run_id)
    # Surface constructor failures (bad model path, DeepSpeed errors) here, not mid-loop, and
    # free what did start so a caller that carries on keeps its CPUs.
    try:
        if pool is not None:  # refused here when the pool is full, before the learner starts
            ray.get(pool.attach.remote(run_id, adapter, weights))
            started.pool = pool
        learner = started.learner = make_learner(resume)
        wait_ready([*learner.call("get_version"), *[w.stats.remote() for w in rollouts], replay.stats.remote(),
                    *[h.stats.remote() for h in envs], *[e.start.remote() for e in started.owned_engines]],
                   cfg.progress == "bar")
        form_weight_group(started)
        if adapter is not None:  # its version 0, which the learner published as it started
            learner.get("settle_weights")
        pin(rollouts, cfg.rollout.cpu_affinity, "rollout.cpu_affinity")
        pin_services(cfg, started)
        if cfg.live.enabled:
            from cluster.live import start_gateway

            started.gateway, started.live_url = start_gateway(cfg, client, reward, replay, run_dir, run_id)
    except BaseException:
        started.release()
        raise
    record_placement(started, run_dir)
    publish_targets(started, run_dir, run_id)
    from cluster.telemetry import TargetsRefresh

    started.targets = TargetsRefresh(lambda: target_actors(started), run_dir, run_id)
    return started


def service_restarts(cfg: RunConfig, replay_host: bool = False) -> dict[str, int]:
    """Ray's restart options for the weight sync and the replay host: restarted up to
    ``cluster.service_max_restarts`` times, every caller's call waiting meanwhile and re-sent
    to the new process (-1: for as long as it restarts). Never the host of in-process replay,
    whose groups die with it (the driver ends that run naming it)."""
    if replay_host and cfg.replay.type != "redis":
        return {"max_restarts": 0, "max_task_retries": 0}
    return {"max_restarts": cfg.cluster.service_max_restarts, "max_task_retries": -1}


def pin_services(cfg: RunConfig, actors: RunActors) -> None:
    """The replay host, weight sync and reward front on ``cluster.services_cpu_affinity``."""
    pin([actors.replay, actors.weights, actors.reward], cfg.cluster.services_cpu_affinity,
        "cluster.services_cpu_affinity")


def wait_ready(refs: list[Any], show: bool) -> None:
    """``ray.get`` of the actors' first answers, counted off on a bar with an ETA (starting the
    engines, the learner's DeepSpeed and the rest takes ~10 s on 2 cores); the first failure
    raises as soon as it arrives."""
    import ray
    from tqdm import tqdm

    pending = list(refs)
    with tqdm(total=len(pending), desc="actors ready", unit="actor", disable=not show) as bar:
        while pending:
            done, pending = ray.wait(pending, num_returns=1)
            ray.get(done)
            bar.update(len(done))


def target_actors(actors: RunActors) -> list[tuple[str, Any]]:
    """(component, actor) of each of the run's actors that serves Prometheus metrics."""
    return [("replay", actors.replay), ("reward", actors.reward), *[("rollout", w) for w in actors.rollouts],
            *[("engine", e) for e in actors.owned_engines], ("learner", actors.learner.leader),
            *([("gateway", actors.gateway)] if actors.gateway is not None else [])]


def publish_targets(actors: RunActors, run_dir: str, run_id: str) -> None:
    """Best effort: the actors' Prometheus endpoints into <run_dir>/prometheus_targets.json
    (never raises); live actors keep their endpoint, restarted ones start a new one."""
    from cluster.telemetry import publish_metrics_targets

    publish_metrics_targets(target_actors(actors), run_dir, run_id)


def after_restart(cfg: RunConfig, actors: RunActors) -> None:
    """Redo for restarted actors (new processes, maybe on another node) what ``start_actors``
    did once: rollout ``cpu_affinity`` (the learner's is set by ``make_learner``),
    placement.json and the Prometheus targets."""
    pin(actors.rollouts, cfg.rollout.cpu_affinity, "rollout.cpu_affinity")
    pin_services(cfg, actors)
    record_placement(actors, actors.run_dir)
    publish_targets(actors, actors.run_dir, actors.run_id)


def record_placement(actors: RunActors, run_dir: str) -> dict[str, list[dict[str, str]]]:
    """``<run_dir>/placement.json``: the node (id and address), process and allowed cores of
    each of the run's actors, by role, so an operator (and the tests) see where resources and
    ``cpu_affinity`` put them."""

    roles = {"replay": [actors.replay], "weights": [actors.weights], "reward": [actors.reward], "rollout": actors.rollouts,
             "engine": actors.engines, "env": actors.envs}
    refs = {role: [a.__ray_call__.remote(_node_of) for a in handles] for role, handles in roles.items()}
    # The learner's default group may be in a step waiting for the very rollout actors whose
    # restart this records (learner_actor_class): ask in its control group.
    refs["learner"] = [r.__ray_call__.options(concurrency_group="control").remote(_node_of)
                       for r in actors.learner.ranks]
    placement = {role: [_answer(ref) for ref in r] for role, r in refs.items()}
    atomic_write(Path(run_dir, "placement.json"), json.dumps(placement, indent=2))
    return placement


def _answer(ref: Any) -> dict[str, Any]:
    """An actor's answer, or ``{"node_id": None}`` while it is dead or restarting."""
    import ray

    try:
        return ray.get(ref)
    except ray.exceptions.RayActorError:
        return {"node_id": None}


def _node_of(_actor: Any) -> dict[str, str]:
    """Run inside an actor (``__ray_call__``): the node it is on."""
    import ray

    return {"node_id": ray.get_runtime_context().get_node_id(), "address": ray.util.get_node_ip_address(),
            "pid": os.getpid(), "cpus": sorted(os.sched_getaffinity(0))}


def _start_replay(cfg: RunConfig, run_dir: str, run_id: str, live_groups: int) -> Any:
    """The run's replay host. Admission paces the producers by the scheduled share of each
    batch (live groups are put unscheduled and bounded on their own). Threads: a learner
    waiting in claim_wait and each rollout worker's admission request waiting for room must
    not hold up the puts and acks that end their waits."""
    import ray

    from cluster.telemetry import instrument
    from replay.host import ACTOR_THREADS, ReplayHost

    return ray.remote(instrument(ReplayHost, "replay")).options(
        num_cpus=cfg.cluster.replay_num_cpus, name=f"replay-{run_id}", resources=cfg.cluster.service_resources,
        max_concurrency=ACTOR_THREADS + cfg.rollout.num_workers, **service_restarts(cfg, replay_host=True)).remote(
        cfg.replay, cfg.learner.batch_groups - live_groups, run_dir, run_id)


def _start_rollouts(cfg: RunConfig, client: Any, replay: Any, reward: Any, envs: list[Any]) -> list[Any]:
    """The run's rollout actors, each with its producer name in replay's reservation ledger."""
    import ray

    from cluster.telemetry import instrument
    from rollout.ports import ActorEnvPort, ActorPorts
    from rollout.worker import RolloutWorker

    env_ports = [ActorEnvPort(h) for h in envs] or None
    actor = ray.remote(instrument(RolloutWorker, "rollout")).options(
        num_cpus=cfg.rollout.num_cpus, resources=cfg.rollout.resources, max_concurrency=256,
        max_restarts=cfg.rollout.max_restarts, max_task_retries=0)
    return [actor.remote(i, cfg.rollout, cfg.env, client, cfg.train.seed, ActorPorts(replay, reward, producer_id(i)),
                         env_ports)
            for i in range(cfg.rollout.num_workers)]


def _stop_started(made: list[Any]) -> None:
    """What ``start_actors`` started before a later start failed: the rest killed, replay
    (``made[0]``) closed last, as ``RunActors.release`` does."""
    import ray

    for actor in reversed(made[1:]):
        ray.kill(actor)
    if made:
        _close_replay(made[0])


def _close_replay(replay: Any) -> None:
    """Close the replay host (an embedded redis-server gets its clean shutdown), then kill it."""
    import ray

    try:
        ray.get(replay.close.remote(), timeout=30)
    except Exception as exc:  # noqa: BLE001 - a dead, stuck or never started host: killing it is all that is left
        _log.warning("replay host did not close cleanly: %s", exc)
    ray.kill(replay)


def pin(actors: list[Any], cores: list[int] | None, key: str) -> None:
    """Restrict every thread of each actor's process to ``cores`` (``key`` names the setting
    in errors); waits until they are (an actor's constructor must have finished)."""
    import ray

    if cores:
        ray.get([a.__ray_call__.remote(_pin_threads, list(cores), key) for a in actors])


def _pin_threads(_actor: Any, cores: list[int], key: str) -> None:
    """Run inside an actor (``__ray_call__``): every thread of its process on ``cores``."""
    pin_process(cores, key)
