"""What the vLLM engine sets up before vLLM starts: the environment its processes read, and the
shapes of the checkpoint it serves (what every later weights load must fit)."""

from __future__ import annotations

import json
import os
from pathlib import Path

from rollout.config import VLLMEngineConfig
from rollout.cores import thread_policy_env


def vllm_env(cfg: VLLMEngineConfig) -> None:
    """Settings vLLM's CPU build reads from the environment when its processes start; an
    operator's own values win."""
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", f"{cfg.cpu_kv_cache_gib:g}")
    # Binding OpenMP threads to cores fights Ray's and the learner's threads on shared CPUs.
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    os.environ.setdefault("OMP_NUM_THREADS", str(cfg.torch_threads))
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    # vLLM's engine processes start after this one loaded OpenMP: they read the policy fresh.
    for key, value in thread_policy_env().items():
        os.environ.setdefault(key, value)


def checkpoint_shapes(model_path: str) -> dict[str, tuple[int, ...]]:
    """Parameter name -> shape of the Hugging Face checkpoint the engine was started from,
    read from the safetensors headers (no tensor is loaded)."""
    from safetensors import safe_open

    folder = Path(model_path)
    index = folder / "model.safetensors.index.json"
    files = sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.exists() else ["model.safetensors"]
    shapes: dict[str, tuple[int, ...]] = {}
    for name in files:
        with safe_open(str(folder / name), framework="pt") as f:
            shapes.update({k: tuple(f.get_slice(k).get_shape()) for k in f.keys()})
    return shapes
