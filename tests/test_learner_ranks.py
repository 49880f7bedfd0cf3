"""A learner of two ranks (gloo, one process each, on this machine) takes the update one rank
takes on the same batch; only rank 0 claims from replay; the run's driver places the ranks."""

from __future__ import annotations

import json
import multiprocessing
import os

import pytest
import torch

from learner.config import LearnerConfig
from learner.deepspeed_setup import free_port
from rollout.trajectory import Group, Trajectory, Turn, window_start

pytestmark = pytest.mark.slow


def _groups() -> list[Group]:
    """2 groups x 2 rollouts of 3 turns with a history window of 1: 8 rows of different
    widths; outcomes differ within each group, so GRPO gives non-zero advantages."""
    gen = torch.Generator().manual_seed(0)
    groups = []
    for g in range(2):
        trajs = []
        for r in range(2):
            turns = [Turn(action_ids=torch.randint(5, 200, (3 + t,), generator=gen).tolist(),
                          action_logprobs=[-1.0] * (3 + t), policy_version=0,
                          observation_ids=torch.randint(5, 200, (6,), generator=gen).tolist() if t < 2 else [],
                          context_start=window_start(t, 1)) for t in range(3)]
            trajs.append(Trajectory(trajectory_id=f"{g}{r}", task_id=f"task{g}", group_id=f"g{g}",
                                    prompt_ids=[5, 6, 7, 8 + g + r], turns=turns, outcome=float(r)))
        groups.append(Group(group_id=f"g{g}", task_id=f"task{g}", trajectories=trajs))
    return groups


def _rank_main(rank: int, world: int, port: int, policy: str, run_dir: str, cfg_json: str, out: str) -> None:
    """One learner rank: rank 0 claims the batch from a real in-process replay store; every
    rank takes one train_step; what the optimizer saw and the weights after go to ``out``."""
    from learner.deepspeed_setup import DistSpec, full_state_dict
    from learner.ports import LocalLearnerPorts
    from learner.worker import LearnerWorker
    from replay.config import ReplayConfig
    from replay.memory import InProcessReplayStore

    cfg = LearnerConfig.model_validate_json(cfg_json)
    if cfg.device == "cuda":  # what Ray does for a rank: show it its own GPU only
        os.environ["CUDA_VISIBLE_DEVICES"] = str(rank)
    torch.manual_seed(0)
    ports = None
    if rank == 0:
        store = InProcessReplayStore(ReplayConfig(), batch_groups=cfg.batch_groups)
        for group in _groups():
            assert store.reserve(1) == 1 and store.put(group).accepted
        ports = LocalLearnerPorts(store)
    worker = LearnerWorker(cfg, policy, run_dir, ports, group_size=2, temperature=1.0,
                           dist=DistSpec(rank, world, "127.0.0.1", port))
    base = getattr(worker.ds_engine.optimizer, "optimizer", worker.ds_engine.optimizer)
    grads: list[list[torch.Tensor]] = []
    base.register_step_pre_hook(lambda opt, args, kwargs: grads.append(
        [p.grad.detach().clone() for g in opt.param_groups for p in g["params"] if p.grad is not None]))
    metrics = worker.train_step()
    torch.save({"metrics": metrics, "updates": worker.update_metrics, "grads": grads,
                "weights": full_state_dict(worker.ds_engine),
                "log_z": None if worker.log_z is None else worker.log_z.state_dict(),
                "acked": None if ports is None else ports.store.stats().trained,
                "retained": None if ports is None else ports.store.stats().retained,
                "published": None if ports is None else ports.published[0]}, out)


def _train(policy: str, tmp_path, *worlds: int, **learner) -> list[list[dict]]:
    """One step of a learner of each size in ``worlds``, all started at once (they share the
    cores while importing), one process per rank; per learner, each rank's record."""
    cfg = LearnerConfig(batch_groups=2, lr=1e-2, **learner).model_dump_json()
    ctx = multiprocessing.get_context("spawn")
    procs, outs = [], []
    for world in worlds:
        run_dir, port = tmp_path / f"world{world}", free_port()
        run_dir.mkdir()
        outs.append([str(run_dir / f"rank{r}.pt") for r in range(world)])
        procs += [ctx.Process(target=_rank_main, args=(r, world, port, policy, str(run_dir), cfg, outs[-1][r]))
                  for r in range(world)]
    env = {"DS_BUILD_OPS": "0", "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1"}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        for p in procs:
            p.start()
        for p in procs:
            p.join(timeout=300)
    finally:
        for p in procs:
            p.kill() if p.is_alive() else None
        for k, v in saved.items():
            os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)
    assert [p.exitcode for p in procs] == [0] * len(procs), "a learner rank failed (its error is above)"
    return [[torch.load(o, weights_only=False) for o in ranks] for ranks in outs]


def test_two_gloo_ranks_take_the_one_rank_update(tiny_policy, tmp_path) -> None:
    # ZeRO 0: the optimizer sees whole, all-reduced gradients, comparable coordinate by
    # coordinate. 8 rows in micro-batches of 3: one rank runs (3, 3, 2), each of two ranks
    # (3, 1) of its 4, and every share is of the whole batch's tokens.
    policy = tiny_policy[0]
    (one,), two = _train(policy, tmp_path, 1, 2, micro_batch_size=3, zero_stage=0)
    assert one["metrics"]["tokens/rows"] == 8 == two[0]["metrics"]["tokens/rows"]
    ref = one["grads"][0]
    scale = max(float(g.abs().max()) for g in ref)
    assert scale > 0
    for rank in two:
        assert len(rank["grads"]) == 1
        for a, b in zip(ref, rank["grads"][0], strict=True):
            torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-5 * scale)
    # the step's metrics are the whole batch's: same loss and ratios (ZeRO 0 reports no gradient norm)
    for key in ("loss", "grad_norm", "ratio_min", "ratio_max"):
        got, want = two[0]["updates"][0][key], one["updates"][0][key]
        assert got == pytest.approx(want, rel=1e-4, abs=1e-7, nan_ok=True), key
    # both ranks end with the same weights (DeepSpeed applied the same averaged step)
    for k, v in two[0]["weights"].items():
        assert torch.equal(v, two[1]["weights"][k]), k
    # rank 0 alone claimed, acknowledged and published
    assert two[0]["acked"] == 2 and two[0]["published"] == 1 and two[1]["acked"] is None
    assert two[0]["retained"] == 0  # checkpoint_every=0: acknowledged and forgotten in one call


@pytest.mark.parametrize("zero_stage, micro_batch_size, mini_batches", [(2, 2, 2), (3, 1, 3)])
def test_zero_ranks_with_mini_batches_match_one_rank(tiny_policy, tmp_path, zero_stage, micro_batch_size,
                                                     mini_batches) -> None:
    # ZeRO 2 and 3 partition gradients, so compare what every rank sees whole: the global
    # gradient norm and loss of each mini-batch step (after the first, from the old log-probs
    # each rank computed for its own rows), and the weights after, equal across ranks. ZeRO 3
    # with 3 mini-batches of (3, 3, 2) rows: ranks get (2, 1) rows of a part, so rank 1 runs a
    # zero-weight micro-step to keep ZeRO 3's per-forward parameter gathers in step.
    learner = {"micro_batch_size": micro_batch_size, "zero_stage": zero_stage, "mini_batches": mini_batches}
    (one,), two = _train(tiny_policy[0], tmp_path, 1, 2, **learner)
    assert len(one["updates"]) == len(two[0]["updates"]) == mini_batches
    for mine, ref in zip(two[0]["updates"], one["updates"], strict=True):
        for key in ("loss", "grad_norm", "ratio_min", "ratio_max", "clip_frac"):
            assert mine[key] == pytest.approx(ref[key], rel=1e-3, abs=1e-6), key
    for k, v in two[0]["weights"].items():
        assert torch.equal(v, two[1]["weights"][k]), k


def test_log_z_is_averaged_across_ranks(tiny_policy, tmp_path) -> None:
    # Trajectory balance's log Z table lives outside DeepSpeed: its gradients are all-reduced
    # by the learner, so every rank's table moves, and moves identically.
    (two,) = _train(tiny_policy[0], tmp_path, 2, micro_batch_size=4, zero_stage=1,
                    loss={"type": "trajectory_balance", "log_z": "learned"})
    a, b = (r["log_z"] for r in two)
    for k in a:
        assert torch.equal(a[k], b[k])
    assert any(float(v.abs().sum()) > 0 for v in a.values())


def test_driver_trains_with_two_learner_ranks(tiny_run_config, tiny_policy, ray_cluster, tmp_path) -> None:
    """learner.world_size=2 through `turnrl train`'s driver on Ray: a placement group holds
    the ranks, rank 0 alone claims and acknowledges, every group is trained once."""
    from cluster.driver import train

    cfg = tiny_run_config([
        f"output_dir={tmp_path}", "name=ranks", "train.steps=2", "rollout.group_size=2", "learner.batch_groups=2",
        "rollout.max_new_tokens=32", "eval.num_tasks=0", "progress=none", "learner.world_size=2",
        "learner.num_cpus=0.25", "learner.torch_threads=1", "learner.micro_batch_size=2"])
    result = train(cfg, on_stage=lambda s: None)
    assert result.steps == 2 and not result.interrupted
    rows = [json.loads(line) for line in (result.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["version"] for r in rows] == [1, 2] and all(r["samples"] == 4 for r in rows)
    trained = [json.loads(line) for line in (result.run_dir / "trained_groups.jsonl").read_text().splitlines()]
    ids = [g for t in trained for g in t["group_ids"]]
    assert len(trained) == 2 and len(ids) == 4 == len(set(ids))  # one log line per step: rank 0's
    # both ranks wrote their ZeRO shards of the final checkpoint
    tag = json.loads((result.run_dir / "state.json").read_text())["ds_tag"]
    shards = sorted(p.name for p in (result.run_dir / "ds_checkpoint" / tag).glob("*optim_states.pt"))
    assert len(shards) == 2, shards


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("zero_stage", [2, 3])
def test_bf16_zero_learner_on_cuda(tiny_policy, tmp_path, zero_stage) -> None:
    # The device path: batches, old log-probs and the model on cuda:0, NCCL, bf16 under ZeRO.
    ((rank,),) = _train(tiny_policy[0], tmp_path, 1, micro_batch_size=3, zero_stage=zero_stage, mini_batches=2,
                        device="cuda", num_gpus=1, dtype="bfloat16")
    assert len(rank["updates"]) == 2
    assert all(torch.isfinite(torch.tensor(u["loss"])) for u in rank["updates"])
    from safetensors.torch import load_file

    start = load_file(f"{tiny_policy[0]}/model.safetensors")
    assert any(not torch.allclose(rank["weights"][k], start[k]) for k in start if k in rank["weights"])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                    reason="two NCCL learner ranks need two CUDA devices")
def test_two_nccl_ranks_take_the_one_rank_update(tiny_policy, tmp_path) -> None:
    learner = {"micro_batch_size": 2, "zero_stage": 2, "device": "cuda", "num_gpus": 1}
    (one,), two = _train(tiny_policy[0], tmp_path, 1, 2, **learner)
    assert two[0]["updates"][0]["grad_norm"] == pytest.approx(one["updates"][0]["grad_norm"], rel=1e-3)
