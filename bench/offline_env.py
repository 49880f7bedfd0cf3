"""The environment a bench and the runs it starts get, unless the caller set otherwise: Ray
without usage stats or an auth token, no model hub (nothing may download weights), tokenizers
without their own thread pool, DeepSpeed without building ops (what the Makefile exports for the
tests)."""

from __future__ import annotations

import os

OFFLINE_ENV = {"RAY_USAGE_STATS_ENABLED": "0", "RAY_AUTH_MODE": "disabled", "HF_HUB_OFFLINE": "1",
               "TOKENIZERS_PARALLELISM": "false", "DS_BUILD_OPS": "0"}


def offline_env() -> dict[str, str]:
    """This process's environment with ``OFFLINE_ENV``'s defaults filled in (for a subprocess)."""
    return {**OFFLINE_ENV, **os.environ}


def use_offline_env() -> None:
    """Fill ``OFFLINE_ENV``'s defaults into this process's environment (before Ray starts)."""
    for key, value in OFFLINE_ENV.items():
        os.environ.setdefault(key, value)
