"""A LoRA run that publishes its adapter alone (``learner.lora.publish: adapter``):

- the weight sync pushes an adapter's version 0 (a full-weight run's first publish is 1);
- the client view every component of the run holds (``AdapterClient``) names the run's adapter
  in every request and prompt log-prob call, refuses another, and loads versions as the adapter's;
- an engine actor that Ray started again catches up the adapter (not whole weights) before it
  serves, from the weight sync's newest version; a version broadcast before the engine joined
  the learner's group waits for the join;
- the whole loop on Ray: a tiny run whose learner publishes only the adapter's tensors each
  step, engines that serve them (its trajectories carry the adapter's versions, which admission
  counts), held-out evaluation through the adapter, a LoRA checkpoint at the end;
- a run that asks for adapters where they cannot be served is refused naming the fields.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import replace

import pytest
import torch

from learner.config import LoRAConfig
from rollout.config import HFEngineConfig
from rollout.engines.base import AdapterSpec, SamplingParams
from rollout.engines.transport import InMemoryWeights
from tests.lora_fixtures import random_adapter

LORA = LoRAConfig(rank=4, alpha=8)
SPEC = AdapterSpec("run-a", LORA.alpha / LORA.rank)


def _adapter(policy: str, seed: int) -> dict[str, torch.Tensor]:
    return random_adapter(policy, LORA, seed)[0]


def _server(policy: str, **kw):
    from rollout.engines.server import EngineServer

    return EngineServer(HFEngineConfig(max_batch=8), policy, seed=0, **kw)


def test_the_adapter_client_names_the_runs_adapter_in_every_request(tiny_policy) -> None:
    from rollout.engines.client import AdapterClient, LocalEngineClient

    class BaseOnly(LocalEngineClient):
        """A real engine reached past the adapter a request names (as a wrongly routed one would)."""

        async def generate(self, prompt_ids, params, request_id=None, session_id=None):
            return await super().generate(prompt_ids, replace(params, adapter=None), request_id, session_id)

        def stream(self, prompt_ids, params, request_id=None, session_id=None):
            return super().stream(prompt_ids, replace(params, adapter=None), request_id, session_id)

    policy = tiny_policy[0]
    weights = _adapter(policy, 1)
    greedy = SamplingParams(temperature=0.0, max_new_tokens=8)

    async def run() -> None:
        inner = LocalEngineClient(_server(policy))
        client = AdapterClient(inner, SPEC)
        assert await client.update_weights(3, InMemoryWeights(weights)) == 3  # a version of the adapter
        assert client.version == 3 and inner.version == 0  # the base weights did not change
        got = await client.generate([5, 6, 7, 8], greedy)
        want = await inner.generate([5, 6, 7, 8], SamplingParams(temperature=0.0, max_new_tokens=8, adapter="run-a"))
        base = await inner.generate([5, 6, 7, 8], greedy)
        assert got.token_ids == want.token_ids and got.version_spans == [(0, 3)]
        assert got.adapter == "run-a" and base.adapter is None  # the completion records its adapter
        assert got.logprobs == pytest.approx(want.logprobs, abs=1e-5)
        assert base.logprobs != pytest.approx(got.logprobs, abs=1e-3)  # the adapter changes the model
        streamed = [c async for c in client.stream([5, 6, 7, 8], greedy)]
        assert [t for c in streamed for t in c.token_ids] == got.token_ids
        assert {c.adapter for c in streamed} == {"run-a"} and {c.version for c in streamed} == {3}
        version, lps = await client.prompt_logprobs([5, 6, 7, 8, *got.token_ids], first=4)
        assert version == 3 and lps == pytest.approx(got.logprobs, abs=1e-4)
        with pytest.raises(ValueError, match="names adapter 'other' through the client of adapter 'run-a'"):
            await client.generate([5, 6], SamplingParams(max_new_tokens=2, adapter="other"))
        # an engine that decodes with the base whatever the request names: refused, not trained on
        lost = AdapterClient(BaseOnly(_server(policy)), SPEC)
        with pytest.raises(RuntimeError, match="for adapter 'run-a' with 'the base model'"):
            await lost.generate([5, 6, 7, 8], greedy)
        with pytest.raises(RuntimeError, match="for adapter 'run-a' with 'the base model'"):
            [c async for c in lost.stream([5, 6, 7, 8], greedy)]

    asyncio.run(run())


def test_the_weight_sync_pushes_an_adapters_version_0(tiny_policy) -> None:
    """A LoRA run's learner publishes its adapter's version 0 as it starts (engines serve none
    of the run's requests without it): the sync pushes it, where a full-weight run's first
    publish is version 1, and a restarted engine can catch it up."""
    from learner.weights import WeightSync
    from rollout.engines.client import AdapterClient, LocalEngineClient

    policy = tiny_policy[0]
    server = _server(policy)
    sync = WeightSync([AdapterClient(LocalEngineClient(server), SPEC)])
    v0, v1 = InMemoryWeights(_adapter(policy, 3)), InMemoryWeights(_adapter(policy, 4))

    async def run() -> list[int]:
        return [await sync.publish(0, v0), await sync.publish(1, v1), await sync.publish(0, v0)]

    assert asyncio.run(run()) == [0, 1, 1]  # the late republish of 0 moves nothing
    assert sync.latest() == (1, v1) and sync.stats()["pushes"] == 2
    assert server.engine._batch.adapters.version("run-a") == 1 and server.engine.version == 0


def test_an_engine_started_again_catches_up_the_adapter_before_it_serves(tiny_policy) -> None:
    """What a restarted engine actor runs: its first call loads the sync's newest version as a
    version of the run's adapter, so a request naming it is served with it, not refused."""
    policy = tiny_policy[0]
    weights = _adapter(policy, 2)

    class Sync:  # the weight sync's side of the catch-up, as ``WeightSyncSource`` presents it
        async def versions(self):
            return [(SPEC, 5, InMemoryWeights(weights))]

    async def run() -> tuple:
        restarted = _server(policy, catch_up=Sync(), restarted_by_ray=True)
        got = await restarted.generate([5, 6, 7], SamplingParams(temperature=0.0, max_new_tokens=6,
                                                                  adapter="run-a"), "r1")
        fresh = _server(policy)
        await fresh.update_adapter("run-a", 5, InMemoryWeights(weights), SPEC.scale)
        want = await fresh.generate([5, 6, 7], SamplingParams(temperature=0.0, max_new_tokens=6,
                                                               adapter="run-a"), "r2")
        return got, want, restarted.engine.version

    got, want, base_version = asyncio.run(run())
    assert got.version_spans == [(0, 5)] and got.token_ids == want.token_ids and base_version == 0


def _broadcast(init: dict, state: dict, layout: list) -> None:
    from rollout.engines.transport import BroadcastGroup

    BroadcastGroup(init, rank=0).send(state, layout)


def test_an_adapter_version_broadcast_before_the_engine_joined_waits_for_the_join(tiny_policy) -> None:
    """On the broadcast transport a LoRA run's learner publishes version 0 as it starts, before
    the driver's join step: the engine's load waits for the join, then receives it."""
    import multiprocessing

    from learner.deepspeed_setup import free_port
    from rollout.engines.transport import BroadcastWeights, plan_buckets

    policy = tiny_policy[0]
    weights = _adapter(policy, 5)
    layout = plan_buckets(weights, bucket_bytes=16 << 10)
    init = {"host": "127.0.0.1", "port": free_port(), "world_size": 2, "backend": "gloo", "rank": 1, "timeout_s": 120}
    greedy = SamplingParams(temperature=0.0, max_new_tokens=6, adapter="run-a")

    async def run() -> tuple:
        server = _server(policy)
        load = asyncio.ensure_future(server.update_adapter("run-a", 0, BroadcastWeights(layout), SPEC.scale))
        await asyncio.sleep(0.3)
        waited = not load.done()
        sender = multiprocessing.get_context("spawn").Process(target=_broadcast, args=(init, weights, layout))
        sender.start()
        await server.join_weight_group(init)
        version = await load
        sender.join(timeout=60)
        got = await server.generate([5, 6, 7], greedy, "r1")
        fresh = _server(policy)
        await fresh.update_adapter("run-a", 0, InMemoryWeights(weights), SPEC.scale)
        return waited, version, sender.exitcode, got, await fresh.generate([5, 6, 7], greedy, "r2")

    waited, version, exitcode, got, want = asyncio.run(run())
    assert waited and version == 0 and exitcode == 0 and len(layout) > 1
    assert got.token_ids == want.token_ids and got.version_spans == [(0, 0)] and got.adapter == "run-a"


def test_adapters_where_they_cannot_be_served_are_refused_naming_the_fields() -> None:
    from cluster.config import ConfigError, load_config

    with pytest.raises(ConfigError, match="rollout.engine.max_loras=0 turns vLLM's off.*learner.lora.publish=merged"):
        load_config(None, ["learner.lora={rank: 4}", "rollout.engine.type=vllm"])
    with pytest.raises(ConfigError, match="learner.lora.rank=32 is above rollout.engine.max_lora_rank=16"):
        load_config(None, ["learner.lora={rank: 32}", "rollout.engine={type: vllm, max_loras: 1}"])
    with pytest.raises(ConfigError, match="where rollout.weights.transport=broadcast does not reach"):
        load_config(None, ["learner.lora={rank: 4}", "rollout.engine={type: vllm, max_loras: 1}",
                           "rollout.weights.transport=broadcast"])
    assert load_config(None, ["learner.lora={rank: 4}", "rollout.engine={type: vllm, max_loras: 1}"])
    with pytest.raises(ConfigError, match="rewards.ig.scorer=model scores with whole weights"):
        load_config(None, ["learner.lora={rank: 4}", "rewards.ig={scorer: model}"])
    assert load_config(None, ["learner.lora={rank: 4, publish: merged}", "rollout.engine.type=vllm"])


@pytest.mark.slow
def test_a_lora_run_publishes_its_adapter_alone_and_its_engines_serve_it(tiny_run_config, tiny_policy,
                                                                         ray_cluster, tmp_path) -> None:
    from safetensors.torch import load_file

    from cluster.driver import train
    from learner.lora import is_lora_checkpoint

    cfg = tiny_run_config([
        f"output_dir={tmp_path}", "name=lora-adapter", "train.steps=4", "rollout.group_size=2",
        "learner.batch_groups=2", "rollout.groups_in_flight=2", "rollout.max_new_tokens=32",
        "eval.num_tasks=4", "eval.samples_per_task=1", "progress=none", "learner.lr=1e-2",
        "learner.lora={rank: 4, alpha: 8}", "replay.eta=1",
    ])
    assert cfg.learner.lora.publish == "adapter"  # the default
    result = train(cfg, on_stage=lambda s: None)
    assert result.steps == 4 and not result.interrupted
    rows = [json.loads(line) for line in (result.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["version"] for r in rows] == [1, 2, 3, 4]
    # Engines serve the base as version 0 whatever happens; a trajectory of version >= v-1 at
    # step v came from the adapter's version pushed by the weight sync.
    assert all(r["staleness/max"] <= 1 for r in rows)
    # The adapter alone: 2 layers x 7 projections, rank 4, fp32 (tests/test_lora.py counts 8704)
    model_mb = sum(t.numel() * t.element_size() for t in load_file(f"{tiny_policy[0]}/model.safetensors").values())
    assert all(r["weights/published_mb"] == pytest.approx(8704 * 4 / 2**20) for r in rows)
    assert rows[0]["weights/published_mb"] * 2**20 < 0.08 * model_mb  # 34 KB of 483 KB; SmolLM2's: 3%
    assert set(result.eval) >= {"before", "after"}  # held-out evaluation went through the adapter
    assert is_lora_checkpoint(result.checkpoint)
