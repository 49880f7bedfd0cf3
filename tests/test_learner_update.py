"""One DeepSpeed learner update (no Ray): micro-batching must not change the result."""

from __future__ import annotations

import pytest
import torch

from learner.config import LearnerConfig
from rollout.trajectory import Trajectory, Turn, window_start

pytestmark = pytest.mark.slow

_DIST_ENV = ("MASTER_ADDR", "MASTER_PORT", "RANK", "LOCAL_RANK", "WORLD_SIZE")


@pytest.fixture(scope="module", autouse=True)
def _own_process_group():
    """The learner initialises torch.distributed in this process and exports MASTER_PORT;
    later tests start learners in subprocesses that would inherit that port, already bound
    here. Restore the environment and release the port when done."""
    import os

    saved = {k: os.environ.get(k) for k in _DIST_ENV}
    yield
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


def _trajectories(history_turns: int | None) -> list[Trajectory]:
    """2 groups x 2 rollouts of 3 turns; outcomes differ within each group, so GRPO gives
    non-zero advantages. With a window of 1 each trajectory is 2 rows (8 in all)."""
    gen = torch.Generator().manual_seed(0)
    trajs = []
    for g in range(2):
        for r in range(2):
            turns = [Turn(action_ids=torch.randint(5, 200, (4,), generator=gen).tolist(),
                          action_logprobs=[-1.0] * 4, policy_version=0,
                          observation_ids=torch.randint(5, 200, (6,), generator=gen).tolist() if t < 2 else [],
                          context_start=window_start(t, history_turns)) for t in range(3)]
            trajs.append(Trajectory(trajectory_id=f"{g}{r}", task_id=f"task{g}", group_id=f"g{g}",
                                    prompt_ids=[5, 6, 7, 8 + g], turns=turns, outcome=float(r),
                                    metadata={"on_missing": "mask_turn"}))
    return trajs


def _update_gradients(policy: str, tmp_path, micro_batch_size: int, history_turns: int | None,
                      agg: str) -> tuple[list[torch.Tensor], dict[str, torch.Tensor]]:
    """The gradients the optimizer receives for one update (after accumulation and clipping),
    and the weights after it. Gradients are what micro-batching must preserve: Adam divides
    each coordinate by its own gradient scale, so a coordinate whose gradient is ~0 turns float
    summation noise into an lr-sized move, and weights after Adam cannot be compared tightly."""
    from learner.worker import LearnerWorker

    cfg = LearnerConfig(batch_groups=2, micro_batch_size=micro_batch_size, lr=1e-2, zero_stage=1,
                        loss={"type": "ppo", "agg": agg})
    worker = LearnerWorker(cfg, policy, str(tmp_path), ports=None, group_size=2, temperature=1.0)
    base = getattr(worker.engine.optimizer, "optimizer", worker.engine.optimizer)  # under ZeRO's wrapper
    seen: list[list[torch.Tensor]] = []
    base.register_step_pre_hook(lambda opt, args, kwargs: seen.append(
        [p.grad.detach().clone() for g in opt.param_groups for p in g["params"] if p.grad is not None]))
    metrics = worker._update(_trajectories(history_turns))
    assert metrics["tokens/rows"] == (8 if history_turns == 1 else 4)
    assert len(seen) == 1, "one optimizer step per update"
    return seen[0], {k: v.detach().clone() for k, v in worker.engine.module.state_dict().items()}


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean"])
def test_micro_batches_of_any_count_give_the_one_batch_update(tiny_policy, tmp_path, agg) -> None:
    policy = tiny_policy[0]
    whole, after = _update_gradients(policy, tmp_path / "a", 64, 1, agg)
    # 8 windowed rows in micro-batches of 3: three backward passes where DeepSpeed was
    # configured for ceil(4 rollouts / 3) = 2; the boundary is set by hand on the last
    split, _ = _update_gradients(policy, tmp_path / "b", 3, 1, agg)
    assert len(whole) == len(split) and len(whole) > 0
    # A missed, extra or mis-weighted micro-batch changes the gradient by a share of itself
    # (>= 1/8 of a row's contribution); float summation order changes it by ~1e-7 relative.
    # Tolerances scale with the gradient so the check is as tight for tiny coordinates.
    for w, s in zip(whole, split):
        scale = float(w.abs().max())
        assert scale > 0
        torch.testing.assert_close(s, w, rtol=1e-4, atol=1e-5 * scale)
    # and the update did something: weights moved from the warm start
    from safetensors.torch import load_file

    start = load_file(f"{policy}/model.safetensors")
    assert any(not torch.allclose(after[k], start[k]) for k in start if k in after)
