"""Limits count what a run really uses: every number in a RunConfig that buys
CPU, memory or time is capped by a named service limit (services/limits.py), GPUs are counted
as the engines shard them, and actors that reserve no GPU see none.

``limit_errors`` is called directly (the 422 over HTTP is in test_services_admission.py); the
schema walk keeps ``BUDGETS`` and ``FREE`` complete.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from config_walk import field_types, section_models

from cluster.config import RunConfig, build_config, load_config
from services.admission import demand, limit_errors
from services.config import LimitsConfig
from services.limits import BUDGETS, FREE, memory_gib, tiny_params

ROOT = Path(__file__).resolve().parents[1]


def test_every_number_is_budgeted_or_says_why_not() -> None:
    models = section_models(RunConfig)
    numbers = {f"{cls}.{name}" for cls, model in models.items() for name, info in model.model_fields.items()
               if any(t in (int, float) for t in field_types(info.annotation))}
    unclassified = sorted(numbers - set(BUDGETS) - set(FREE))
    assert unclassified == [], f"give these a limit in services/limits.py BUDGETS, or a reason in FREE: {unclassified}"
    stale = sorted((set(BUDGETS) | set(FREE)) - numbers)
    assert stale == [] and not set(BUDGETS) & set(FREE) and all(FREE.values())
    assert {limit for limit, _ in BUDGETS.values()} <= set(LimitsConfig.model_fields)


def errors(body: dict, **limits: Any) -> dict[str, str]:
    cfg = build_config(body)
    return {e["loc"]: e["msg"] for e in limit_errors(cfg, LimitsConfig(**limits), "alice")}


@pytest.mark.parametrize("body, loc, msg", [
    ({"policy": {"sft": {"steps": 2001}}}, "policy.sft.steps", "2001 is over limits.max_sft_steps=2000"),
    ({"rollout": {"engine": {"torch_threads": 64}}}, "rollout.engine.torch_threads", "64 is over limits.max_threads=8"),
    ({"rewards": {"service": {"torch_threads": 9}}}, "rewards.service.torch_threads", "9 is over limits.max_threads=8"),
    ({"rollout": {"max_new_tokens": 100_000}}, "rollout.max_new_tokens", "100000 is over limits.max_tokens=65536"),
    ({"live": {"max_sessions": 10**7}}, "live.max_sessions", "10000000 is over limits.max_items=100000"),
    ({"eval": {"bootstrap_resamples": 10**6}}, "eval.bootstrap_resamples", "1000000 is over limits.max_items=100000"),
    ({"rollout": {"group_size": 4096}}, "rollout.group_size", "4096 is over limits.max_batch=1024"),
    ({"learner": {"claim_timeout_s": 86400}}, "learner.claim_timeout_s", "86400 is over limits.max_wait_s=3600"),
    ({"rollout": {"engine": {"join_wait_ms": 4e6}}}, "rollout.engine.join_wait_ms",  # ms against a limit in s
     "4000000 is over limits.max_wait_s=3600"),
    ({"cluster": {"service_max_restarts": 1000}}, "cluster.service_max_restarts", "1000 is over limits.max_restarts=10"),
    ({"rollout": {"weights": {"timeout_s": 86400}}}, "rollout.weights.timeout_s", "86400 is over limits.max_wait_s=3600"),
])
def test_each_number_falls_under_its_named_limit(body: dict, loc: str, msg: str) -> None:
    assert errors(body) == {loc: f"{msg} for tenant 'alice'"}


def test_memory_and_model_size_are_summed_against_their_limits() -> None:
    vllm = {"rollout": {"engine": {"type": "vllm", "count": 2, "cpu_kv_cache_gib": 8}}}
    # 2 x 8 GiB KV + 0.5 GiB replay (capacity_bytes 512 MiB) + 0.25 GiB bucket = 16.75
    assert memory_gib(build_config(vllm)) == pytest.approx(16.75)
    assert errors(vllm) == {"<root>": "the run asks for 16.75 GiB of memory (rollout.engine.count x the engine's "
                                      "cpu_kv_cache_gib or prefix_cache_mib + replay.capacity_bytes + "
                                      "rollout.weights.bucket_mib); limits.max_memory_gib=16 for tenant 'alice'"}
    assert errors({"rollout": {"engine": {"prefix_cache_mib": 2**24}}})["<root>"].startswith(
        "the run asks for 16384.75 GiB of memory")  # hf: 16 TiB of prefix cache + 0.75
    # 2 x 2048 x 128 + 4 x (4 x 128^2 + 3 x 128 x 384) = 524288 + 851968
    assert tiny_params(build_config({})) == 1_376_256
    big = {"policy": {"tiny": {"hidden_size": 4096, "intermediate_size": 16384, "num_layers": 32}}}
    # 2 x 2048 x 4096 + 32 x (4 x 4096^2 + 3 x 4096 x 16384)
    assert errors(big)["<root>"] == ("the run asks for 8606711808 parameters in policy.tiny; "
                                     "limits.max_tiny_params=50000000 for tenant 'alice'")
    assert tiny_params(build_config({"policy": {"path": "Qwen/Qwen2.5-0.5B-Instruct"}})) == 0


def test_tensor_parallel_shards_count_as_gpus() -> None:
    for tp, gpus in ((1, 0), (2, 2), (8, 8)):
        cfg = build_config({"rollout": {"engine": {"type": "vllm", "tensor_parallel_size": tp}}})
        assert demand(cfg)["gpus"] == gpus


@pytest.mark.parametrize("path", sorted((ROOT / "configs").glob("*.yaml")), ids=lambda p: p.name)
def test_shipped_configs_and_defaults_fit_the_default_limits(path: Path) -> None:
    roomy = {"max_gpus": 64, "max_cpus": 1000, "max_actors": 1000}
    assert limit_errors(load_config(path), LimitsConfig(**roomy), "alice") == []
    assert limit_errors(build_config({}), LimitsConfig(), "alice") == []


# Its own process: the test session's Ray (conftest's ray_cluster) may already run here, and
# init_ray joins a running Ray as it is, so the probe must start the cluster itself.
PROBE = """
import json, os, sys
sys.path.insert(0, {root!r})
os.environ["CUDA_VISIBLE_DEVICES"] = "0"  # what a GPU node's processes would inherit
os.environ.pop("OMP_WAIT_POLICY", None)  # the job env must bring the thread policy
os.environ.pop("RAY_ADDRESS", None)
import ray
from cluster.actors import init_ray
from cluster.config import build_config
init_ray(build_config({{"cluster": {{"num_cpus": 2}}}}))

@ray.remote(num_cpus=0)
def probe():
    return [os.environ.get("CUDA_VISIBLE_DEVICES"), os.environ.get("OMP_WAIT_POLICY")]

print(json.dumps(ray.get(probe.remote(), timeout=120)))
ray.shutdown()
"""


@pytest.mark.slow
def test_actors_that_reserve_no_gpu_see_none() -> None:
    """cluster.actors.init_ray's job environment makes Ray empty CUDA_VISIBLE_DEVICES for actors
    with num_gpus 0 (Ray 2.60 no longer does by default), so device auto means cpu there; and
    gives every actor the thread policy (rollout.cores), even where the driver's own env lacks it."""
    out = subprocess.run([sys.executable, "-c", PROBE.format(root=str(ROOT))], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert json.loads(out.stdout.strip().splitlines()[-1]) == ["", "PASSIVE"]
