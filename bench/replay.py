"""Replay store throughput: RedisReplayStore put+claim+ack against raw redis-py writes.

    .venv/bin/python bench/replay.py [--quick] [--groups N] [--batch B] [--appendfsync P]

Starts its own redis-server (loopback, data in a temporary directory, append-only file on with
the embedded default ``appendfsync always`` unless told otherwise) and drives, round after
round, what producers and the learner do: put B realistic groups (16 rollouts x 8 turns x 256
sampled tokens, plus a 256-token prompt and 64-token observations), claim B, ack, commit.
It prints:

- store groups/s (serialisation, Lua scripts and deserialisation included) for raw JSON and
  zlib payloads, and the ratio to raw redis-py pipelined SETs of the same payload bytes;
- p50/p99 latency of claim(B), which is what the learner waits on between steps;
- the JSON encode/decode cost per group, which is most of the gap to the raw writes.
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
import time
import zlib
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere

import redis  # noqa: E402

from replay.config import ReplayConfig  # noqa: E402
from replay.redis_server import RedisServer  # noqa: E402
from replay.redis_store import RedisReplayStore, decode_group, encode_group  # noqa: E402
from rollout.trajectory import Group, Trajectory, Turn  # noqa: E402

ROLLOUTS, TURNS, ACTION_TOKENS, OBS_TOKENS, PROMPT_TOKENS = 16, 8, 256, 64, 256


def realistic_group(group_id: str, rng: random.Random) -> Group:
    """Random token ids over a 150k vocabulary and behaviour log-probs, as an engine emits."""

    def ids(n: int) -> list[int]:
        return [rng.randrange(150_000) for _ in range(n)]

    trajs = [
        Trajectory(
            trajectory_id=f"{group_id}-{r}", task_id=f"task-{group_id}", group_id=group_id,
            prompt_ids=ids(PROMPT_TOKENS),
            turns=[Turn(action_ids=ids(ACTION_TOKENS),
                        action_logprobs=[-rng.expovariate(2.0) for _ in range(ACTION_TOKENS)],
                        policy_version=0, observation_ids=ids(OBS_TOKENS))
                   for _ in range(TURNS)],
        )
        for r in range(ROLLOUTS)
    ]
    return Group(group_id=group_id, task_id=f"task-{group_id}", trajectories=trajs)


def make_groups(n: int) -> list[Group]:
    # A few distinct token sets, renamed: building 65k random tokens per group dominates setup.
    rng = random.Random(0)
    bases = [realistic_group("base", rng) for _ in range(min(n, 4))]
    return [bases[i % len(bases)].model_copy(update={"group_id": f"g{i}"}) for i in range(n)]


def pct(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def bench_store(url: str, groups: list[Group], batch: int, compress: bool) -> dict[str, float]:
    cfg = ReplayConfig(type="redis", url=url, compress=compress, eta=10**6,
                       capacity_groups=4 * batch, capacity_bytes=2**34)
    store = RedisReplayStore(cfg, batch, run_id=f"bench-{int(compress)}-{time.time_ns()}")
    latencies: list[float] = []
    start = time.perf_counter()
    for i in range(0, len(groups), batch):
        for group in groups[i:i + batch]:
            assert store.put(group).accepted
        t = time.perf_counter()
        claim = store.claim(batch)
        latencies.append(time.perf_counter() - t)
        store.ack(claim.claim_id, new_version=0)
        store.commit(0)  # a learner that checkpoints every step frees the payloads at once
    elapsed = time.perf_counter() - start
    assert store.stats().trained == len(groups)
    store.delete_run()
    store.close()
    return {"groups_s": len(groups) / elapsed, "p50_ms": pct(latencies, 0.5) * 1e3,
            "p99_ms": pct(latencies, 0.99) * 1e3}


def bench_raw(url: str, payloads: list[bytes], batch: int) -> float:
    """groups/s of pipelined SETs of the same bytes, B per round trip (writes only)."""
    client = redis.Redis.from_url(url)
    start = time.perf_counter()
    for i in range(0, len(payloads), batch):
        pipe = client.pipeline(transaction=False)
        for j, payload in enumerate(payloads[i:i + batch], start=i):
            pipe.set(f"raw:{j}", payload)
        pipe.execute()
    elapsed = time.perf_counter() - start
    for key in client.scan_iter(match="raw:*", count=500):
        client.unlink(key)
    client.close()
    return len(payloads) / elapsed


def codec_ms(group: Group, compress: bool, reps: int = 5) -> tuple[float, float]:
    t = time.perf_counter()
    for _ in range(reps):
        payload, _n = encode_group(group, compress)
    enc = (time.perf_counter() - t) / reps
    t = time.perf_counter()
    for _ in range(reps):
        decode_group(payload)
    return enc * 1e3, (time.perf_counter() - t) / reps * 1e3


def run(url: str, groups: list[Group], batch: int, compress: bool) -> str:
    """One line of results for one payload encoding."""
    enc, dec = codec_ms(groups[0], compress)
    raw = bench_raw(url, [encode_group(g, compress)[0] for g in groups], batch)
    res = bench_store(url, groups, batch, compress)
    codec_share = (enc + dec) * res["groups_s"] / 10  # ms/group * groups/s / 1000, in %
    return (f"[{'zlib' if compress else 'json'}] store put+claim+ack {res['groups_s']:7.1f} "
            f"groups/s | raw pipelined SET {raw:7.1f} groups/s | ratio {res['groups_s'] / raw:.2f}"
            f" | claim({batch}) p50 {res['p50_ms']:.1f} ms p99 {res['p99_ms']:.1f} ms | "
            f"encode {enc:.1f} ms decode {dec:.1f} ms per group (~{codec_share:.0f} % of the "
            "store's time)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="32 groups instead of 256")
    parser.add_argument("--groups", type=int, default=None)
    parser.add_argument("--batch", type=int, default=8, help="groups per claim (B)")
    parser.add_argument("--appendfsync", choices=["always", "everysec", "no", "off"],
                        default="always", help="server AOF policy; 'off' disables the AOF")
    args = parser.parse_args()
    n = args.groups or (32 if args.quick else 256)
    groups = make_groups(n)
    raw_json = groups[0].model_dump_json().encode()
    print(f"group: {ROLLOUTS} rollouts x {TURNS} turns x {ACTION_TOKENS} tokens; JSON "
          f"{len(raw_json) / 2**20:.2f} MiB, zlib-1 {len(zlib.compress(raw_json, 1)) / 2**20:.2f} "
          f"MiB; {n} groups, B={args.batch}, appendfsync={args.appendfsync}")
    aof = args.appendfsync != "off"
    with tempfile.TemporaryDirectory() as tmp, RedisServer(
            tmp, appendonly=aof, appendfsync=args.appendfsync if aof else "always") as server:
        for compress in (False, True):
            print(run(server.url, groups, args.batch, compress), flush=True)


if __name__ == "__main__":
    main()
