"""A learner's checkpoint round trip in one process (``learner.checkpoints``, no Ray): a
trajectory-balance learner trains one batch, saves, and a learner built with ``resume`` reads
back its step, version, weights, log Z table and task codes."""

from __future__ import annotations

import json

import pytest
import torch

from learner.checkpoints import checkpoint_tag, log_z_path
from learner.config import LearnerConfig
from learner.ports import LocalLearnerPorts
from replay.config import ReplayConfig
from replay.memory import InProcessReplayStore
from rollout.trajectory import Trajectory, Turn
from tests.dist_env import own_process_group

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module", autouse=True)
def _own_process_group():
    with own_process_group():
        yield


def _trajectories() -> list[Trajectory]:
    """Two tasks, two rollouts each, one turn; outcomes 0.2 and 1.0."""
    return [Trajectory(trajectory_id=f"{g}{r}", task_id=f"task{g}", group_id=f"g{g}",
                       prompt_ids=[5, 6, 7], outcome=0.2 + 0.8 * r,
                       turns=[Turn(action_ids=[10 + g, 11, 12], action_logprobs=[-1.0] * 3, policy_version=0)])
            for g in range(2) for r in range(2)]


def test_a_saved_checkpoint_resumes_weights_log_z_and_task_codes(tiny_policy, tmp_path) -> None:
    from learner.worker import LearnerWorker

    cfg = LearnerConfig(batch_groups=2, lr=1e-2, zero_stage=1,
                        loss={"type": "trajectory_balance", "log_z": "learned"})
    ports = LocalLearnerPorts(InProcessReplayStore(ReplayConfig(), 2))

    def learner(resume: bool) -> LearnerWorker:
        return LearnerWorker(cfg, tiny_policy[0], str(tmp_path), ports, group_size=2,
                             temperature=1.0, resume=resume)

    first = learner(False)
    initial = first.log_z.table.weight.detach().clone()
    first._update(_trajectories())
    first.step, first.version = 1, 1
    path = first.save_checkpoint()
    assert path == str(tmp_path / "checkpoints" / "step_000001") and checkpoint_tag(1) == "step_000001"
    assert log_z_path(tmp_path, "step_000001").exists()
    state = json.loads((tmp_path / "state.json").read_text())
    assert (state["step"], state["version"], state["ds_tag"]) == (1, 1, "step_000001")
    weights = {k: v.clone() for k, v in first.ds_engine.module.state_dict().items()}
    table = first.log_z.state_dict()

    again = learner(True)
    assert (again.step, again.version, again.resumed_from) == (1, 1, (1, 1))
    assert again.task_codes == {"task0": 0, "task1": 1}
    for k, v in again.log_z.state_dict().items():
        torch.testing.assert_close(v, table[k])
    assert not torch.equal(table["table.weight"], initial)  # it trained: a real round trip
    for k, v in again.ds_engine.module.state_dict().items():
        torch.testing.assert_close(v, weights[k])
