"""The reference loop (examples/reference_loop.py) trains with the real parts in one process:
every step's loss is finite, replay accepts every group, the learner's version advances, and
the engine serves the learner's new weights, which differ from the warm start's."""

from __future__ import annotations

import asyncio
import importlib.util
import math
from pathlib import Path

import pytest
import torch

from tests.dist_env import own_process_group

pytestmark = pytest.mark.slow  # DeepSpeed in this process (~8 s), on the agent warm start (~85 s to build once)

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def reference_loop():
    """The example as a module. Its learner joins a process group of one in this process and
    exports MASTER_PORT, which later tests' learner subprocesses would inherit, already bound
    here: the environment is restored and the group released afterwards."""
    spec = importlib.util.spec_from_file_location("reference_loop", ROOT / "examples" / "reference_loop.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    with own_process_group():
        yield module


def test_reference_loop_trains_and_the_engine_serves_the_new_weights(reference_loop, agent_policy,
                                                                      tiny_run_config, tmp_path) -> None:
    from safetensors.torch import load_file

    from rollout.engines.base import SamplingParams

    # The agent warm start (300 SFT steps) searches and answers in about a third of its
    # episodes: a group whose outcomes are all equal has no GRPO advantage, and token F1 with a
    # penalty for ending without an answer (IGPO's F1 reward) tells more of its episodes apart.
    # lr 1e-4: at 1e-3 one Adam step moved every weight far enough that the policy stopped
    # answering at all, so only step 1 could carry an advantage (CI once drew it uniform); at
    # 1e-4 every step answers about as often, and all six groups come out uniform with
    # probability ~(0.65^4)^6, about 3e-5.
    cfg = tiny_run_config(["policy.sft.steps=300", "rollout.group_size=4", "learner.batch_groups=2",
                           "learner.micro_batch_size=8", "learner.lr=1e-4",
                           "rewards.outcome.metric=f1", "rewards.outcome.format_penalty=-1.0"])
    run = asyncio.run(reference_loop.train(cfg, 3, str(tmp_path)))
    assert run.policy == agent_policy[0]  # the session's cached warm start, not a second SFT
    assert [m["step"] for m in run.history] == [1, 2, 3]
    assert [m["version"] for m in run.history] == [1, 2, 3]
    assert [m["serving"] for m in run.history] == [1, 2, 3]  # the engine loaded each version at once
    assert [m["accepted"] for m in run.history] == [2, 2, 2]  # B groups admitted, scored and accepted
    for m in run.history:
        assert math.isfinite(m["loss/loss"]) and math.isfinite(m["loss/grad_norm"])
        assert m["tokens/rows"] == 8  # 2 groups x 4 episodes
    assert any(m["adv/abs_mean"] > 0 and m["loss/grad_norm"] > 0 for m in run.history)
    assert run.replay.stats().version == 3  # the learner acknowledged every batch
    # the engine samples with version 3, and its weights are the learner's, moved off the start
    completion = asyncio.run(run.engine.generate([5, 6, 7], SamplingParams(max_new_tokens=4)))
    assert completion.version == 3
    served = run.engine.engine.model.state_dict()
    learned = run.learner.ds_engine.module.state_dict()
    start = load_file(f"{agent_policy[0]}/model.safetensors")
    shared = [k for k in start if k in served and k in learned]
    assert shared
    for k in shared:
        torch.testing.assert_close(served[k].float(), learned[k].float(), rtol=0, atol=0)
    assert any(not torch.allclose(served[k].float(), start[k].float()) for k in shared)
