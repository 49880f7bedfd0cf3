"""The environment registry: config ``type`` -> factory building a :class:`TaskSource`.

Factories import their environment lazily, so loading the registry (or validating a config)
does not import bm25s, subprocess tooling or any environment module.
"""

from __future__ import annotations

import importlib
from typing import Any

from pydantic import BaseModel, TypeAdapter

from envs.base import TaskSource
from envs.config import EnvConfig


def load_object(spec: str) -> Any:
    """``package.module:name`` -> that object, its module imported now (ImportError,
    AttributeError when it is not there)."""
    module_name, _, name = spec.partition(":")
    return getattr(importlib.import_module(module_name), name)


ENVS: dict[str, str] = {
    "search_qa": "envs.search_qa.source:build_search_qa",
    "tool_use": "envs.tool_use.source:ToolUseTaskSource",
    "household": "envs.household.source:HouseholdTaskSource",
    "bfcl": "envs.bfcl.source:BfclTaskSource",
    "reasoning_gym": "envs.reasoning_gym.source:ReasoningGymTaskSource",
    "mcp_tasks": "envs.mcp.tasks:McpTasksSource",
    "openenv": "envs.openenv.source:OpenEnvSource",
    "verifiers": "envs.verifiers.source:VerifiersSource",
    "custom": "envs.registry:build_custom",
}
"""Config ``type`` -> the factory that builds its source from the config, as an import path (so
nothing is imported until a source is built). A new environment is a config class in
``envs.config`` plus an entry here."""


def build_custom(cfg: Any) -> TaskSource:
    """``env.type: custom``: the source ``env.source`` builds from ``env.args``; errors name the field."""
    try:
        factory = load_object(cfg.source)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"env.source {cfg.source!r} cannot be imported: {exc}") from None
    try:
        source = factory(**cfg.args)
    except TypeError as exc:
        raise ValueError(f"env.args do not fit env.source {cfg.source!r}: {exc}") from None
    if not isinstance(source, TaskSource):
        raise ValueError(f"env.source {cfg.source!r} returned a {type(source).__name__}, not an envs.base.TaskSource")
    return source


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
    source = load_object(ENVS[env_type])(cfg)
    if getattr(cfg, "mcp", None) and env_type in WRAPPED_FOR_MCP:
        from envs.mcp.wrap import McpToolsSource

        source = McpToolsSource(source, cfg.mcp)
    return source
