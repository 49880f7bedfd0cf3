"""One DeepSpeed learner update (no Ray): micro-batching must not change the result."""

from __future__ import annotations

import pytest
import torch

from learner.advantages.config import LiveBaselineConfig
from learner.config import LearnerConfig
from rollout.trajectory import LiveOrigin, Trajectory, Turn, window_start
from tests.dist_env import own_process_group

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module", autouse=True)
def _own_process_group():
    with own_process_group():
        yield


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
                                    prompt_ids=[5, 6, 7, 8 + g], turns=turns, outcome=float(r)))
    return trajs


def _update_gradients(policy: str, tmp_path, micro_batch_size: int, history_turns: int | None,
                      agg: str, lr: float = 1e-2, **learner) -> tuple[list[torch.Tensor], dict[str, torch.Tensor]]:
    """The gradients the optimizer receives for one update (after accumulation and clipping),
    and the weights after it. Gradients are what micro-batching must preserve: Adam divides
    each coordinate by its own gradient scale, so a coordinate whose gradient is ~0 turns float
    summation noise into an lr-sized move, and weights after Adam cannot be compared tightly."""
    from learner.worker import LearnerWorker

    cfg = LearnerConfig(batch_groups=2, micro_batch_size=micro_batch_size, lr=lr, zero_stage=1,
                        loss={"type": "ppo", "agg": agg}, **learner)
    worker = LearnerWorker(cfg, policy, str(tmp_path), ports=None, group_size=2, temperature=1.0)
    base = getattr(worker.ds_engine.optimizer, "optimizer", worker.ds_engine.optimizer)  # under ZeRO's wrapper
    seen: list[list[torch.Tensor]] = []
    base.register_step_pre_hook(lambda opt, args, kwargs: seen.append(
        [p.grad.detach().clone() for g in opt.param_groups for p in g["params"] if p.grad is not None]))
    metrics = worker._update(_trajectories(history_turns))
    assert metrics["tokens/rows"] == (8 if history_turns == 1 else 4)
    assert len(seen) == 1, "one optimizer step per update"
    return seen[0], {k: v.detach().clone() for k, v in worker.ds_engine.module.state_dict().items()}


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


@pytest.mark.parametrize("lora", [None, {"rank": 4, "alpha": 8, "dropout": 0.0, "publish": "merged"}])
def test_gradient_checkpointing_gives_the_same_update(tiny_policy, tmp_path, lora) -> None:
    """Layers recomputed in the backward (and no shared system-prompt pass) give the gradients
    the plain update gives, full fine-tuning and LoRA alike."""
    torch.manual_seed(0)  # the same LoRA initialisation for both
    plain, _ = _update_gradients(tiny_policy[0], tmp_path / "a", 3, 1, "token-mean", lora=lora)
    torch.manual_seed(0)
    checkpointed, _ = _update_gradients(tiny_policy[0], tmp_path / "b", 3, 1, "token-mean", lora=lora,
                                        gradient_checkpointing=True)
    assert len(plain) == len(checkpointed) > 0
    for w, c in zip(plain, checkpointed):
        scale = float(w.abs().max())
        torch.testing.assert_close(c, w, rtol=1e-4, atol=1e-5 * scale)


def test_learning_rate_zero_runs_the_update_and_keeps_the_weights(tiny_policy, tmp_path) -> None:
    """bench/pipeline.py freezes the policy with learner.lr=0: the update still computes its
    gradients and takes its optimizer step, and the weights stay the warm start's."""
    from safetensors.torch import load_file

    grads, after = _update_gradients(tiny_policy[0], tmp_path, 64, None, "token-mean", lr=0.0)
    assert any(float(g.abs().max()) > 0 for g in grads)
    start = load_file(f"{tiny_policy[0]}/model.safetensors")
    for k in start:
        if k in after:
            assert torch.equal(after[k], start[k]), k


def _worker(policy: str, tmp_path, **learner):
    from learner.worker import LearnerWorker

    cfg = LearnerConfig(batch_groups=2, micro_batch_size=3, zero_stage=1, **learner)
    return LearnerWorker(cfg, policy, str(tmp_path), ports=None, group_size=2, temperature=1.0)


def test_second_mini_batch_sees_a_moved_policy_and_clips(tiny_policy, tmp_path) -> None:
    # The PPO clip engages once a batch takes several optimizer steps.
    # 4 rows (no window) in 2 mini-batches of 2 rows: two optimizer steps
    # against old log-probs computed once before the first. Step 1 runs on the weights that
    # computed them, so its ratio is 1 on every token (min = max = 1, nothing clipped); step 2
    # runs after an Adam step of lr 5e-2, so its ratios differ from 1, and with clip epsilons
    # of 1e-3 some tokens leave [0.999, 1.001] and are clipped.
    worker = _worker(tiny_policy[0], tmp_path, lr=5e-2, mini_batches=2,
                     loss={"type": "ppo", "clip_low": 1e-3, "clip_high": 1e-3})
    metrics = worker._update(_trajectories(None))
    first, second = worker.update_metrics
    assert metrics["loss/updates"] == 2.0
    assert first["ratio_min"] == pytest.approx(1.0, abs=1e-6)
    assert first["ratio_max"] == pytest.approx(1.0, abs=1e-6)
    assert first["clip_frac"] == 0.0
    assert abs(second["ratio_max"] - 1.0) > 1e-3 or abs(second["ratio_min"] - 1.0) > 1e-3
    assert second["clip_frac"] > 0.0
    # the batch's metrics report the clip fraction (mean over the 2 steps) and ratio extremes
    assert metrics["loss/clip_frac"] == pytest.approx(second["clip_frac"] / 2)
    assert metrics["loss/ratio_max"] == max(first["ratio_max"], second["ratio_max"])
    # behaviour-policy TIS stays on: old log-probs are the learner's, the behaviour's -1.0
    assert 0.0 < metrics["loss/tis_mean"] <= 2.0


def test_epochs_reuse_the_old_logprobs(tiny_policy, tmp_path) -> None:
    # 2 epochs x 1 mini-batch: epoch 1's ratio is 1 (the old log-probs, computed with no grad
    # in eval mode, equal the training forward's), epoch 2's is not (the weights moved).
    worker = _worker(tiny_policy[0], tmp_path, lr=5e-2, ppo_epochs=2)
    metrics = worker._update(_trajectories(None))
    first, second = worker.update_metrics
    assert metrics["loss/updates"] == 2.0
    assert first["ratio_min"] == pytest.approx(1.0, abs=1e-6)
    assert first["ratio_max"] == pytest.approx(1.0, abs=1e-6)
    assert abs(second["ratio_max"] - 1.0) > 1e-3 or abs(second["ratio_min"] - 1.0) > 1e-3
    # the default (1 epoch, 1 mini-batch) is one on-policy step: ratio exactly 1
    one = _worker(tiny_policy[0], tmp_path / "one", lr=5e-2)
    out = one._update(_trajectories(None))
    assert out["loss/updates"] == 1.0 and out["loss/ratio_min"] == out["loss/ratio_max"] == 1.0
    with pytest.raises(ValueError, match=r"learner\.mini_batches=5 exceeds the batch's 4 rows"):
        _worker(tiny_policy[0], tmp_path / "many", mini_batches=5)._update(_trajectories(None))


def _sequence_logprob(model, prompt: list[int], action: list[int]) -> float:
    ids = torch.tensor([prompt + action])
    with torch.no_grad():
        logp = torch.log_softmax(model(ids).logits[0, :-1].float(), dim=-1)
    return float(sum(logp[len(prompt) - 1 + i, tok] for i, tok in enumerate(action)))


def test_live_sessions_with_higher_reward_gain_probability(tiny_policy, tmp_path) -> None:
    # Live episodes train. Two live sessions (groups of one, as the gateway records them) with
    # the same prompt and different answers; the client rated one 1.0 and the other 0.0. A
    # group baseline would give both advantage 0; the running baseline (here, before any
    # history, the other session's outcome) gives +1 and -1, and one DeepSpeed update moves
    # probability from the low-rated answer to the high-rated one.
    worker = _worker(tiny_policy[0], tmp_path, lr=1e-2)
    worker.live_groups = 2
    prompt, good, bad = [5, 6, 7, 8], [40, 41, 42, 43], [90, 91, 92, 93]
    sessions = [Trajectory(trajectory_id=name, task_id="live", group_id=f"live-{name}", prompt_ids=prompt,
                           turns=[Turn(action_ids=action, action_logprobs=[-1.0] * 4, policy_version=0)],
                           outcome=outcome, live=LiveOrigin(session_id=name))
                for name, action, outcome in (("good", good, 1.0), ("bad", bad, 0.0))]
    model = worker.ds_engine.module
    before = [_sequence_logprob(model, prompt, a) for a in (good, bad)]
    metrics = worker._update(sessions)
    after = [_sequence_logprob(model, prompt, a) for a in (good, bad)]
    assert metrics["adv/abs_mean"] == pytest.approx(1.0)
    assert after[0] > before[0] + 0.1 and after[1] < before[1] - 0.1
    # the baseline now has history: the EMA (decay 0.9) of 1.0 then 0.0 is m1 = 0.9 * 0.1 =
    # 0.09, bias-corrected by 1 - 0.9^2 = 0.19: mean 9/19, saved with the next checkpoint
    assert worker.advantages.state["outcome"].n == 2
    assert worker.advantages.state["outcome"].mean_var(0.9)[0] == pytest.approx(9 / 19)


def test_a_mixed_batch_gives_groups_their_estimator_and_sessions_the_running_baseline(tiny_policy, tmp_path) -> None:
    # train.source: mixed. One rollout group (outcomes 0 and 1) and one live session (outcome
    # 1, no history): GRPO z-scores the group, (r - 0.5) / (std([0, 1], unbiased) + eps 1e-6)
    # = -/+ 0.5 / (sqrt(0.5) + 1e-6) on each of its 3 turns; the session's baseline is 0 and its scale 1 (nothing to compare with
    # yet), so its one turn gets 1.0. Rows come back with the group first, the session last.
    worker = _worker(tiny_policy[0], tmp_path)
    group = _trajectories(None)[:2]
    session = Trajectory(trajectory_id="s", task_id="live", group_id="live-s", prompt_ids=[5, 6, 7],
                         turns=[Turn(action_ids=[40, 41], action_logprobs=[-1.0, -1.0], policy_version=0)],
                         outcome=1.0, live=LiveOrigin(session_id="s"))
    ordered, res, mask = worker.advantages([session, *group])
    assert [t.trajectory_id for t in ordered] == ["00", "01", "s"]
    z = 0.5 / (0.5 ** 0.5 + 1e-6)
    assert res.advantages.tolist() == pytest.approx([-z] * 3 + [z] * 3 + [1.0])
    assert mask.all() and worker.advantages.state["outcome"].n == 1


def _lone_rank(script: str, tmp_path) -> str:
    """The last line ``script`` prints, run as a fresh process with no process-group settings
    in its environment (a lone learner rank's), its torch extensions built under ``tmp_path``."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE")}
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                         env={**env, "TORCH_EXTENSIONS_DIR": str(tmp_path), "DS_BUILD_OPS": "0"},
                         cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout.splitlines()[-1]


def test_a_lone_cpu_rank_builds_no_shared_memory_comm_op(tmp_path) -> None:
    # DeepSpeed would compile its shared-memory all-reduce (~40 s on a fresh machine) for a
    # rank that has no peer; the group still comes up (gloo) and reduces.
    script = ("import torch, deepspeed.ops\n"
              "from learner.deepspeed_setup import init_distributed\n"
              "init_distributed(torch.device('cpu'))\n"
              "t = torch.ones(3); torch.distributed.all_reduce(t)\n"
              "print(deepspeed.ops.__compatible_ops__['deepspeed_shm_comm'], t.tolist())\n")
    assert _lone_rank(script, tmp_path) == "False [1.0, 1.0, 1.0]"
    assert not any(tmp_path.iterdir())  # nothing was compiled


def test_a_lone_rank_whose_picked_port_was_taken_picks_another(tmp_path) -> None:
    # The port picked free was taken by another process before the store bound it (seen in
    # make test: EADDRINUSE in a learner's constructor): here the picker's first port is one
    # this test listens on, as that other process would.
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        script = ("import os, torch, learner.deepspeed_setup as d\n"
                  f"ports, real = iter([{port}]), d.free_port\n"
                  "d.free_port = lambda host='127.0.0.1': next(ports, None) or real(host)\n"
                  "d.init_distributed(torch.device('cpu'))\n"
                  "t = torch.ones(2); torch.distributed.all_reduce(t)\n"
                  "print(os.environ['MASTER_PORT'], t.tolist())\n")
        master_port, reduced = _lone_rank(script, tmp_path).split(" ", 1)
    assert int(master_port) != port and reduced == "[1.0, 1.0]"


def test_turns_a_grammar_constrained_stay_out_of_the_loss_unless_asked(tiny_policy, tmp_path) -> None:
    # A live session of two turns, the second sampled under tool_choice=required (its recorded
    # log-probs are the masked distribution's): only the first is trained, and both with
    # learner.live_baseline.train_constrained.
    worker = _worker(tiny_policy[0], tmp_path)
    turns = [Turn(action_ids=[40, 41], action_logprobs=[-1.0, -1.0], policy_version=0, observation_ids=[9]),
             Turn(action_ids=[42, 43], action_logprobs=[-0.5, 0.0], policy_version=0)]
    session = Trajectory(trajectory_id="s", task_id="live", group_id="live-s", prompt_ids=[5, 6, 7], turns=turns,
                         outcome=1.0, live=LiveOrigin(session_id="s", constrained={1: "tool_choice_required"}))
    _, _, mask = worker.advantages([session])
    assert mask.tolist() == [True, False]
    worker.advantages.live = LiveBaselineConfig(train_constrained=True)
    _, _, mask = worker.advantages([session])
    assert mask.tolist() == [True, True]
