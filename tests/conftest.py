"""Shared fixtures: environment for Ray/HF, a tiny search-QA policy built once per session,
and one local Ray cluster shared by the slow tests."""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

import pytest
from file_order import longest_first

from rollout.cores import apply_thread_policy

# Before anything imports torch: this process's OpenMP workers, and every process it starts
# (Ray workers, vLLM's engine processes, benches), sleep at barriers instead of spinning.
apply_thread_policy()
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("DS_BUILD_OPS", "0")

ROOT = Path(__file__).resolve().parents[1]
ARTIFACTS = ROOT / "test-artifacts"
# Compiled artefacts in the checkout's .cache, as `make test` sets them (Makefile says why).
for _var, _sub in (("TORCHINDUCTOR_CACHE_DIR", "torchinductor"), ("VLLM_CACHE_ROOT", "vllm"),
                   ("TORCH_EXTENSIONS_DIR", "torch_extensions")):
    os.environ.setdefault(_var, str(ROOT / ".cache" / _sub))

# Small enough to build in seconds; the integration tests need a working policy, not a good one.
TINY_OVERRIDES = [
    "policy.tiny.hidden_size=64", "policy.tiny.num_layers=2", "policy.tiny.num_heads=2",
    "policy.tiny.intermediate_size=128", "policy.tiny.vocab_size=600",
    "policy.sft.steps=30", "policy.sft.num_demos=200", "policy.sft.batch_size=8",
    "env.num_entities=80", "env.num_train_tasks=300", "env.num_heldout_tasks=40",
]


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    longest_first(items)  # tests/file_order.py says why


@pytest.fixture(scope="session")
def policy_cache(tmp_path_factory, request) -> str:
    """The policies this session builds. Under pytest-xdist the workers share one folder (the
    parent of their own temporary folders): a policy is built once, not once per worker (the
    agent policy's 300 SFT steps: test_gateway_http's set-up, which builds it, took 35-39 s
    in the cold runs of docs/results/test_suite.md)."""
    if hasattr(request.config, "workerinput"):  # an xdist worker
        shared = tmp_path_factory.getbasetemp().parent / "policies"
        shared.mkdir(exist_ok=True)
        return str(shared)
    return str(tmp_path_factory.mktemp("policies"))


def _built_once(cfg, source) -> str:
    """``ensure_policy`` under a lock in its cache: a second worker asking for the same policy
    waits for the first to finish it and then finds it there, instead of building its own and
    renaming it over a folder the first worker's runs are reading."""
    from learner.bootstrap import ensure_policy

    with open(Path(cfg.policy.cache_dir) / ".lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            return str(ensure_policy(cfg.policy, cfg.env, source, show_progress=False))
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


@pytest.fixture(scope="session")
def tiny_run_config(policy_cache):
    """A RunConfig for a tiny, fast search-QA run (tests override what they need)."""
    from cluster.config import load_config

    def make(extra: list[str] = (), **kw):
        return load_config(None, [*TINY_OVERRIDES, f"policy.cache_dir={policy_cache}", *extra])

    return make


@pytest.fixture(scope="session")
def tiny_policy(tiny_run_config):
    """(policy folder, task source) of the tiny bootstrapped policy."""
    from envs.registry import make_task_source

    cfg = tiny_run_config()
    source = make_task_source(cfg.env)
    return _built_once(cfg, source), source


@pytest.fixture(scope="session")
def agent_policy(tiny_run_config):
    """(policy folder, task source) of a tiny policy warm-started long enough (300 SFT steps,
    ~1 min) to call the search tool and answer: the agent the live-traffic tests talk to."""
    from envs.registry import make_task_source

    cfg = tiny_run_config(["policy.sft.steps=300"])
    source = make_task_source(cfg.env)
    return _built_once(cfg, source), source


@pytest.fixture(scope="session")
def ray_cluster():
    import ray

    from cluster.actors import job_env  # a run's actor environment, so tests see what runs see

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, runtime_env={"env_vars": job_env()})
    yield ray
    ray.shutdown()


@pytest.fixture
def engine_pools(ray_cluster):
    """``start(name, cfg, model_path)``: a named engine pool (``cluster.pool.start_pool``) killed
    as the test ends, pass or fail, and waited for until its name (and its learner's) is free:
    the cluster is shared by the session, and a failed test's traceback would otherwise keep
    its pool alive and its name taken for the next test that starts one."""
    import time

    from cluster.pool import POOL_NAMESPACE, pool_actor_name, start_pool
    from cluster.pool_learner import pool_learner_name

    started: list[tuple[str, object]] = []

    def start(name: str, cfg, model_path: str):
        pool = start_pool(name, cfg, model_path)
        started.append((name, pool))
        return pool

    yield start
    for name, pool in started:
        ray_cluster.kill(pool)
        deadline = time.monotonic() + 60
        for actor in (pool_actor_name(name), pool_learner_name(name)):
            while time.monotonic() < deadline:
                try:
                    ray_cluster.get_actor(actor, namespace=POOL_NAMESPACE)
                except ValueError:
                    break
                time.sleep(0.2)
