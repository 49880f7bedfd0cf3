"""GRPO-shaped load on the HF engine: groups of identical prompts against as many distinct ones.

    .venv/bin/python bench/group_prefill.py [--quick] [--groups G] [--group-size N] [--rounds R]

A GRPO step samples N episodes of each of G tasks, and their first turns reach the engine
together with one prompt per group. The engine computes an identical prompt once and copies its
row (``DecodeBatch.prefill``, rollout/engines/hf_batch.py); this bench sends, round after round on one engine, G x N requests
whose prompts come in G groups of N identical ones, and, alternating with those rounds, G x N
requests with distinct prompts of the same length (every prompt computed). Same model (the tiny
Llama of bench/prefix_cache.py), temperature 0.7, 48 new tokens, 150-token prompts, one torch
thread. Prints for each load the prompt tokens the engine prefilled, CPU milliseconds per
generated token (this process) and generated tokens/s, and their ratios.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere

import torch  # noqa: E402

from bench.ig import CORPUS  # noqa: E402
from bench.tiny_llama import build_tiny_llama  # noqa: E402
from rollout.config import HFEngineConfig  # noqa: E402
from rollout.engines import local_client  # noqa: E402
from rollout.engines.base import SamplingParams  # noqa: E402

PROMPT_TOKENS = 150
PARAMS = SamplingParams(temperature=0.7, max_new_tokens=48)


async def one_round(client, prompts: list[list[int]], copies: int) -> int:
    """Every prompt ``copies`` times, all at once; generated tokens."""
    outs = await asyncio.gather(*[client.generate(p, PARAMS) for p in prompts for _ in range(copies)])
    return sum(len(o.token_ids) for o in outs)


def _prefilled(client) -> float:
    # NaN on an engine older than the count (this file copied into an old checkout, to compare)
    return client.engine.stats().get("prefill_tokens", float("nan"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="2 groups of 4, 2 rounds")
    ap.add_argument("--groups", type=int, default=4)
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=6)
    args = ap.parse_args()
    if args.quick:
        args.groups, args.group_size, args.rounds = 2, 4, 2
    torch.set_num_threads(1)
    rng = random.Random(0)
    with tempfile.TemporaryDirectory() as tmp:
        _, tok = build_tiny_llama(Path(tmp), CORPUS * 10, vocab=1000, hidden=128, layers=4, max_positions=1024)
        client = local_client(HFEngineConfig(), tmp)

    def prompts(n: int) -> list[list[int]]:  # fresh tokens each round: no prefix cache hits
        return [[rng.randrange(2, len(tok)) for _ in range(PROMPT_TOKENS)] for _ in range(n)]

    g, n = args.groups, args.group_size
    asyncio.run(one_round(client, prompts(g), n))  # warm
    loads = {"grouped": (g, n), "distinct": (g * n, 1)}
    cpu, wall, tokens, prefilled = (dict.fromkeys(loads, 0.0) for _ in range(4))
    for _ in range(args.rounds):
        for name, (unique, copies) in loads.items():
            batch = prompts(unique)
            before, c0, t0 = _prefilled(client), time.process_time(), time.perf_counter()
            tokens[name] += asyncio.run(one_round(client, batch, copies))
            cpu[name] += time.process_time() - c0
            wall[name] += time.perf_counter() - t0
            prefilled[name] += _prefilled(client) - before
    print(f"HF engine, {g} x {n} requests a round ({g} groups of {n} identical {PROMPT_TOKENS}-token prompts, "
          f"or {g * n} distinct), {args.rounds} rounds each, alternating")
    for name in loads:
        print(f"  {name:<9} prefilled {prefilled[name] / args.rounds:7.0f} tokens a round | "
              f"{cpu[name] / tokens[name] * 1e3:.3f} ms CPU per generated token | {tokens[name] / wall[name]:7.0f} tok/s")
    print(f"grouped / distinct: prefill {prefilled['grouped'] / prefilled['distinct']:.2f}x the tokens, "
          f"CPU per token {cpu['grouped'] / tokens['grouped'] / (cpu['distinct'] / tokens['distinct']):.2f}x, "
          f"speed {tokens['grouped'] / wall['grouped'] / (tokens['distinct'] / wall['distinct']):.2f}x")


if __name__ == "__main__":
    main()
