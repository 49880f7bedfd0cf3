"""Engine throughput: the HF engine against plain ``model.generate``, side by side in one run.

    .venv/bin/python bench/engines.py [--quick] [--batch B] [--requests R] [--max-new-tokens T]

Same model (the tiny warm-started policy of bench/serving.py), the same search-QA prompts, the
same sampling (temperature 0.7, top-p 1, at most T new tokens, stopping at end-of-turn):

1. **Equal batch.** B prompts at once: one ``model.generate`` call on the left-padded batch,
   against B concurrent requests to the engine (which decodes them as one batch). Prints
   generated tokens/s of each and their ratio (goal: the engine at least matches it).
2. **Concurrent load.** R requests arriving together, as a server sees them: a plain server
   answers each with its own ``model.generate`` call, one after another; the engine batches
   whatever is waiting (up to ``rollout.engine.max_batch``). Prints tokens/s, p50/p99 request
   latency and the throughput ratio (goal: the engine beats it).
3. **Per-token overhead.** The engine's wall time per generated token at batch B minus that of
   ``model.generate`` at the same batch: the Python the engine adds per token (sampling, emitting,
   step boundaries for pause and weight loads).

Tokens are counted as generated (rows that stop early stop counting), so both sides are
charged for the padding rows they carry.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere

import torch  # noqa: E402

from serving import build_policy  # noqa: E402  (bench/ is on sys.path as the script's folder)

TEMPERATURE = 0.7


def prompts_of(policy: str, source: Any, n: int) -> list[list[int]]:
    from transformers import AutoTokenizer

    from rollout import chat

    tok = AutoTokenizer.from_pretrained(policy)
    tasks = source.tasks("train")
    return [chat.prompt_ids(tok, tasks[i % len(tasks)].messages, tasks[i % len(tasks)].tools) for i in range(n)]


def generate_batch(model: Any, tok: Any, batch: list[list[int]], max_new: int) -> int:
    """One ``model.generate`` call on ``batch`` (left-padded); returns tokens generated."""
    pad = tok.pad_token_id or 0
    width = max(len(p) for p in batch)
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in batch])
    att = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=att, max_new_tokens=max_new, do_sample=True,
                             temperature=TEMPERATURE, top_p=1.0, top_k=0, pad_token_id=pad,
                             eos_token_id=tok.eos_token_id)
    new = out[:, width:]
    done = (new == tok.eos_token_id).int()
    # a row counts its tokens up to and including its end-of-turn; padding after it does not
    ended = done.cumsum(-1) - done > 0
    return int((~ended).sum())


async def engine_requests(client: Any, prompts: list[list[int]], max_new: int) -> tuple[int, list[float]]:
    """All ``prompts`` as concurrent requests; returns (tokens generated, per-request latency)."""
    from rollout.engines.base import SamplingParams

    params = SamplingParams(temperature=TEMPERATURE, top_p=1.0, max_new_tokens=max_new)

    async def one(p: list[int]) -> tuple[int, float]:
        t0 = time.perf_counter()
        done = await client.generate(p, params)
        return len(done.token_ids), time.perf_counter() - t0

    results = await asyncio.gather(*[one(p) for p in prompts])
    return sum(n for n, _ in results), [s for _, s in results]


def plain_server(model: Any, tok: Any, prompts: list[list[int]], max_new: int) -> tuple[int, list[float]]:
    """One ``model.generate`` per request, in arrival order (all arrived at t0)."""
    t0, tokens, latency = time.perf_counter(), 0, []
    for p in prompts:
        tokens += generate_batch(model, tok, [p], max_new)
        latency.append(time.perf_counter() - t0)
    return tokens, latency


def timed(fn: Any) -> tuple[Any, float]:
    t0 = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t0


def run_phase(side: str, phase: str, policy: str, n_prompts: int, max_batch: int, max_new: int,
              repeats: int) -> tuple[int, float, list[float]]:
    """One side of one phase in this (fresh) process: (tokens, seconds, request latencies) of
    its best repeat. Each phase gets a process of its own because torch's OpenMP workers spin
    for a while after a call: a second thread calling torch in the same process (the engine's
    decode thread after ``generate`` on the main one) would share its cores with them."""
    torch.set_num_threads(2)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rollout.config import HFEngineConfig
    from rollout.engines import local_client

    _, source = build_policy(show_progress=False)
    prompts = prompts_of(policy, source, n_prompts)
    tok = AutoTokenizer.from_pretrained(policy)
    if side == "generate":
        model = AutoModelForCausalLM.from_pretrained(policy, dtype=torch.float32).eval()
        generate_batch(model, tok, prompts[:2], 4)  # warm up
        one = (lambda: (generate_batch(model, tok, prompts, max_new), [])) if phase == "batch" \
            else (lambda: plain_server(model, tok, prompts, max_new))
    else:
        client = local_client(HFEngineConfig(max_batch=max_batch), policy)

        def one() -> tuple[int, list[float]]:
            return asyncio.run(engine_requests(client, prompts, max_new))

        asyncio.run(engine_requests(client, prompts[:2], 4))  # warm up
    runs = [timed(one) for _ in range(repeats)]
    (tokens, latency), seconds = max(runs, key=lambda r: r[0][0] / r[1])
    return tokens, seconds, latency


def main() -> None:
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="batch 8, 16 requests, 24 new tokens, 1 repeat")
    p.add_argument("--batch", type=int, default=16, help="B, the equal-batch size")
    p.add_argument("--requests", type=int, default=64, help="R, requests arriving together")
    p.add_argument("--max-new-tokens", type=int, default=48)
    p.add_argument("--repeats", type=int, default=3, help="equal-batch runs per side (best kept)")
    args = p.parse_args()
    if args.quick:
        args.batch, args.requests, args.max_new_tokens, args.repeats = 8, 16, 24, 1
    policy, _ = build_policy()
    ctx = multiprocessing.get_context("spawn")
    res = {}
    for side, phase, n, reps in (("generate", "batch", args.batch, args.repeats),
                                 ("engine", "batch", args.batch, args.repeats),
                                 ("generate", "load", args.requests, 1), ("engine", "load", args.requests, 1)):
        with ProcessPoolExecutor(max_workers=1, mp_context=ctx) as pool:
            res[side, phase] = pool.submit(run_phase, side, phase, policy, n, args.batch, args.max_new_tokens,
                                           reps).result()
    tps = {key: tokens / seconds for key, (tokens, seconds, _) in res.items()}
    q = lambda xs, k: statistics.quantiles(xs, n=100)[k - 1] if len(xs) > 1 else xs[0]  # noqa: E731
    gen_lat, eng_lat = res["generate", "load"][2], res["engine", "load"][2]
    print(f"\nengines: tiny policy, temperature {TEMPERATURE}, <= {args.max_new_tokens} new tokens, 2 torch "
          "threads, each measurement in its own process")
    print(f"1. equal batch of {args.batch}: model.generate {tps['generate', 'batch']:.0f} tok/s, engine "
          f"{tps['engine', 'batch']:.0f} tok/s, ratio engine/generate "
          f"{tps['engine', 'batch'] / tps['generate', 'batch']:.2f} (goal >= 1.00)")
    print(f"2. {args.requests} concurrent requests: one generate per request {tps['generate', 'load']:.0f} tok/s "
          f"(p50 {q(gen_lat, 50):.2f} s, p99 {q(gen_lat, 99):.2f} s); engine {tps['engine', 'load']:.0f} tok/s "
          f"(p50 {q(eng_lat, 50):.2f} s, p99 {q(eng_lat, 99):.2f} s); throughput ratio "
          f"{tps['engine', 'load'] / tps['generate', 'load']:.2f} (goal > 1)")
    per = {side: 1e3 / tps[side, "batch"] for side in ("engine", "generate")}
    print(f"3. per-token overhead at batch {args.batch}: engine {per['engine']:.3f} ms/token, generate "
          f"{per['generate']:.3f} ms/token, engine adds {per['engine'] - per['generate']:+.3f} ms/token")


if __name__ == "__main__":
    main()
