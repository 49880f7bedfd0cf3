"""The engine as a service, on a real tiny model: in-process through ``LocalEngineClient`` and
as a Ray engine group through ``RayEngineClient`` (generate, stream, abort, pause/resume, and
a weight update during a long generation that records both versions)."""

from __future__ import annotations

import asyncio
import zlib

import pytest
import torch

from rollout.config import HFEngineConfig
from rollout.engines import local_client
from rollout.engines.base import SamplingParams
from rollout.engines.transport import InMemoryWeights

# The tiny policy never emits end-of-turn after this prompt within 64 greedy tokens (checked in
# test_greedy_stream_equals_generate), so every control action lands mid-generation.
PROMPT = [5, 6, 7]
LONG = SamplingParams(temperature=0.0, max_new_tokens=64)


def _run(coro):
    return asyncio.run(coro)


@pytest.fixture()
def client(tiny_policy):
    return local_client(HFEngineConfig(), tiny_policy[0], seed=0)


def _perturbed(model, version: int) -> dict[str, torch.Tensor]:
    """A state dict that differs from the model's (so tokens after the switch can differ)."""
    gen = torch.Generator().manual_seed(version)
    return {k: v + 0.05 * torch.randn(v.shape, generator=gen) for k, v in model.state_dict().items()}


def test_greedy_stream_equals_generate(client) -> None:
    async def go():
        done = await client.generate(PROMPT, LONG, request_id="a")
        chunks = [c async for c in client.stream(PROMPT, LONG, request_id="b")]
        return done, chunks

    done, chunks = _run(go())
    assert done.request_id == "a" and done.finish_reason == "length" and len(done.token_ids) == 64
    assert done.version_spans == [(0, 0)]
    assert [t for c in chunks for t in c.token_ids] == done.token_ids
    torch.testing.assert_close(torch.tensor([lp for c in chunks for lp in c.logprobs]),
                               torch.tensor(done.logprobs), atol=1e-5, rtol=0)
    # one chunk per decoding step, then a closing chunk that carries the finish reason
    assert [len(c.token_ids) for c in chunks] == [1] * 64 + [0]
    assert chunks[-1].finish_reason == "length" and all(c.finish_reason is None for c in chunks[:-1])


def test_abort_ends_a_running_and_a_waiting_request(client) -> None:
    async def go():
        stream = client.stream(PROMPT, LONG, request_id="run")
        first = await stream.__anext__()
        assert await client.abort("run")
        rest = [c async for c in stream]
        await client.pause()  # held in the queue: never decoded
        waiting = asyncio.create_task(client.generate(PROMPT, LONG, request_id="wait"))
        await asyncio.sleep(0.05)
        assert await client.abort("wait")
        await client.resume()
        assert not await client.abort("nobody")
        return first, rest, await waiting

    first, rest, waiting = _run(go())
    tokens = first.token_ids + [t for c in rest for t in c.token_ids]
    assert rest[-1].finish_reason == "abort" and 1 <= len(tokens) < 64
    assert waiting.finish_reason == "abort" and waiting.token_ids == [] and waiting.request_id == "wait"


def test_pause_holds_tokens_and_resume_continues(client) -> None:
    async def go():
        stream = client.stream(PROMPT, LONG)
        got = [await stream.__anext__()]
        await client.pause()
        await asyncio.sleep(0.05)  # a step in progress may still finish
        before = client.engine.stats()["tokens"], len(got)
        held = asyncio.create_task(stream.__anext__())
        await asyncio.sleep(0.3)
        stalled = client.engine.stats()["tokens"] == before[0]
        await client.resume()
        got.append(await held)
        got += [c async for c in stream]
        return stalled, got

    stalled, got = _run(go())
    assert stalled  # no step ran while paused (the tokens counter moves only when a batch ends)
    assert sum(len(c.token_ids) for c in got) == 64 and got[-1].finish_reason == "length"


def test_weight_update_during_a_long_generation_records_both_versions(client) -> None:
    """Pause, load, resume: the request in flight continues on version 1 and says so."""
    baseline = _run(client.generate(PROMPT, LONG)).token_ids

    async def go():
        stream = client.stream(PROMPT, LONG, request_id="long")
        first = await stream.__anext__()
        await client.pause()
        serving = await client.update_weights(1, InMemoryWeights(_perturbed(client.engine.model, 1)))
        await client.resume()
        return serving, [first, *[c async for c in stream]]

    serving, chunks = _run(go())
    versions = [c.version for c in chunks if c.token_ids]
    switch = versions.index(1)
    assert serving == 1 and client.version == 1
    assert versions[:switch] == [0] * switch and versions[switch:] == [1] * (64 - switch) and switch >= 1
    tokens = [t for c in chunks for t in c.token_ids]
    assert len(tokens) == 64 and tokens[:switch] == baseline[:switch]
    after = _run(client.generate(PROMPT, LONG))
    assert after.version_spans == [(0, 1)]


def test_update_without_pause_loads_between_steps_and_never_fails_a_request(client) -> None:
    async def go():
        reqs = [asyncio.create_task(client.generate(PROMPT, LONG)) for _ in range(3)]
        await asyncio.sleep(0.02)
        for v in (1, 2):
            await client.update_weights(v, InMemoryWeights(_perturbed(client.engine.model, v)))
        return await asyncio.gather(*reqs)

    done = _run(go())
    assert all(len(c.token_ids) == 64 and c.finish_reason == "length" for c in done)
    for c in done:  # versions never go backwards within a completion
        assert [v for _, v in c.version_spans] == sorted(v for _, v in c.version_spans)
        assert len(c.versions()) == 64 and c.versions()[0] == c.version
    assert client.version == 2 and client.engine.stats()["weight_loads"] == 2


def test_weights_that_do_not_fit_are_refused_before_any_request_sees_them(client) -> None:
    bad = {"model.embed_tokens.weight": torch.zeros(3, 3)}
    with pytest.raises(ValueError, match="do not fit the engine's model"):
        _run(client.update_weights(5, InMemoryWeights(bad)))
    assert client.version == 0
    assert _run(client.generate(PROMPT, SamplingParams(temperature=0.0, max_new_tokens=4))).version == 0


def test_generate_n_gives_n_completions_sharing_a_batch(client) -> None:
    params = SamplingParams(temperature=1.0, max_new_tokens=8, n=3)
    outs = _run(client.generate_n(PROMPT, params, request_id="x"))
    assert [c.request_id for c in outs] == ["x-0", "x-1", "x-2"]
    assert client.engine.stats()["batches"] == 1 and client.engine.stats()["rows"] == 3


@pytest.mark.slow
def test_engine_group_on_ray(tiny_policy, ray_cluster) -> None:
    """Two engine actors behind one RayEngineClient: sessions stick to an engine, streams and
    aborts cross the actor boundary, and an update reaches every engine."""
    ray = ray_cluster
    from rollout.engines.client import RayEngineClient
    from rollout.engines.server import EngineServer

    cfg = HFEngineConfig(num_cpus=0.1)
    actors = [ray.remote(EngineServer).options(num_cpus=0.1, max_concurrency=64).remote(cfg, tiny_policy[0], i)
              for i in range(2)]
    try:
        client = RayEngineClient(actors, tiny_policy[0])
        local = _run(local_client(cfg, tiny_policy[0]).generate(PROMPT, LONG))

        async def go():
            done = await client.generate(PROMPT, LONG, session_id="s1")
            streamed = [c async for c in client.stream(PROMPT, LONG, session_id="s1")]
            stream = client.stream(PROMPT, LONG, request_id="cut")
            await stream.__anext__()
            aborted = await client.abort("cut")
            rest = [c async for c in stream]
            state = {k: v.clone() for k, v in _local_state(tiny_policy[0]).items()}
            low = await client.update_weights(3, InMemoryWeights(state))
            after = await client.generate(PROMPT, LONG)
            # pause, load version 4 while a session's request is mid-generation, resume: the
            # request crosses the actor boundary and finishes, recording both versions
            long = client.stream(PROMPT, LONG, session_id="s2")
            crossing = [await long.__anext__()]
            await client.pause()
            await client.update_weights(4, InMemoryWeights(state))
            await client.resume()
            crossing += [c async for c in long]
            return done, streamed, aborted, rest, low, after, crossing, await client.stats()

        done, streamed, aborted, rest, low, after, crossing, stats = _run(go())
        assert done.token_ids == local.token_ids  # same weights, greedy: same tokens as in-process
        assert [t for c in streamed for t in c.token_ids] == local.token_ids
        assert aborted and rest[-1].finish_reason == "abort"
        assert low == 3 and after.version_spans == [(0, 3)] and after.token_ids == local.token_ids
        versions = [c.version for c in crossing if c.token_ids]
        assert versions[0] == 3 and versions[-1] == 4 and sorted(versions) == versions
        assert sum(len(c.token_ids) for c in crossing) == 64 and crossing[-1].finish_reason == "length"
        # every engine loaded version 4; both requests of session s1 went to its engine
        assert [s["version"] for s in stats] == [4.0, 4.0]
        assert sum(s["requests"] for s in stats) == 5
        assert stats[zlib.crc32(b"s1") % 2]["requests"] >= 2
    finally:
        for a in actors:
            ray.kill(a)


def _local_state(path: str) -> dict[str, torch.Tensor]:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path).state_dict()
