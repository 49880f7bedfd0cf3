"""Replay store throughput: RedisReplayStore put+claim+ack against raw redis-py writes.

    .venv/bin/python bench/replay.py [--quick] [--groups N] [--batch B] [--appendfsync P]
                                     [--repeats R] [--no-json] [--single-puts]

Starts its own redis-server (loopback, data in a temporary directory, append-only file on with
the embedded default ``appendfsync always`` unless told otherwise) and drives, round after
round, what producers and the learner do: put B realistic groups (16 rollouts x 8 turns x
256 sampled tokens, plus a 256-token prompt and 64-token observations) in one ``put_many``
(the reward service coalesces the puts of groups that finish together), claim B, ack (and
commit, as a learner that keeps no checkpoint does in the same call).
Each round is paired with a round of raw redis-py pipelined SETs of the same B payloads
(on a client set up like the store's), so both see the same machine load: on a shared
machine the raw rate alone swings 2x from minute to minute.

A store takes groups as records (replay/record.py): producers encode them in their own
process, where they would otherwise pickle them for Ray, and the learner decodes them in its
own. So the lines are:

- ``[binary records]`` and ``[binary+zlib records]``: the store's work as deployed, records in
  (encoded before the clock, as a producer hands them over) and records out (decoded by the
  learner, not the store); the zlib line compresses in the store;
- ``[binary, codec at both ends]`` (and the old JSON record's, unless ``--no-json``): the same
  with the producer's encoding and the learner's decoding timed in each round (what this line
  measured when the store encoded and decoded itself);
- ``[producer and learner processes]``: a producer process (encoding, then ``put_many``) and a
  learner process (claim, decode, ack) at once, as a run places them;
- the serialization a group costs on its way producer -> replay actor -> learner, as models
  (each Ray hop pickles them, the store encodes and decodes) against as records.

Each line gives store groups/s and raw pipelined SET groups/s of the same bytes (writes
only), their ratio (goal: >= 0.5), and p50/p95/p99 latency of claim(B) (the claim script and
reading the B records back; with decoding on the codec-at-both-ends lines), which is what the
learner waits on between steps.
"""

from __future__ import annotations

import argparse
import gc
import multiprocessing as mp
import pickle
import random
import sys
import tempfile
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere

from replay import codec, redis_store  # noqa: E402
from replay.config import ReplayConfig  # noqa: E402
from replay.record import GroupRecord  # noqa: E402
from replay.redis_server import RedisServer  # noqa: E402
from replay.redis_store import RedisReplayStore, delete_run, stored_payload  # noqa: E402
from rollout.trajectory import Group, Trajectory, Turn  # noqa: E402

ROLLOUTS, TURNS, ACTION_TOKENS, OBS_TOKENS, PROMPT_TOKENS = 16, 8, 256, 64, 256
Encoder = Callable[[Group], bytes]


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


def json_encode(group: Group) -> bytes:
    """The record before the binary format: the group's JSON (readers still take it)."""
    return group.model_dump_json().encode()


ENCODINGS: dict[str, Encoder] = {"binary": codec.encode_group, "json (old)": json_encode}


def records_of(groups: list[Group], encode: Encoder) -> list[GroupRecord]:
    """What producers hand the store: each group encoded (``GroupRecord.of`` for binary)."""
    return [GroupRecord(g.group_id, g.min_version(), None, encode(g)) for g in groups]


def pct(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


@dataclass
class Totals:
    store_s: float = 0.0
    raw_s: float = 0.0
    claim_s: list[float] = field(default_factory=list)


def raw_round(client, payloads: list[bytes], first: int) -> float:
    """Seconds to SET ``payloads`` in one pipeline (writes only), then unlinked untimed."""
    keys = [f"raw:{first + j}" for j in range(len(payloads))]
    start = time.perf_counter()
    pipe = client.pipeline(transaction=False)
    for key, payload in zip(keys, payloads):
        pipe.set(key, payload)
    pipe.execute()
    elapsed = time.perf_counter() - start
    client.unlink(*keys)  # the store frees its payloads at commit too
    return elapsed


@dataclass(frozen=True)
class Line:
    """One line's setup: the records' encoding, the store's compression, whether the
    producer's encoding and the learner's decoding are timed, and one put per group."""

    encoding: str = "binary"
    compress: bool = False
    ends: bool = False
    single: bool = False

    def label(self) -> str:
        name = self.encoding + ("+zlib" if self.compress else "")
        return (f"{name}, codec at both ends" if self.ends else f"{name} records") + (
            ", one put per group" if self.single else "")


def store_round(store: RedisReplayStore, groups: list[Group], records: list[GroupRecord],
                line: Line, totals: Totals) -> None:
    """Producers put the batch (one ``put_many``, as the reward service's coalesced puts
    send groups that finish together; ``line.single``: one ``put`` each); the learner claims,
    acknowledges and checkpoints it. ``line.ends``: encoding and decoding timed too."""
    start = time.perf_counter()
    if line.ends:
        records = records_of(groups, ENCODINGS[line.encoding])
    results = [store.put(r) for r in records] if line.single else store.put_many(records)
    assert all(r.accepted for r in results)
    t = time.perf_counter()
    claim = store.claim(len(records))
    if line.ends:
        assert len(claim.groups) == len(records)  # the learner's decoding
    totals.claim_s.append(time.perf_counter() - t)
    store.ack(claim.claim_id, new_version=0, commit=True)  # no checkpoint: payloads freed at once
    totals.store_s += time.perf_counter() - start


def bench(url: str, groups: list[Group], batch: int, line: Line) -> Totals:
    """Alternate a raw round and a store round over the same batches."""
    cfg = ReplayConfig(type="redis", url=url, compress=line.compress, eta=10**6,
                       capacity_groups=4 * batch, capacity_bytes=2**40)
    store = RedisReplayStore(cfg, batch, run_id=f"bench-{time.time_ns()}")
    raw_client = redis_store.connect(url, cfg)  # the store's client settings, minus the store
    records = records_of(groups, ENCODINGS[line.encoding])
    payloads = [stored_payload(r, line.compress) for r in records]  # the bytes the store writes
    totals = Totals()
    for i in range(0, len(groups), batch):
        totals.raw_s += raw_round(raw_client, payloads[i:i + batch], i)
        store_round(store, groups[i:i + batch], records[i:i + batch], line, totals)
    assert store.stats().trained == len(groups)
    store.delete_run()
    store.close()
    raw_client.close()
    return totals


def mean_ms(fn: Callable[[], Any], reps: int = 10) -> float:
    fn()  # warm: field plans and struct layouts are built once
    t = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - t) / reps * 1e3


def codec_ms(group: Group, encode: Encoder) -> tuple[float, float]:
    payload = encode(group)
    return mean_ms(lambda: encode(group)), mean_ms(lambda: codec.decode_group(payload))


def run(url: str, groups: list[Group], batch: int, line: Line) -> str:
    """One line of results."""
    res = bench(url, groups, batch, line)
    store, raw = len(groups) / res.store_s, len(groups) / res.raw_s
    enc, dec = codec_ms(groups[0], ENCODINGS[line.encoding])
    where = "timed in each round" if line.ends else "in the producer and the learner, not timed"
    return (f"[{line.label()}] store put+claim+ack {store:6.1f} groups/s | raw pipelined SET of "
            f"the same bytes {raw:6.1f} groups/s | ratio {store / raw:.2f} | claim({batch}) p50 "
            f"{pct(res.claim_s, 0.5) * 1e3:.1f} ms p95 {pct(res.claim_s, 0.95) * 1e3:.1f} ms "
            f"p99 {pct(res.claim_s, 0.99) * 1e3:.1f} ms | encode {enc:.2f} ms decode {dec:.2f} ms "
            f"a group, {where}")


def hops(group: Group) -> str:
    """Serialization a group costs on its way producer -> replay actor -> learner: pickle
    (protocol 5, as Ray's serializer writes these objects) at each of the two hops, plus the
    codec. As models: each hop pickles and unpickles the group, and the store encodes it on
    put and decodes it on claim. As records: the producer encodes, each hop pickles the
    record's bytes, the learner decodes. Collector paused, as ``codec.decode_groups`` does."""
    def trip(obj: Any) -> Any:
        return pickle.loads(pickle.dumps(obj, protocol=5))

    def as_models() -> None:
        codec.decode_group(codec.encode_group(trip(group)))  # reward -> replay, into Redis and back
        trip(group)  # replay -> learner

    def as_records() -> None:
        record = trip(GroupRecord.of(group))  # reward -> replay
        codec.decode_group(trip(record).payload)  # replay -> learner, decoded there

    gc.disable()
    try:
        models, records = min(mean_ms(as_models) for _ in range(3)), min(mean_ms(as_records) for _ in range(3))
    finally:
        gc.enable()
    return (f"[serialization producer -> replay -> learner] as models {models:.2f} ms a group | "
            f"as records {records:.2f} ms | ratio {records / models:.2f}")


# -- producer and learner in processes of their own, as deployed ----------------------------
def versioned_groups(n: int, batch: int) -> list[Group]:
    """``make_groups`` stamped with the policy version each was generated under when producers
    run ahead of the learner as far as ``eta=1`` admits (two batches): group i, claimed at
    version i // B, was generated at i // B - 1 and is one version stale (within eta)."""
    def stamped(group: Group, version: int) -> Group:
        trajs = [t.model_copy(update={"turns": [turn.model_copy(update={"policy_version": version})
                                                 for turn in t.turns]}) for t in group.trajectories]
        return group.model_copy(update={"trajectories": trajs})

    return [stamped(g, max(0, i // batch - 1)) for i, g in enumerate(make_groups(n))]


def deployed_cfg(url: str, batch: int) -> ReplayConfig:
    return ReplayConfig(type="redis", url=url, eta=1, max_concurrent_groups=2 * batch,
                        capacity_groups=4 * batch, capacity_bytes=2**40)


def produce(url: str, run_id: str, n: int, batch: int, start: Any) -> None:
    """A producer process: reserve (the staleness admission of eta=1), then put what it was
    granted in one ``put_many``, until n groups are in."""
    groups = versioned_groups(n, batch)
    store = RedisReplayStore(deployed_cfg(url, batch), batch, run_id=run_id)
    start.wait()
    done = 0
    while done < n:
        granted = store.reserve(min(batch, n - done))
        if not granted:
            time.sleep(0.0005)
            continue
        records = [GroupRecord.of(g) for g in groups[done:done + granted]]  # encoded here
        assert all(r.accepted for r in store.put_many(records))
        done += granted
    store.close()


def learn(url: str, run_id: str, n: int, batch: int, start: Any, out: Any) -> None:
    """A learner process: claim B, decode them, ack with the next version and commit, until n
    groups are trained; sends back its seconds from the start and each claim's latency."""
    store = RedisReplayStore(deployed_cfg(url, batch), batch, run_id=run_id)
    start.wait()
    t0, version, claims = time.perf_counter(), 0, []
    while version * batch < n:
        t = time.perf_counter()
        claim = store.claim(batch)
        if claim is None:
            time.sleep(0.0005)
            continue
        assert len(claim.groups) == batch  # decoded here, in the learner's process
        claims.append(time.perf_counter() - t)
        version += 1
        store.ack(claim.claim_id, version, commit=True)
    out.put((time.perf_counter() - t0, claims))
    store.close()


def deployed(url: str, n: int, batch: int, repeats: int) -> str:
    """Alternate raw blocks (all n groups' bytes, B per pipeline) and store blocks (a producer
    process and a learner process at once, as a run places them); one line of results."""
    ctx = mp.get_context("spawn")
    payloads = [codec.encode_group(g) for g in make_groups(n)]
    raw_client = redis_store.connect(url, deployed_cfg(url, batch))
    totals = Totals()
    for _ in range(repeats):
        totals.raw_s += sum(raw_round(raw_client, payloads[i:i + batch], i) for i in range(0, n, batch))
        run_id, start, out = f"deployed-{time.time_ns()}", ctx.Barrier(3), ctx.Queue()
        procs = [ctx.Process(target=produce, args=(url, run_id, n, batch, start)),
                 ctx.Process(target=learn, args=(url, run_id, n, batch, start, out))]
        for proc in procs:
            proc.start()
        start.wait()  # both have built their store (and the producer its groups): go
        seconds, claims = out.get(timeout=600)
        for proc in procs:
            proc.join(60)
            assert proc.exitcode == 0, f"{proc.name} exited {proc.exitcode}"
        totals.store_s += seconds
        totals.claim_s += claims
        delete_run(raw_client, run_id)
    raw_client.close()
    store, raw = repeats * n / totals.store_s, repeats * n / totals.raw_s
    return (f"[producer (encoding) and learner (decoding) processes] store {store:6.1f} groups/s | raw pipelined "
            f"SET {raw:6.1f} groups/s | ratio {store / raw:.2f} | claim({batch}) p50 "
            f"{pct(totals.claim_s, 0.5) * 1e3:.1f} ms p95 {pct(totals.claim_s, 0.95) * 1e3:.1f} ms")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="32 groups instead of 256")
    parser.add_argument("--groups", type=int, default=None)
    parser.add_argument("--batch", type=int, default=8, help="groups per claim (B)")
    parser.add_argument("--appendfsync", choices=["always", "everysec", "no", "off"],
                        default="always", help="server AOF policy; 'off' disables the AOF")
    parser.add_argument("--repeats", type=int, default=2,
                        help="raw/store block pairs of the producer-and-learner-processes line")
    parser.add_argument("--no-json", action="store_true", help="skip the old JSON encoding's line")
    parser.add_argument("--single-puts", action="store_true",
                        help="add lines with one put per group (before puts were coalesced)")
    args = parser.parse_args()
    n = args.groups or (32 if args.quick else 256)
    groups = make_groups(n)
    record = codec.encode_group(groups[0])
    print(f"group: {ROLLOUTS} rollouts x {TURNS} turns x {ACTION_TOKENS} tokens; record "
          f"{len(record) / 2**20:.2f} MiB (zlib-1 {len(zlib.compress(record, 1)) / 2**20:.2f} MiB, "
          f"old JSON {len(json_encode(groups[0])) / 2**20:.2f} MiB); {n} groups, "
          f"B={args.batch}, appendfsync={args.appendfsync}")
    aof = args.appendfsync != "off"
    lines = [Line(), Line(compress=True), Line(ends=True)]
    lines += [] if args.no_json else [Line("json (old)", ends=True)]
    with tempfile.TemporaryDirectory() as tmp, RedisServer(
            tmp, appendonly=aof, appendfsync=args.appendfsync if aof else "always") as server:
        for line in lines:
            print(run(server.url, groups, args.batch, line), flush=True)
        print(deployed(server.url, n, args.batch, args.repeats), flush=True)
        if args.single_puts:
            print(run(server.url, groups, args.batch, Line(single=True)), flush=True)
            print(run(server.url, groups, args.batch, Line(ends=True, single=True)), flush=True)
        print(hops(groups[0]), flush=True)

if __name__ == "__main__":
    main()
