"""Every example of docs/envs.md ("Bring your environment": examples/envs/*.yaml) loads as a run
config and plays through the real rollout path: a RolloutWorker on the tiny policy's HF engine
plays a group of its episodes, records their tokens as for every environment (an OpenEnv reset's
observation in the prompt), takes the environment's grade as the outcome where the environment
grades, and the reward stage scores them. The servers the examples name are real processes
(mcp-server-time, examples/envs/guess_server.py under uvicorn)."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import pytest

from cluster.config import load_config
from rewards.config import RewardsConfig
from rewards.inline import score_cheap
from rollout import chat
from rollout.config import HFEngineConfig, RolloutConfig
from rollout.engines import local_client
from rollout.engines.base import SamplingParams
from rollout.worker import RolloutWorker

pytestmark = pytest.mark.slow  # starts MCP and OpenEnv servers beside a tiny engine (~40 s)
ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = sorted((ROOT / "examples" / "envs").glob("*.yaml"))
RUN_CONFIGS = [p for p in EXAMPLES if p.name != "time_tasks.yaml"]
NEEDS = {"reasoning_gym": "reasoning_gym", "mcp_tasks": "mcp_server_time", "openenv": "openenv.core",
         "verifiers": "verifiers"}
NO_DEMOS = ("openenv", "verifiers")


def test_docs_show_every_example() -> None:
    assert [p.name for p in RUN_CONFIGS] == ["custom.yaml", "mcp_tasks.yaml", "openenv.yaml", "reasoning_gym.yaml",
                                           "verifiers.yaml"]
    page = (ROOT / "docs" / "envs.md").read_text()
    assert all(f"examples/envs/{p.name}" in page for p in EXAMPLES)
    for shown in ("sums.py", "vf_sums.py"):  # shown in full
        assert "```python\n" + (ROOT / "examples" / "envs" / shown).read_text() + "```" in page


@pytest.mark.parametrize("path", RUN_CONFIGS, ids=[p.stem for p in RUN_CONFIGS])
def test_an_example_plays_and_scores_through_a_rollout_worker(tiny_policy, path: Path, monkeypatch) -> None:
    monkeypatch.chdir(ROOT)  # the examples name files relative to the repository root
    monkeypatch.syspath_prepend(str(ROOT))  # env.source examples.envs.sums
    cfg = load_config(path, [])
    env = cfg.env
    pytest.importorskip(NEEDS.get(env.type, "envs"))
    servers = [*getattr(env, "mcp", []), *([env.server] if env.type == "openenv" else [])]
    for server in servers:  # `python` in the examples: this interpreter, which has the servers installed
        server.command = sys.executable
    engine = local_client(HFEngineConfig(), tiny_policy[0], seed=0)
    worker = RolloutWorker(0, RolloutConfig(max_new_tokens=24), env, engine, seed=0, ports=None)
    source = worker.source
    task = source.tasks("train")[0]
    try:
        group = asyncio.run(worker.run_group(task, 2, SamplingParams(temperature=1.0, max_new_tokens=24)))
        demo = None if env.type in NO_DEMOS else source.demonstration(task)
    finally:
        for closable in (getattr(source, "mcp", None), getattr(source, "server", None)):
            if closable is not None:
                getattr(closable, "close", getattr(closable, "stop", None))()
    tok = engine.tokenizer
    opening = [{"role": "user", "content": "I picked a number from 1 to 20. Guess it."}] if env.type == "openenv" else []
    for traj in group.trajectories:
        assert traj.error is None, traj.error
        assert traj.prompt_ids == chat.prompt_ids(tok, [*task.messages, *opening], task.tools)
        for turn in traj.turns:
            assert tok.decode(turn.action_ids, skip_special_tokens=True) == turn.text
        score_cheap(traj, RewardsConfig())
        if source.scores_outcome:
            assert traj.env_outcome == sum(t.rewards["env"] for t in traj.turns) == traj.outcome
            assert traj.success == (traj.env_outcome >= source.success_at)
        else:
            assert traj.env_outcome is None and traj.outcome in (0.0, 1.0)
    if demo is not None:  # its demonstration ends with the gold answer, as SFT would train it
        assert demo[-1]["content"] == f"<answer>{task.gold_answers[0]}</answer>"
