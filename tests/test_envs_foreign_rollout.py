"""Environments from other ecosystems through the real rollout path: a RolloutWorker on the tiny
policy's HF engine plays reasoning-gym, MCP-task and OpenEnv episodes, records their tokens as
for every environment (the OpenEnv reset's observation in the prompt), takes the environment's
grade as the episode's outcome, and scores it through the reward stage."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import pytest
import yaml

from rewards.config import RewardsConfig
from rewards.inline import score_cheap
from rollout import chat
from rollout.config import HFEngineConfig, RolloutConfig
from rollout.engines import local_client
from rollout.engines.base import SamplingParams
from rollout.worker import RolloutWorker

pytestmark = pytest.mark.slow  # starts MCP and OpenEnv servers beside a tiny engine (~40 s)
TESTS = Path(__file__).parent


def _configs(tmp_path: Path) -> dict[str, dict]:
    tasks = tmp_path / "tasks.yaml"
    tasks.write_text(yaml.safe_dump([{"prompt": "Add 19 and 23.", "answers": ["42"],
                                      "gold_calls": [{"name": "add", "arguments": {"a": 19, "b": 23}}]}]))
    return {
        "reasoning_gym": {"type": "reasoning_gym", "num_train_tasks": 2, "num_heldout_tasks": 1,
                          "tasks": [{"name": "basic_arithmetic"}], "tools": ["python"], "max_turns": 2},
        "mcp_tasks": {"type": "mcp_tasks", "max_turns": 2, "train_path": str(tasks), "heldout_path": str(tasks),
                      "mcp": [{"name": "test", "command": sys.executable, "args": [str(TESTS / "mcp_server.py")]}]},
        "openenv": {"type": "openenv", "num_train_tasks": 2, "num_heldout_tasks": 1, "max_turns": 2,
                    "server": {"name": "guess", "command": sys.executable, "args": [str(TESTS / "openenv_server.py"), "{port}"]}},
    }


@pytest.mark.parametrize("env_type", ["reasoning_gym", "mcp_tasks", "openenv"])
def test_a_rollout_worker_plays_and_scores_a_foreign_environment(tiny_policy, tmp_path: Path, env_type: str) -> None:
    pytest.importorskip({"reasoning_gym": "reasoning_gym", "mcp_tasks": "mcp", "openenv": "openenv.core"}[env_type])
    engine = local_client(HFEngineConfig(), tiny_policy[0], seed=0)
    cfg = RolloutConfig(max_new_tokens=24)
    worker = RolloutWorker(0, cfg, _configs(tmp_path)[env_type], engine, seed=0, ports=None)
    source = worker.source
    task = source.tasks("train")[0]
    try:
        group = asyncio.run(worker.run_group(task, 2, SamplingParams(temperature=1.0, max_new_tokens=24)))
    finally:
        if getattr(source, "mcp", None) is not None:
            source.mcp.close()
        if getattr(source, "server", None) is not None:
            source.server.stop()
    tok = engine.tokenizer
    for traj in group.trajectories:
        assert traj.error is None, traj.error
        opening = [{"role": "user", "content": "I picked a number from 1 to 20. Guess it."}] if env_type == "openenv" else []
        assert traj.prompt_ids == chat.prompt_ids(tok, [*task.messages, *opening], task.tools)
        for turn in traj.turns:
            assert tok.decode(turn.action_ids, skip_special_tokens=True) == turn.text
        assert traj.env_outcome == sum(t.rewards["env"] for t in traj.turns)
        assert traj.success == (traj.env_outcome >= source.success_at)
        score_cheap(traj, RewardsConfig())
        assert traj.outcome == traj.env_outcome  # the environment's grade, not a match of the answer
