"""The engine contract, on a real tiny model, for every engine kind: the HF engine and the vLLM
engine (vLLM's CPU build here) run the same tests in-process through ``LocalEngineClient``
(generate, stream, abort, pause/resume, log-probs against a plain forward pass, a weight update
during a long generation that records both versions); the HF engine group also runs on Ray.
Where a GPU is visible the HF engine runs them again on ``cuda`` (marked gpu), against the same
plain forward pass on the CPU.

One engine per kind serves the whole module (a vLLM engine takes ~20 s to start); before each
test the policy's own weights are loaded as a new version, so every test starts from the same
weights and counts versions from ``base``."""

from __future__ import annotations

import asyncio
import gc
import multiprocessing
import time
import zlib

import pytest
import torch

from rollout.config import HFEngineConfig, VLLMEngineConfig
from rollout.engines import local_client
from rollout.engines.base import SamplingParams
from rollout.engines.transport import BroadcastGroup, BroadcastWeights, FileWeightsWriter, InMemoryWeights, plan_buckets
from learner.deepspeed_setup import free_port

# The tiny policy never emits end-of-turn after this prompt within 64 greedy tokens (checked in
# test_greedy_stream_equals_generate), so every control action lands mid-generation.
PROMPT = [5, 6, 7]
LONG = SamplingParams(temperature=0.0, max_new_tokens=64)
CONFIGS = {"hf": HFEngineConfig(), "vllm": VLLMEngineConfig(max_model_len=512),
           "hf-cuda": HFEngineConfig(device="cuda")}
ENGINES = ["hf", "vllm", pytest.param("hf-cuda", marks=[
    pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")])]


def _run(coro):
    return asyncio.run(coro)


@pytest.fixture(scope="module")
def policy_state(tiny_policy) -> dict[str, torch.Tensor]:
    return _local_state(tiny_policy[0])


@pytest.fixture(scope="module", params=ENGINES)
def engine_client(request, tiny_policy):
    """(engine kind, its client): ``hf-cuda`` is the HF engine, so it is of kind ``hf``."""
    client = local_client(CONFIGS[request.param], tiny_policy[0], seed=0)
    yield request.param.removesuffix("-cuda"), client
    _run(client.engine.close())
    if request.param == "vllm":
        # Nothing keeps vLLM's engine past close(): one left for interpreter exit is shut down
        # again there, after its modules are gone (a TypeError printed under every suite run).
        from vllm.v1.engine.async_llm import AsyncLLM

        del client
        gc.collect()
        assert not [o for o in gc.get_objects() if isinstance(o, AsyncLLM)]


@pytest.fixture()
def kind(engine_client) -> str:
    return engine_client[0]


@pytest.fixture()
def client(engine_client, policy_state):
    """The module's engine, serving the policy's own weights as a fresh version."""
    c = engine_client[1]
    _run(c.update_weights(c.version + 1, InMemoryWeights(policy_state)))
    return c


def _perturbed(state: dict[str, torch.Tensor], version: int) -> dict[str, torch.Tensor]:
    """A state dict that differs from the policy's (so tokens after the switch can differ);
    tensors that share storage (the tied head) still do."""
    gen = torch.Generator().manual_seed(version)
    new: dict[int, torch.Tensor] = {}
    for v in state.values():
        new.setdefault(v.data_ptr(), v + 0.05 * torch.randn(v.shape, generator=gen))
    return {k: new[v.data_ptr()] for k, v in state.items()}


def _send(init: dict, state: dict, layout: list) -> None:
    BroadcastGroup(init, rank=0).send(state, layout)


@pytest.mark.parametrize("transport", ["file", "broadcast"])
def test_weights_arrive_through_each_transport(client, policy_state, transport, tmp_path) -> None:
    """A version sent through a safetensors file, or broadcast in buckets from another process
    (the learner's side, gloo here), serves exactly what the same weights loaded in memory do."""
    base, new = client.version, _perturbed(policy_state, 7)
    _run(client.update_weights(base + 1, InMemoryWeights(new)))
    want = _run(client.generate(PROMPT, LONG)).token_ids
    _run(client.update_weights(base + 2, InMemoryWeights(policy_state)))
    assert _run(client.generate(PROMPT, LONG)).token_ids != want
    if transport == "file":
        _run(client.update_weights(base + 3, FileWeightsWriter(str(tmp_path)).publish(base + 3, new)))
    else:
        unique = {k: v for k, v in new.items() if k != "lm_head.weight"}  # the learner's tied head goes once
        layout = plan_buckets(unique, bucket_bytes=64 << 10)
        init = {"host": "127.0.0.1", "port": free_port(), "world_size": 2, "backend": "gloo", "rank": 1,
                "timeout_s": 120}
        sender = multiprocessing.get_context("spawn").Process(target=_send, args=(init, unique, layout))
        sender.start()
        _run(client.server.join_weight_group(init))
        _run(client.update_weights(base + 3, BroadcastWeights(layout)))
        sender.join(timeout=60)
        assert sender.exitcode == 0 and len(layout) > 1
    done = _run(client.generate(PROMPT, LONG))
    assert done.version_spans == [(0, base + 3)] and done.token_ids == want


def test_greedy_stream_equals_generate(client, kind) -> None:
    base = client.version

    async def go():
        done = await client.generate(PROMPT, LONG, request_id="a")
        chunks = [c async for c in client.stream(PROMPT, LONG, request_id="b")]
        return done, chunks

    done, chunks = _run(go())
    assert done.request_id == "a" and done.finish_reason == "length" and len(done.token_ids) == 64
    assert done.version_spans == [(0, base)]
    assert [t for c in chunks for t in c.token_ids] == done.token_ids
    torch.testing.assert_close(torch.tensor([lp for c in chunks for lp in c.logprobs]),
                               torch.tensor(done.logprobs), atol=1e-5, rtol=0)
    # a closing chunk carries the finish reason; the HF engine sends one chunk per decoding
    # step, vLLM merges the steps a slow reader has not collected yet
    assert chunks[-1].token_ids == [] and all(c.token_ids for c in chunks[:-1])
    if kind == "hf":
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


def test_weight_update_during_a_long_generation_records_both_versions(client, policy_state) -> None:
    """Pause, load, resume: the request in flight continues on the new version and says so."""
    baseline = _run(client.generate(PROMPT, LONG)).token_ids
    base = client.version

    async def go():
        stream = client.stream(PROMPT, LONG, request_id="long")
        first = await stream.__anext__()
        await client.pause()
        serving = await client.update_weights(base + 1, InMemoryWeights(_perturbed(policy_state, 1)))
        await client.resume()
        return serving, [first, *[c async for c in stream]]

    serving, chunks = _run(go())
    versions = [c.version for c in chunks for _ in c.token_ids]
    switch = versions.index(base + 1)
    assert serving == base + 1 and client.version == base + 1
    assert versions[:switch] == [base] * switch and versions[switch:] == [base + 1] * (64 - switch) and switch >= 1
    tokens = [t for c in chunks for t in c.token_ids]
    assert len(tokens) == 64 and tokens[:switch] == baseline[:switch]
    after = _run(client.generate(PROMPT, LONG))
    assert after.version_spans == [(0, base + 1)]


def test_between_batches_waits_for_the_requests_in_flight(client, policy_state) -> None:
    """``weight_update: between_batches``: a request in flight finishes on the weights it
    started with; the update lands after it (vLLM: ``pause_generation(mode="wait")``)."""
    base, engine = client.version, client.engine
    saved = engine.cfg
    engine.cfg = saved.model_copy(update={"weight_update": "between_batches"})  # read at each update

    async def go():
        stream = client.stream(PROMPT, LONG)
        chunks = [await stream.__anext__()]
        update = asyncio.create_task(client.update_weights(base + 1, InMemoryWeights(_perturbed(policy_state, 1))))
        chunks += [c async for c in stream]
        return chunks, await update

    try:
        chunks, serving = _run(go())
    finally:
        engine.cfg = saved
    assert sum(len(c.token_ids) for c in chunks) == 64 and chunks[-1].finish_reason == "length"
    assert {c.version for c in chunks if c.token_ids} == {base}
    assert serving == base + 1 and _run(client.generate(PROMPT, LONG)).version == base + 1


def test_update_without_pause_loads_between_steps_and_never_fails_a_request(client, policy_state) -> None:
    base, loads = client.version, client.engine.stats()["weight_loads"]

    async def go():
        reqs = [asyncio.create_task(client.generate(PROMPT, LONG)) for _ in range(3)]
        await asyncio.sleep(0.02)
        for v in (1, 2):
            await client.update_weights(base + v, InMemoryWeights(_perturbed(policy_state, v)))
        return await asyncio.gather(*reqs)

    done = _run(go())
    assert all(len(c.token_ids) == 64 and c.finish_reason == "length" for c in done)
    for c in done:  # versions never go backwards within a completion
        assert [v for _, v in c.version_spans] == sorted(v for _, v in c.version_spans)
        assert len(c.versions()) == 64 and c.versions()[0] == c.version
    assert client.version == base + 2 and client.engine.stats()["weight_loads"] == loads + 2


def test_weights_that_do_not_fit_are_refused_before_any_request_sees_them(client) -> None:
    base = client.version
    bad = {"model.embed_tokens.weight": torch.zeros(3, 3)}
    with pytest.raises(ValueError, match="do not fit the engine's model"):
        _run(client.update_weights(base + 5, InMemoryWeights(bad)))
    assert client.version == base
    assert _run(client.generate(PROMPT, SamplingParams(temperature=0.0, max_new_tokens=4))).version == base


def test_generate_n_gives_n_completions_sharing_a_batch(client, kind) -> None:
    """n completions of one prompt decode as one batch of n rows; the HF engine computes the
    prompt once for all of them (the logits of each row are checked against a plain forward
    pass in test_logprobs_match_a_plain_forward_pass, which samples with n=3)."""
    params = SamplingParams(temperature=1.0, max_new_tokens=8, n=3)
    before = client.engine.stats()
    outs = _run(client.generate_n(PROMPT, params, request_id="x"))
    assert [c.request_id for c in outs] == ["x-0", "x-1", "x-2"] and all(len(c.token_ids) == 8 for c in outs)
    if kind == "hf":  # vLLM schedules continuously: it has no batches to count
        # the batch is counted after its completions are handed out: wait for the count to land
        deadline = time.monotonic() + 5
        while client.engine.stats()["batches"] == before["batches"] and time.monotonic() < deadline:
            time.sleep(0.01)
        after = client.engine.stats()
        assert after["batches"] - before["batches"] == 1 and after["rows"] - before["rows"] == 3
        # the first token comes from the prefill, each of the other 7 from one decode step of 3 rows
        assert after["forwards"] - before["forwards"] == 7
        assert after["forward_rows"] - before["forward_rows"] == 21
        assert after["prefill_tokens"] - before["prefill_tokens"] == len(PROMPT)


def test_a_seeded_request_samples_the_same_tokens_again(client) -> None:
    """``SamplingParams.seed`` (the gateway's ``seed``): the request draws its noise from a
    generator of its own (HF: a torch.Generator per request; vLLM: its per-request seed), so
    it samples the same tokens alone and in a batch beside an unseeded request; another seed
    samples others, and choice i of a seeded generate_n is seeded seed + i."""
    import dataclasses

    seeded = SamplingParams(temperature=1.0, max_new_tokens=32, seed=7)

    async def go():
        alone = await client.generate(PROMPT, seeded)
        beside = client.generate([9, 10, 11, 12, 13], SamplingParams(temperature=1.0, max_new_tokens=32))
        together, _ = await asyncio.gather(client.generate(PROMPT, seeded), beside)
        other = await client.generate(PROMPT, dataclasses.replace(seeded, seed=8))
        pair = await client.generate_n(PROMPT, dataclasses.replace(seeded, n=2))
        return alone, together, other, pair

    alone, together, other, pair = _run(go())
    assert len(alone.token_ids) > 1 and together.token_ids == alone.token_ids
    torch.testing.assert_close(torch.tensor(together.logprobs), torch.tensor(alone.logprobs), atol=1e-4, rtol=0)
    assert other.token_ids != alone.token_ids
    assert pair[0].token_ids == alone.token_ids and pair[1].token_ids == other.token_ids


@pytest.mark.parametrize("join_wait_ms,joins", [(0.0, 1), (60_000.0, 0)])
def test_join_wait_bounds_how_long_a_request_waits_to_join(client, kind, join_wait_ms, joins) -> None:
    """HF: a request arriving mid-batch joins at the next step with ``join_wait_ms`` 0 and
    finishes first; with a wait longer than the batch it never joins: it starts when the
    batch has ended, a batch of its own."""
    if kind != "hf":
        pytest.skip("join_wait_ms is the HF engine's (vLLM schedules its own prefills)")
    engine, saved = client.engine, client.engine.cfg
    engine.cfg = saved.model_copy(update={"join_wait_ms": join_wait_ms})
    order: list[str] = []

    async def go():
        async def long():
            chunks = [c async for c in stream]
            order.append("long")
            return chunks

        async def short():
            out = await client.generate([9, 8, 7], SamplingParams(temperature=0.0, max_new_tokens=4))
            order.append("short")
            return out

        stream = client.stream(PROMPT, LONG)
        first = await stream.__anext__()
        rest, out = await asyncio.gather(long(), short())
        return [first, *rest], out

    before = engine.stats()["joins"]
    try:
        chunks, out = _run(go())
    finally:
        engine.cfg = saved
    assert len(out.token_ids) == 4 and sum(len(c.token_ids) for c in chunks) == 64
    assert engine.stats()["joins"] - before == joins
    assert order == (["short", "long"] if joins else ["long", "short"])


def test_prompts_of_different_lengths_in_one_batch_decode_as_if_alone(client, tiny_policy) -> None:
    """Left padding and the decoding masks: each row of a batch of prompts of 3, 9 and 17
    tokens gets the greedy tokens and log-probs a plain forward loop gives it alone."""
    from transformers import AutoModelForCausalLM

    prompts = [PROMPT, [9, 8, 7, 6, 5, 4, 3, 2, 1], list(range(20, 37))]
    params = SamplingParams(temperature=0.0, max_new_tokens=16)

    async def together():
        return await asyncio.gather(*[client.generate(p, params) for p in prompts])

    outs = _run(together())
    model = AutoModelForCausalLM.from_pretrained(tiny_policy[0]).eval()
    for prompt, out in zip(prompts, outs):
        _assert_greedy_alone(model, prompt, out)


def _assert_greedy_alone(model, prompt: list[int], out) -> None:
    """``out`` has the greedy tokens and log-probs a plain forward loop gives ``prompt`` alone."""
    ids, logps = list(prompt), []
    with torch.no_grad():
        for _ in range(len(out.token_ids)):
            logp = torch.log_softmax(model(torch.tensor([ids])).logits[0, -1].float(), -1)
            ids.append(int(logp.argmax()))
            logps.append(float(logp.max()))
    assert out.token_ids == ids[len(prompt):]
    torch.testing.assert_close(torch.tensor(out.logprobs), torch.tensor(logps), atol=2e-4, rtol=0)


def test_requests_join_a_running_batch_and_leave_it_as_they_finish(client, kind, tiny_policy) -> None:
    """Continuous batching: requests arriving while a long one decodes start at once (one with
    a longer prompt than the batch's cache, one shorter), finish long before it, and every row
    gets what it would alone; the long row is not disturbed by rows joining and leaving."""
    from transformers import AutoModelForCausalLM

    longer, shorter = list(range(20, 37)), [9, 8, 7]
    before = client.engine.stats()

    async def go():
        done: list[str] = []

        async def run(name, prompt, params):
            out = await client.generate(prompt, params, request_id=name)
            done.append(name)
            return out

        async def rest(stream):
            chunks = [c async for c in stream]
            done.append("long")
            return chunks

        stream = client.stream(PROMPT, LONG, request_id="long")
        first = [await stream.__anext__(), await stream.__anext__()]
        tail, *joined = await asyncio.gather(
            rest(stream), run("longer", longer, SamplingParams(temperature=0.0, max_new_tokens=8)),
            run("shorter", shorter, SamplingParams(temperature=0.0, max_new_tokens=4)))
        return first + tail, joined, done

    chunks, (out_longer, out_shorter), done = _run(go())
    assert done[-1] == "long" and len(out_longer.token_ids) == 8 and len(out_shorter.token_ids) == 4
    model = AutoModelForCausalLM.from_pretrained(tiny_policy[0]).eval()
    _assert_greedy_alone(model, longer, out_longer)
    _assert_greedy_alone(model, shorter, out_shorter)
    tokens = [t for c in chunks for t in c.token_ids]
    assert tokens == _run(client.generate(PROMPT, LONG)).token_ids and len(tokens) == 64
    if kind == "hf":  # one batch served all three (vLLM schedules continuously: no batches)
        deadline = time.monotonic() + 5
        while client.engine.stats()["batches"] < before["batches"] + 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        after = client.engine.stats()  # the joined batch, then the baseline's own
        assert after["batches"] - before["batches"] == 2 and after["rows"] - before["rows"] == 4


@pytest.mark.parametrize("temperature,top_p", [(1.0, 1.0), (0.7, 1.0), (0.0, 1.0)])
def test_logprobs_match_a_plain_forward_pass(client, tiny_policy, temperature, top_p) -> None:
    """The recorded behaviour log-prob of every sampled token equals log softmax(logits / T)
    of a plain transformers forward pass over prompt + completion (T = 1 when greedy)."""
    from transformers import AutoModelForCausalLM

    params = SamplingParams(temperature=temperature, top_p=top_p, max_new_tokens=24)
    outs = _run(client.generate_n(PROMPT, SamplingParams(**{**params.__dict__, "n": 3})))
    model = AutoModelForCausalLM.from_pretrained(tiny_policy[0]).eval()
    for c in outs:
        ids = torch.tensor([PROMPT + c.token_ids])
        with torch.no_grad():
            logits = model(ids).logits[0, len(PROMPT) - 1:-1].float()
        logp = torch.log_softmax(logits / (temperature or 1.0), -1)
        want = logp.gather(-1, torch.tensor(c.token_ids).unsqueeze(-1)).squeeze(-1)
        torch.testing.assert_close(torch.tensor(c.logprobs), want, atol=2e-4, rtol=0)


def test_bias_and_penalties_shape_the_sampled_distribution_and_its_logprobs(client, tiny_policy) -> None:
    """``logit_bias`` and presence/frequency penalties act on the logits before temperature, and
    the recorded log-probs (and the ``top_logprobs`` alternatives) are under that reshaped
    distribution, in both engines: checked against a plain forward pass reshaped by hand."""
    from transformers import AutoModelForCausalLM

    params = SamplingParams(temperature=0.7, max_new_tokens=24, logit_bias=((9, 3.0), (12, -100.0)),
                            presence_penalty=0.5, frequency_penalty=1.0, top_logprobs=3, seed=5)
    c = _run(client.generate(PROMPT, params))
    model = AutoModelForCausalLM.from_pretrained(tiny_policy[0]).eval()
    with torch.no_grad():
        logits = model(torch.tensor([PROMPT + c.token_ids])).logits[0, len(PROMPT) - 1:-1].double()
    assert 12 not in c.token_ids and len(c.top) == len(c.token_ids)
    for t, row in enumerate(logits):
        row[9] += 3.0
        row[12] -= 100.0
        counts = torch.bincount(torch.tensor(c.token_ids[:t], dtype=torch.long), minlength=row.numel())[: row.numel()]
        logp = torch.log_softmax((row - 1.0 * counts - 0.5 * (counts > 0)) / 0.7, -1)
        assert c.logprobs[t] == pytest.approx(float(logp[c.token_ids[t]]), abs=2e-4)
        best = logp.topk(3)
        assert [tid for tid, _ in c.top[t]] == best.indices.tolist()
        assert [lp for _, lp in c.top[t]] == pytest.approx(best.values.tolist(), abs=2e-4)


def test_prompt_logprobs_from_first_are_the_tail_of_the_whole_prompts(client) -> None:
    """``first`` = k gives the log-probs of tokens k.. only, equal to the whole prompt's from
    k - 1 on; a ``first`` that names no scorable token is refused, naming it."""
    prompt = list(range(20, 45))

    async def go():
        return await asyncio.gather(client.prompt_logprobs(prompt), client.prompt_logprobs(prompt, first=18),
                                    client.prompt_logprobs(prompt, first=24))

    (v_all, whole), (v_18, tail), (_, last) = _run(go())
    assert v_all == v_18 == client.version and len(whole) == 24 and len(tail) == 7 and len(last) == 1
    torch.testing.assert_close(torch.tensor(tail), torch.tensor(whole[17:]), atol=1e-4, rtol=0)
    torch.testing.assert_close(torch.tensor(last), torch.tensor(whole[-1:]), atol=1e-4, rtol=0)
    for bad in (0, 25):
        with pytest.raises(ValueError, match=f"first={bad}"):
            _run(client.prompt_logprobs(prompt, first=bad))


def test_a_turn_that_extends_a_finished_one_prefills_only_its_new_tokens(client, kind, tiny_policy,
                                                                       policy_state) -> None:
    """HF engine's prefix cache: the next turn of an episode (prompt + completion + an
    observation) and an answer template scored after it reuse the kept KV, and get what a
    plain forward pass gives them; after a weight update a generation reuses the old version's
    KV and prompt scoring does not."""
    if kind != "hf":
        pytest.skip("vLLM's prefix cache is its own (tested by vLLM)")
    from transformers import AutoModelForCausalLM

    params = SamplingParams(temperature=0.0, max_new_tokens=8)
    prompt = list(range(20, 40))  # reuse starts at a block (16 tokens)
    # Five versions on: earlier tests' KV is too old to reuse (``stale_kv_versions``, 4)
    _run(client.update_weights(client.version + 5, InMemoryWeights(policy_state)))
    first = _run(client.generate(prompt, params))
    turn2 = prompt + first.token_ids + [30, 31, 32, 33]
    before = client.engine.stats()
    second = _run(client.generate(turn2, params))
    after = client.engine.stats()
    # the first turn's prompt and all its tokens but the last (never fed forward) are kept
    assert len(first.token_ids) == 8
    assert after["prefix_reused_tokens"] - before["prefix_reused_tokens"] == len(prompt) + 8 - 1
    model = AutoModelForCausalLM.from_pretrained(tiny_policy[0]).eval()
    _assert_greedy_alone(model, turn2, second)

    scored = turn2 + second.token_ids + [40, 41, 42]
    version, lps = _run(client.prompt_logprobs(scored, first=len(turn2) + 8))
    assert client.engine.stats()["prefix_reused_tokens"] - after["prefix_reused_tokens"] == len(turn2) + 8 - 1
    with torch.no_grad():
        logp = torch.log_softmax(model(torch.tensor([scored])).logits[0].float(), -1)
    want = logp[len(turn2) + 7:-1].gather(-1, torch.tensor(scored[len(turn2) + 8:])[:, None])[:, 0]
    torch.testing.assert_close(torch.tensor(lps), want, atol=2e-4, rtol=0)

    # After an update a generation continues on the older version's KV (``stale_kv_versions``,
    # 4 by default), counted as stale; prompt scoring reuses only the new version's
    again = client.engine.stats()
    _run(client.update_weights(client.version + 1, InMemoryWeights(_local_state(tiny_policy[0]))))
    _run(client.generate(turn2, params))
    now = client.engine.stats()
    assert now["prefix_reused_tokens"] - again["prefix_reused_tokens"] == len(turn2) - 1
    assert now["prefix_stale_reused_tokens"] - again["prefix_stale_reused_tokens"] == len(turn2) - 1
    _run(client.prompt_logprobs(scored, first=len(turn2) + 8))
    assert client.engine.stats()["prefix_reused_tokens"] == now["prefix_reused_tokens"]


def test_vllm_reuses_blocks_within_stale_kv_versions_and_scores_on_its_own(client, kind, policy_state) -> None:
    """vLLM's prefix cache through its salts: a generation after one update reuses the blocks an
    earlier one computed (``stale_kv_versions`` is 4), a prompt scoring after it does not; the
    counters are the HF engine's (prefill and reused prompt tokens)."""
    if kind != "vllm":
        pytest.skip("the HF engine's prefix cache is checked in the test before")
    block = client.engine._llm.vllm_config.cache_config.block_size
    prompt = [20 + i % 200 for i in range(2 * block + 5)]
    params = SamplingParams(temperature=0.0, max_new_tokens=4)
    version = client.version // 5 * 5 + 5  # a new span of five versions: nothing cached in it
    _run(client.update_weights(version, InMemoryWeights(policy_state)))
    before = client.engine.stats()
    _run(client.generate(prompt, params))
    first = client.engine.stats()
    assert first["prefill_tokens"] - before["prefill_tokens"] == len(prompt)
    _run(client.update_weights(version + 1, InMemoryWeights(policy_state)))
    _run(client.generate(prompt + [7], params))
    second = client.engine.stats()
    assert second["prefix_reused_tokens"] - first["prefix_reused_tokens"] == 2 * block
    _run(client.prompt_logprobs(prompt + [7]))
    third = client.engine.stats()
    assert third["prefix_reused_tokens"] == second["prefix_reused_tokens"]
    assert third["prefill_tokens"] - second["prefill_tokens"] == len(prompt) + 1


def test_prompt_logprobs_are_served_while_a_batch_decodes(client, kind) -> None:
    """A scorer is not held up by a running batch: the HF engine scores between decoding
    steps, so the answer comes back while a long generation is still running."""
    if kind != "hf":
        pytest.skip("vLLM schedules prompt log-probs with its own requests")
    slow = SamplingParams(temperature=0.0, max_new_tokens=400)

    async def go():
        stream = client.stream(PROMPT, slow)
        await stream.__anext__()
        await client.prompt_logprobs(list(range(20, 40)), first=10)
        rest = [c async for c in stream]
        return rest

    rest = _run(go())
    assert len(rest) > 50  # most of the 400 tokens were still to come


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


@pytest.mark.slow
def test_engine_group_serves_through_an_engines_death(tiny_policy, ray_cluster) -> None:
    """kill -9 of one of two engine actors mid-stream: that stream ends with EngineUnavailable
    (never a silent end), a request of a session pinned to the dead engine is answered by the
    other one, and once Ray has started it again the group routes to it and it answers."""
    import os
    import signal

    ray = ray_cluster
    from rollout.engines.client import RayEngineClient
    from rollout.engines.client import EngineUnavailable
    from rollout.engines.server import EngineServer

    cfg = HFEngineConfig(num_cpus=0.1)
    actors = [ray.remote(EngineServer).options(num_cpus=0.1, max_concurrency=64, max_restarts=1).remote(
        cfg, tiny_policy[0], i, None, True) for i in range(2)]
    client = RayEngineClient(actors, tiny_policy[0])
    pinned = next(f"s{k}" for k in range(100) if zlib.crc32(f"s{k}".encode()) % 2 == 0)  # engine 0's session
    endless = SamplingParams(temperature=0.0, max_new_tokens=2000)
    try:
        pid = ray.get(actors[0].__ray_call__.remote(lambda _: os.getpid()))

        async def go():
            stream = client.stream(PROMPT, endless, session_id=pinned)
            got = [await stream.__anext__()]
            os.kill(pid, signal.SIGKILL)
            with pytest.raises(EngineUnavailable, match="engine 0 died mid-stream"):
                async for chunk in stream:
                    got.append(chunk)
            retried = await client.generate(PROMPT, LONG, session_id=pinned)  # engine 1 answers
            down = client.health()
            return got, retried, down

        got, retried, down = _run(go())
        assert got[0].token_ids and all(c.finish_reason is None for c in got)
        assert len(retried.token_ids) == 64 and retried.finish_reason == "length"
        assert [(h["up"], h["found_dead"] >= 1) for h in down] == [(False, True), (True, False)]
        assert down[1]["answered"] >= 1
        # Past DOWN_S the pinned session's requests try engine 0 again: while Ray restarts it a
        # call finds it unavailable (marked down again, answered elsewhere) or waits for it
        answered, deadline = down[0]["answered"], time.monotonic() + 120
        while client.health()[0]["answered"] == answered:
            assert time.monotonic() < deadline, f"engine 0 never answered again: {client.health()}"
            time.sleep(5.0)
            again = _run(client.generate(PROMPT, LONG, session_id=pinned))
            assert len(again.token_ids) == 64  # every request answered, by one engine or the other
        assert client.health()[0]["up"]
        assert ray.get(actors[0].__ray_call__.remote(lambda _: os.getpid())) != pid
    finally:
        for a in actors:
            ray.kill(a)


def _local_state(path: str) -> dict[str, torch.Tensor]:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path).state_dict()
