"""Inference engines, keyed by ``rollout.engine.type``, and the service around them.

An engine turns prompt token ids into sampled token ids with their behaviour log-probs and the
weights version of every token (``base``). Engines run as services (``server``: a Ray actor
each, an engine group per run) that rollout workers and the live gateway reach through one
client interface (``client``); new weights arrive through a transport handle (``transport``).
Requests are independent coroutines with ids, so an engine may batch them (HF), schedule them
continuously (vLLM) or stream them to outside callers without the episode code changing.
"""

from __future__ import annotations

from typing import Any, Callable

from rollout.engines.base import Completion, Engine, SamplingParams


def _hf(cfg: Any, model_path: str, seed: int) -> Engine:
    from rollout.engines.hf import HFEngine

    return HFEngine(cfg, model_path, seed)


def _vllm(cfg: Any, model_path: str, seed: int) -> Engine:
    from rollout.engines.vllm import VLLMEngine

    return VLLMEngine(cfg, model_path, seed)


ENGINES: dict[str, Callable[[Any, str, int], Engine]] = {"hf": _hf, "vllm": _vllm}


def make_engine(cfg: Any, model_path: str, seed: int = 0) -> Engine:
    try:
        factory = ENGINES[cfg.type]
    except KeyError:
        raise ValueError(f"rollout.engine.type: unknown engine {cfg.type!r}; known: {sorted(ENGINES)}") from None
    return factory(cfg, model_path, seed)


def local_client(cfg: Any, model_path: str, seed: int = 0) -> Any:
    """An engine in this process behind the client interface (tests, benches, tools)."""
    from rollout.engines.client import LocalEngineClient
    from rollout.engines.server import EngineServer

    return LocalEngineClient(EngineServer(cfg, model_path, seed))


__all__ = ["Completion", "Engine", "SamplingParams", "ENGINES", "make_engine", "local_client"]
