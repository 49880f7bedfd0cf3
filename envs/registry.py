"""The environment registry: config ``type`` -> factory building a :class:`TaskSource`.

Factories import their environment lazily, so loading the registry (or validating a config)
does not import bm25s, subprocess tooling or any environment module.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

from pydantic import BaseModel, TypeAdapter

from envs.base import TaskSource
from envs.config import EnvConfig


def _search_qa(cfg: Any) -> TaskSource:
    from envs.search_qa.source import build_search_qa

    return build_search_qa(cfg)


def _tool_use(cfg: Any) -> TaskSource:
    from envs.tool_use.source import ToolUseTaskSource

    return ToolUseTaskSource(cfg)


def _household(cfg: Any) -> TaskSource:
    from envs.household.source import HouseholdTaskSource

    return HouseholdTaskSource(cfg)


def _bfcl(cfg: Any) -> TaskSource:
    from envs.bfcl.source import BfclTaskSource

    return BfclTaskSource(cfg)


def _reasoning_gym(cfg: Any) -> TaskSource:
    from envs.reasoning_gym import ReasoningGymTaskSource

    return ReasoningGymTaskSource(cfg)


def _mcp_tasks(cfg: Any) -> TaskSource:
    from envs.mcp.tasks import McpTasksSource

    return McpTasksSource(cfg)


def _openenv(cfg: Any) -> TaskSource:
    from envs.openenv.source import OpenEnvSource

    return OpenEnvSource(cfg)


def _custom(cfg: Any) -> TaskSource:
    module_name, _, name = cfg.source.partition(":")
    try:
        factory = getattr(importlib.import_module(module_name), name)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"env.source {cfg.source!r} cannot be imported: {exc}") from None
    try:
        source = factory(**cfg.args)
    except TypeError as exc:
        raise ValueError(f"env.args do not fit env.source {cfg.source!r}: {exc}") from None
    if not isinstance(source, TaskSource):
        raise ValueError(f"env.source {cfg.source!r} returned a {type(source).__name__}, not an envs.base.TaskSource")
    return source


ENVS: dict[str, Callable[[Any], TaskSource]] = {
    "search_qa": _search_qa,
    "tool_use": _tool_use,
    "household": _household,
    "bfcl": _bfcl,
    "reasoning_gym": _reasoning_gym,
    "mcp_tasks": _mcp_tasks,
    "openenv": _openenv,
    "custom": _custom,
}
"""Config ``type`` -> factory. A new environment is a config class in ``envs.config`` plus an
entry here."""


WRAPPED_FOR_MCP = {"search_qa", "household", "bfcl"}
"""Types whose ``env.mcp`` tools come through ``envs.mcp.wrap`` (their episodes parse their own
action vocabularies); tool_use, reasoning_gym and mcp_tasks call MCP tools in their own tool loop."""


def make_task_source(cfg: BaseModel | dict[str, Any]) -> TaskSource:
    """Build the task source of ``cfg`` (a config model, or a dict validated as one)."""
    env_type = cfg.get("type") if isinstance(cfg, dict) else getattr(cfg, "type", None)
    if env_type not in ENVS:
        raise ValueError(
            f"unknown environment type {env_type!r}; known types: {', '.join(sorted(ENVS))}"
        )
    if isinstance(cfg, dict):
        cfg = TypeAdapter(EnvConfig).validate_python(cfg)
    source = ENVS[env_type](cfg)
    if getattr(cfg, "mcp", None) and env_type in WRAPPED_FOR_MCP:
        from envs.mcp.wrap import McpToolsSource

        source = McpToolsSource(source, cfg.mcp)
    return source
