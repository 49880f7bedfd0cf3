"""Weight transports, round trip: a safetensors file on a shared filesystem, the Ray object
store, and the bucketed broadcast from learner rank 0 over a process group of its own (gloo
between two real processes here; NCCL marked gpu). Engines loading through each transport are
in tests/test_engine_service.py."""

from __future__ import annotations

import asyncio
import multiprocessing

import pytest
import torch

from learner.deepspeed_setup import free_port
from rollout.engines.transport import (BroadcastGroup, BroadcastWeights, FileWeightsWriter, ObjectStoreWeights,
                                       plan_buckets)


def _state() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    embed = torch.randn(12, 4, generator=gen)
    return {"model.embed_tokens.weight": embed, "model.norm.weight": torch.randn(4, generator=gen),
            "model.layers.0.mlp.up_proj.weight": torch.randn(8, 4, generator=gen).to(torch.bfloat16),
            "lm_head.weight": embed}  # tied: shares the embedding's storage


def test_file_weights_round_trip_keeping_the_newest(tmp_path) -> None:
    writer = FileWeightsWriter(str(tmp_path), keep=2)
    state = _state()
    def scaled(v: int) -> dict[str, torch.Tensor]:
        out = {k: t * v for k, t in state.items() if k != "lm_head.weight"}
        return {**out, "lm_head.weight": out["model.embed_tokens.weight"]}

    handles = [writer.publish(v, scaled(v)) for v in (1, 2, 3)]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["weights-v00000002.safetensors",
                                                          "weights-v00000003.safetensors"]
    loaded = asyncio.run(handles[-1].load())
    # the tied head is written once, under the embedding's name; loaders re-tie it
    assert set(loaded) == set(state) - {"lm_head.weight"}
    for k, t in loaded.items():
        assert t.dtype == state[k].dtype and torch.equal(t, state[k] * 3)
    assert handles[-1].shapes()["model.layers.0.mlp.up_proj.weight"] == (8, 4)


def test_buckets_group_one_dtype_up_to_the_size_limit() -> None:
    state = {"a": torch.zeros(10), "b": torch.zeros(10), "c": torch.zeros(4, dtype=torch.bfloat16),
             "big": torch.zeros(100), "d": torch.zeros(3)}
    layout = plan_buckets(state, bucket_bytes=80)
    # a + b fill 80 bytes; big (400 bytes) gets a bucket of its own; d opens the next fp32 one
    assert [[e["name"] for e in b["entries"]] for b in layout] == [["a", "b"], ["c"], ["big"], ["d"]]
    assert [b["dtype"] for b in layout] == ["float32", "bfloat16", "float32", "float32"]
    assert layout[0]["entries"][1] == {"name": "b", "shape": [10], "offset": 10, "numel": 10}


def _send(init: dict, state: dict, layout: list, out, device: str = "cpu") -> None:
    group = BroadcastGroup(init, rank=0, device=device)
    out.put(group.send(state, layout))


def test_broadcast_over_gloo_between_two_processes() -> None:
    state = {k: v for k, v in _state().items() if k != "lm_head.weight"}
    layout = plan_buckets(state, bucket_bytes=64)
    init = {"host": "127.0.0.1", "port": free_port(), "world_size": 2, "backend": "gloo", "rank": 1,
            "timeout_s": 60}
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    sender = ctx.Process(target=_send, args=(init, state, layout, out))
    sender.start()
    try:
        BroadcastGroup.join(init)
        got = asyncio.run(BroadcastWeights(layout).load())
        sent = out.get(timeout=60)
    finally:
        sender.join(timeout=60)
    assert sender.exitcode == 0 and len(layout) > 1
    assert sent == sum(t.numel() * t.element_size() for t in state.values())
    assert set(got) == set(state)
    for k, t in state.items():
        assert got[k].dtype == t.dtype and torch.equal(got[k], t)


@pytest.mark.slow
def test_object_store_round_trip_into_an_actor(ray_cluster) -> None:
    ray = ray_cluster
    state = _state()

    @ray.remote(num_cpus=0.1)
    class Reader:
        async def read(self, handle: ObjectStoreWeights) -> dict[str, torch.Tensor]:
            return dict(await handle.load())

    reader = Reader.remote()
    got = ray.get(reader.read.remote(ObjectStoreWeights.put(state)))
    ray.kill(reader)
    assert set(got) == set(state) and all(torch.equal(got[k], state[k]) for k in state)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                    reason="NCCL broadcast needs two CUDA devices")
def test_broadcast_over_nccl_between_two_gpus() -> None:
    state = {k: v.cuda(0) for k, v in _state().items() if k != "lm_head.weight"}
    layout = plan_buckets(state, bucket_bytes=1 << 20)
    init = {"host": "127.0.0.1", "port": free_port(), "world_size": 2, "backend": "nccl", "rank": 1}
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    sender = ctx.Process(target=_send, args=(init, {k: v.cpu() for k, v in state.items()}, layout, out, "cuda:0"))
    sender.start()
    BroadcastGroup.join(init, device="cuda:1")
    got = dict(BroadcastGroup.joined.receive(layout))
    sender.join(timeout=120)
    assert all(torch.equal(got[k].cpu(), state[k].cpu()) for k in state)


@pytest.mark.slow
@pytest.mark.parametrize("transport", ["file", "broadcast"])
def test_a_run_publishes_through_each_transport(tiny_run_config, tiny_policy, ray_cluster, tmp_path, transport) -> None:
    """``rollout.weights.transport`` in a real run: the learner publishes every version
    through it, the engines load each (two engines: the broadcast has three members), and
    training advances."""
    import json

    from cluster.driver import train

    cfg = tiny_run_config([
        f"output_dir={tmp_path}", f"name=w-{transport}", "train.steps=3", "rollout.group_size=2",
        "learner.batch_groups=2", "rollout.groups_in_flight=2", "rollout.max_new_tokens=24", "eval.num_tasks=0",
        "progress=none", f"rollout.weights.transport={transport}", "rollout.engine.count=2",
        "rollout.engine.num_cpus=0.1"])
    result = train(cfg, on_stage=lambda s: None)
    rows = [json.loads(line) for line in (result.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert result.steps == 3 and [r["version"] for r in rows] == [1, 2, 3]
    # samples of later steps came from weights the learner published through the transport
    assert max(r["staleness/max"] for r in rows) <= cfg.replay.eta
    if transport == "file":  # the newest two versions' files are kept
        names = sorted(p.name for p in (result.run_dir / "weights").iterdir())
        assert names == ["weights-v00000002.safetensors", "weights-v00000003.safetensors"]


def test_broadcast_with_a_model_copy_ig_scorer_is_refused() -> None:
    from cluster.config import load_config

    with pytest.raises(ValueError, match="rollout.weights.transport=broadcast sends weights to the engines only"):
        load_config(None, ["rollout.weights.transport=broadcast", "rewards.ig={scorer: model}"])
    cfg = load_config(None, ["rollout.weights.transport=broadcast", "rewards.ig={scorer: engine}"])
    assert cfg.rollout.weights.transport == "broadcast"
