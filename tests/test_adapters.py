"""LoRA adapters served side by side by the HF engine (``rollout/engines/adapters.py``), on the
tiny policy with three peft adapters made by the learner's own code (``learner.lora.wrap``,
random B so each changes the model):

- a request decoded with an adapter gets exactly what the learner's merged weights
  (``merged_state``) give a plain engine: the adapter path is the merge, computed per row;
- requests of three adapters and the base in one mixed batch get, token for token, what each
  gets alone (seeded sampling; log-probs within 1e-5);
- a new version of one adapter loads while another adapter's long request decodes on: that
  request is unchanged and records one version; the updated adapter's request in flight
  records both, each token labelled with the version that sampled it;
- an adapter is unloaded while other adapters' rows keep one batch decoding without a break
  (an engine of a pool serving other runs may never be idle), and the rows that finished in
  that batch are counted as they finish;
- KV computed with one adapter is never reused by another or by the base (prefix-cache spaces);
- bad input is refused naming it: an adapter not loaded, a layer the model lacks, misfit shapes.
"""

from __future__ import annotations

import asyncio

import pytest
import torch

from learner.config import LoRAConfig
from rollout.config import HFEngineConfig
from rollout.engines.base import SamplingParams
from rollout.engines.hf import HFEngine
from rollout.engines.transport import InMemoryWeights
from tests.lora_fixtures import random_adapter

LORA = LoRAConfig(rank=4, alpha=8, target_modules=["q_proj", "v_proj", "down_proj"])
SCALE = LORA.alpha / LORA.rank
PROMPTS = [[5, 6, 7, 8], [9, 10, 11, 12, 13, 14]]
NAMES = ["a1", "a2", "a3"]


@pytest.fixture(scope="module")
def loras(tiny_policy) -> dict[str, tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]]:
    return {name: random_adapter(tiny_policy[0], LORA, seed) for seed, name in enumerate(NAMES + ["a2-v2"])}


def _engine(policy: str) -> HFEngine:
    return HFEngine(HFEngineConfig(max_batch=16), policy, seed=0)


def _params(adapter: str | None, seed: int, n: int = 12) -> SamplingParams:
    return SamplingParams(temperature=1.0, max_new_tokens=n, seed=seed, adapter=adapter)


async def _load(engine: HFEngine, loras, names=NAMES) -> None:
    for name in names:
        assert await engine.update_adapter(name, 1, InMemoryWeights(loras[name][0]), SCALE) == 1


async def _generate(engine: HFEngine, requests: list[tuple[str | None, list[int], int]]):
    return await asyncio.gather(*[engine.generate(p, _params(a, s)) for a, p, s in requests])


def test_an_adapter_decodes_as_the_merged_weights(tiny_policy, loras):
    adapter, merged = loras["a1"]
    requests = [("a1", p, s) for s in (1, 2) for p in PROMPTS]

    async def served() -> list:
        engine = _engine(tiny_policy[0])
        await _load(engine, loras, ["a1"])
        out = await _generate(engine, requests)
        scored = await engine.prompt_logprobs(PROMPTS[1] + out[1].token_ids, first=2, adapter="a1")
        await engine.close()
        return [out, scored]

    async def merged_alone() -> list:
        engine = _engine(tiny_policy[0])
        await engine.update_weights(1, InMemoryWeights(merged))
        out = await _generate(engine, [(None, p, s) for _, p, s in requests])
        scored = await engine.prompt_logprobs(PROMPTS[1] + out[1].token_ids, first=2)
        await engine.close()
        return [out, scored]

    (got, got_scored), (want, want_scored) = asyncio.run(served()), asyncio.run(merged_alone())
    for g, w in zip(got, want):
        assert g.token_ids == w.token_ids
        assert g.logprobs == pytest.approx(w.logprobs, abs=1e-4)
        assert g.version_spans == [(0, 1)]  # the adapter's version
    assert got_scored[0] == 1 and got_scored[1] == pytest.approx(want_scored[1], abs=1e-4)


def test_mixed_batches_decode_each_row_with_its_own_adapter(tiny_policy, loras):
    requests = [(a, p, 10 * i + j) for i, a in enumerate(NAMES + [None]) for j, p in enumerate(PROMPTS)]

    async def mixed():
        engine = _engine(tiny_policy[0])
        await _load(engine, loras)
        out = await _generate(engine, requests)
        stats = engine.stats()
        await engine.close()
        return out, stats

    async def alone():
        engine = _engine(tiny_policy[0])
        await _load(engine, loras)
        out = []
        for name in NAMES + [None]:
            out += await _generate(engine, [r for r in requests if r[0] == name])
        await engine.close()
        return out

    (got, stats), want = asyncio.run(mixed()), asyncio.run(alone())
    assert stats["forward_rows"] / stats["forwards"] > 4  # the adapters did share batches
    for (name, _, _), g, w in zip(requests, got, want):
        assert g.token_ids == w.token_ids, name
        assert g.logprobs == pytest.approx(w.logprobs, abs=1e-5), name
    # the adapters change what is sampled: not every adapter's tokens are the base's
    base = {tuple(p): g.token_ids for (a, p, _), g in zip(requests, got) if a is None}
    assert any(g.token_ids != base[tuple(p)] for (a, p, _), g in zip(requests, got) if a is not None)


def test_an_adapter_update_leaves_other_rows_alone(tiny_policy, loras):
    long = 48

    async def run():
        engine = _engine(tiny_policy[0])
        await _load(engine, loras, ["a1", "a2"])
        alone = await engine.generate(PROMPTS[0], _params("a1", 7, long))
        other = asyncio.ensure_future(engine.generate(PROMPTS[0], _params("a1", 7, long)))
        updated = engine.stream(PROMPTS[1], _params("a2", 8, long))
        chunks = [await updated.__anext__() for _ in range(4)]  # both rows are decoding
        version = await engine.update_adapter("a2", 2, InMemoryWeights(loras["a2-v2"][0]), SCALE)
        chunks += [c async for c in updated]
        after = await engine.generate(PROMPTS[1], _params("a2", 9))
        stats = engine.stats()
        await engine.close()
        return alone, await other, chunks, version, after, stats

    alone, other, chunks, version, after, stats = asyncio.run(run())
    assert version == 2 and stats["adapter_loads"] == 3
    assert other.token_ids == alone.token_ids and other.version_spans == [(0, 1)]
    versions = [c.version for c in chunks if c.token_ids]
    assert versions[:4] == [1] * 4 and versions[-1] == 2 and sorted(versions) == versions
    assert after.version_spans == [(0, 2)]


def test_an_adapter_unloads_while_other_rows_keep_decoding(tiny_policy, loras):
    async def run():
        engine = _engine(tiny_policy[0])
        await _load(engine, loras, ["a1", "a2"])
        busy, answered = asyncio.Event(), [0]

        async def feed(seed: int, n: int) -> int:  # a1 rows joining the batch, one after another
            done = 0
            while not busy.is_set():
                await engine.generate(PROMPTS[0], _params("a1", seed + done, n))
                done += 1
                answered[0] += 1
            return done

        # lengths apart, so that rows never all end at one step (the batch would end there)
        feeders = [asyncio.ensure_future(feed(100 * i, n)) for i, n in enumerate((16, 23, 31))]
        while answered[0] < 2:  # rows have ended and joined: the batch runs on
            await asyncio.sleep(0.01)
        batches = engine.stats()["batches"]
        try:
            await asyncio.wait_for(engine.remove_adapter("a2"), timeout=20)
            mid = engine.stats()
        finally:
            busy.set()
            served = sum(await asyncio.gather(*feeders))
        with pytest.raises(ValueError, match="adapter 'a2' is not loaded"):
            await engine.generate(PROMPTS[0], _params("a2", 1))
        await engine.close()
        return batches, mid, served

    batches, mid, served = asyncio.run(run())
    assert mid["batches"] == batches and served >= 3
    # finished rows are counted as they leave, not when the batch (never, on a busy pool) ends
    assert mid["rows"] >= 2 and mid["tokens"] >= 2 * 16


async def _kept(engine: HFEngine, entries: int) -> None:
    """Wait for the decode thread to keep a finished row's KV (a request is answered first)."""
    for _ in range(500):
        if engine.stats()["prefix_entries"] >= entries:
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"the prefix cache holds {engine.stats()['prefix_entries']} entries, not {entries}")


def test_kv_is_reused_only_within_its_adapter(tiny_policy, loras):
    async def run():
        engine = _engine(tiny_policy[0])
        await _load(engine, loras, ["a1"])
        first = await engine.generate(PROMPTS[1] * 4, _params(None, 1, 8))
        await _kept(engine, 1)
        context = PROMPTS[1] * 4 + first.token_ids + [5, 6]
        before = engine.stats()["prefix_reused_tokens"]
        await engine.generate(context, _params("a1", 2, 8))  # the base's KV is not a1's
        await _kept(engine, 2)
        other_space = engine.stats()["prefix_reused_tokens"] - before
        await engine.generate(context, _params(None, 3, 8))  # the base's own next turn
        own_space = engine.stats()["prefix_reused_tokens"] - before - other_space
        await engine.close()
        return other_space, own_space

    other_space, own_space = asyncio.run(run())
    assert other_space == 0 and own_space >= 16


def test_bad_adapters_are_refused_naming_what_is_wrong(tiny_policy, loras):
    adapter = loras["a1"][0]
    some_a = next(k for k in adapter if k.endswith(".lora_A.weight"))

    async def run():
        engine = _engine(tiny_policy[0])
        with pytest.raises(ValueError, match="adapter 'nope' is not loaded"):
            await engine.generate(PROMPTS[0], _params("nope", 1))
        with pytest.raises(ValueError, match="is not a linear layer"):
            await engine.update_adapter("x", 1, InMemoryWeights({"model.nowhere.lora_A.weight": adapter[some_a],
                                                                 "model.nowhere.lora_B.weight": adapter[some_a]}), 1.0)
        bad = dict(adapter)
        bad[some_a] = torch.zeros(LORA.rank, 3)
        with pytest.raises(ValueError, match="do not fit"):
            await engine.update_adapter("x", 1, InMemoryWeights(bad), 1.0)
        with pytest.raises(ValueError, match="has no"):
            await engine.update_adapter("x", 1, InMemoryWeights({some_a: adapter[some_a]}), 1.0)
        await _load(engine, loras, ["a1"])
        await engine.remove_adapter("a1")
        with pytest.raises(ValueError, match="adapter 'a1' is not loaded"):
            await engine.generate(PROMPTS[0], _params("a1", 1))
        await engine.close()

    asyncio.run(run())
