"""Multi-turn episodes on the HF engine with its prefix cache on and off, side by side.

    .venv/bin/python bench/prefix_cache.py [--quick] [--sessions S] [--turns T]

S sessions play T turns concurrently, as rollout workers do: each turn's prompt is the whole
episode so far (prompt, earlier actions and their observations: random tokens of tool-result
lengths), sent with the session's id. Two engines on the same tiny model (``bench/tiny_llama.py``)
take the same episodes turn by turn, alternating, one with ``prefix_cache_mib`` 512 and one with
0; greedy decoding, so both produce the same tokens. Prints each engine's wall time and
generated tokens/s, the prompt tokens it prefilled against those it reused, and the ratio.
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

from bench.ig import CORPUS  # noqa: E402
from bench.tiny_llama import build_tiny_llama  # noqa: E402
from rollout.config import HFEngineConfig  # noqa: E402
from rollout.engines import local_client  # noqa: E402
from rollout.engines.base import SamplingParams  # noqa: E402


async def turn(client, contexts: list[list[int]], params: SamplingParams) -> list:
    return await asyncio.gather(*[client.generate(c, params, session_id=f"s{i}") for i, c in enumerate(contexts)])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="8 sessions x 4 turns")
    ap.add_argument("--sessions", type=int, default=16)
    ap.add_argument("--turns", type=int, default=6)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--layers", type=int, default=4)
    args = ap.parse_args()
    if args.quick:
        args.sessions, args.turns = 8, 4
    rng = random.Random(0)
    with tempfile.TemporaryDirectory() as tmp:
        _, tok = build_tiny_llama(Path(tmp), CORPUS * 10, vocab=1000, hidden=args.hidden,
                                  layers=args.layers, max_positions=8192)
        clients = {"cache on": local_client(HFEngineConfig(), tmp), "cache off": local_client(
            HFEngineConfig(prefix_cache_mib=0), tmp)}
    vocab = list(range(2, len(tok)))
    prompts = [[rng.choice(vocab) for _ in range(rng.randint(96, 192))] for _ in range(args.sessions)]
    contexts = {name: [list(p) for p in prompts] for name in clients}
    seconds = dict.fromkeys(clients, 0.0)
    generated = dict.fromkeys(clients, 0)
    prompt_tokens = 0
    for _ in range(args.turns):
        params = SamplingParams(temperature=0.0, max_new_tokens=rng.randint(32, 96))
        observations = [[rng.choice(vocab) for _ in range(rng.randint(64, 256))] for _ in prompts]
        prompt_tokens += sum(len(c) for c in contexts["cache on"])
        outs = {}
        for name, client in clients.items():
            start = time.perf_counter()
            outs[name] = asyncio.run(turn(client, contexts[name], params))
            seconds[name] += time.perf_counter() - start
            generated[name] += sum(len(o.token_ids) for o in outs[name])
            for ctx, out, obs in zip(contexts[name], outs[name], observations):
                ctx += out.token_ids + obs
        same = all(a.token_ids == b.token_ids for a, b in zip(outs["cache on"], outs["cache off"]))
        assert same, "greedy decoding gave different tokens with the cache on and off"
    print(f"{args.sessions} sessions x {args.turns} turns, model hidden {args.hidden} x {args.layers} layers; "
          f"{prompt_tokens} prompt tokens sent, {generated['cache on']} generated (same tokens both ways)")
    for name, client in clients.items():
        stats = client.engine.stats()
        reused = int(stats["prefix_reused_tokens"])
        print(f"{name:<10} {seconds[name]:7.2f} s  {generated[name] / seconds[name]:8.0f} generated tok/s  "
              f"prefilled {prompt_tokens - reused} prompt tokens, reused {reused}")
        asyncio.run(client.engine.close())
    print(f"cache on / off speed: {seconds['cache off'] / seconds['cache on']:.2f}x")


if __name__ == "__main__":
    main()
