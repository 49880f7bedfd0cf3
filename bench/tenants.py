"""Many LoRA tenants on one engine pool against one run alone, side by side in one run, on Ray.

    .venv/bin/python bench/tenants.py [--quick] [--model tiny|smollm2] [--tenants 1,4,8]
                                      [--seconds 40] [--in-flight 4] [--rank 16] [--repeats 5]
                                      [--parts 1,2,3]

1. **Throughput.** A tenant is a LoRA run's rollout side: an actor playing ``--in-flight``
   search-QA episodes at a time with the rollout's own episode code (``run_episode``) through
   its adapter (``AdapterClient``). *Alone*: one tenant on an engine of its own (a whole stack's
   engine, serving its one adapter, no gate). *Pool*: N tenants, each with its own adapter, on
   one pool (``cluster.pool``: the same engine settings behind the pool's fair gate). Episodes
   (samples) finished within ``--seconds`` by every tenant together; the ratio aggregate
   samples/s with N tenants / samples/s alone (goal >= 0.9: sharing costs at most 10%), and
   the spread between tenants (min/max of their samples: the fair gate's doing).
2. **Memory.** Unique memory (USS) of a run's actors: a LoRA run with engines of its own (the
   whole stack, ``cluster.actors.start_actors``) and the same run on the pool (no engine), plus
   what one more adapter adds to the pool's engine; the ratio what a tenant adds / a whole
   stack (goal <= 10%), and the pool engine's share alone (what sharing saves per tenant).
3. **Adapter publish.** A rank ``--rank`` adapter version from a tenant's weight sync into the
   pool's engine (Ray's object store, ``EngineServer.load``), end to end, best and median of
   ``--repeats``: idle, and while every tenant decodes (goal <= 50 ms).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere

from rollout.cores import apply_thread_policy  # noqa: E402

apply_thread_policy()  # before torch loads OpenMP, as every TurnRL process does

from adapters import make_adapter, nbytes  # noqa: E402  (bench/ is on sys.path)
from engines import policy_and_source  # noqa: E402

ENGINE = {"type": "hf", "count": 1, "num_cpus": 0.5, "max_batch": 64}


class Tenant:
    """One tenant's rollout load: episodes through its adapter, ``in_flight`` at a time."""

    def __init__(self, engines: list[Any], policy: str, source: Any, adapter: Any, seed: int) -> None:
        import random

        from rollout.engines.client import AdapterClient, RayEngineClient

        self.client = AdapterClient(RayEngineClient(engines, policy), adapter)
        self.source, self.tasks, self.rng = source, source.tasks("train"), random.Random(seed)

    async def warm(self) -> float:
        """One episode first (the tokenizer loads, the env's index builds): seconds it took."""
        t0 = time.monotonic()
        await self.play(0.0, 1, 8)
        return time.monotonic() - t0

    async def play(self, seconds: float, in_flight: int, max_new: int) -> dict[str, float]:
        from rollout.engines.base import SamplingParams
        from rollout.episode import run_episode

        params = SamplingParams(temperature=1.0, max_new_tokens=max_new)
        deadline = time.monotonic() + seconds
        done = {"episodes": 0, "tokens": 0, "errors": 0}

        async def loop(i: int) -> None:
            while True:
                task = self.rng.choice(self.tasks)
                traj = await run_episode(self.client, self.source.make_env(), task, params, group_id=f"g{i}",
                                         max_context_tokens=1024)
                if time.monotonic() > deadline:  # only what finished inside the window counts
                    return
                done["episodes"] += 1
                done["errors"] += traj.error is not None
                done["tokens"] += sum(len(t.action_ids) for t in traj.turns)

        await asyncio.gather(*[loop(i) for i in range(in_flight)])
        return {k: float(v) for k, v in done.items()}


def uss_mb(pids: list[int]) -> float:
    import psutil

    return sum(psutil.Process(p).memory_full_info().uss for p in pids) / 2**20


def pid_of(actor: Any) -> int:
    import ray

    return ray.get(actor.__ray_call__.remote(lambda _: os.getpid()))


def load_adapters(engines: list[Any], policy: str, n: int, rank: int, first: int = 0) -> list[Any]:
    import ray

    from rollout.engines.base import AdapterSpec
    from rollout.engines.transport import ObjectStoreWeights

    specs = []
    for i in range(first, first + n):
        state, scale = make_adapter(policy, rank, i)
        spec = AdapterSpec(f"tenant-{i}", scale)
        ray.get([e.load.remote(1, ObjectStoreWeights.put(state), spec) for e in engines])
        specs.append(spec)
    return specs


def throughput(engines: list[Any], specs: list[Any], policy: str, source: Any, args: argparse.Namespace) -> list:
    import ray

    actor = ray.remote(num_cpus=0)(Tenant)
    tenants = [actor.remote(engines, policy, source, spec, i) for i, spec in enumerate(specs)]
    ray.get([t.warm.remote() for t in tenants])
    out = ray.get([t.play.remote(args.seconds, args.in_flight, args.max_new_tokens) for t in tenants])
    for t in tenants:
        ray.kill(t)
    return out


async def publish_times(engine: Any, policy: str, rank: int, versions: range) -> list[float]:
    """Seconds from a tenant's fresh version in hand to the engine serving it, per version
    (each newer than the last: an engine leaves a version not newer alone)."""

    from rollout.engines.base import AdapterSpec
    from rollout.engines.transport import ObjectStoreWeights

    state, scale = make_adapter(policy, rank, 99)
    spec, times = AdapterSpec("publisher", scale), []
    for version in versions:
        t0 = time.perf_counter()
        handle = ObjectStoreWeights.put(state)  # as the weight sync hands it over
        await engine.load.remote(version, handle, spec)
        times.append(time.perf_counter() - t0)
    return times


def alone_rate(policy: str, source: Any, args: argparse.Namespace) -> dict[str, float]:
    """One tenant on an engine of its own (a whole stack's, no gate): its window's counts."""
    import ray

    from rollout.config import HFEngineConfig
    from rollout.engines.server import EngineServer

    own = ray.remote(EngineServer).options(num_cpus=ENGINE["num_cpus"], max_concurrency=1024).remote(
        HFEngineConfig(**{k: v for k, v in ENGINE.items() if k != "type"}), policy, 0)
    ray.get(own.start.remote())
    got = throughput([own], load_adapters([own], policy, 1, args.rank), policy, source, args)[0]
    ray.kill(own)
    return got


def make_pool(policy: str, args: argparse.Namespace) -> tuple[Any, list[Any]]:
    import ray

    from cluster.config import PoolConfig
    from cluster.pool import start_pool

    pool = start_pool("bench", PoolConfig(model=policy, engine=ENGINE, max_adapters=max(args.tenants) + 16), policy)
    return pool, ray.get(pool.start.remote())["engines"]


def part1(policy: str, source: Any, engines: list[Any], args: argparse.Namespace) -> list[Any]:
    """Alone, the pool at each tenant count, alone again (the baseline is their mean: this
    machine's speed drifts over minutes). Returns the adapters loaded."""
    print(f"\n1. throughput ({args.seconds:.0f} s windows, {args.in_flight} episodes in flight per tenant, "
          f"{args.max_new_tokens} new tokens a turn)")
    print(f"{'setup':<20}{'samples/s':>10}{'tokens/s':>10}{'vs alone':>10}{'per tenant min/max':>20}{'errors':>8}")
    rows = [("alone (own engine)", [alone_rate(policy, source, args)])]
    specs: list[Any] = []
    for n in args.tenants:
        specs += load_adapters(engines, policy, n - len(specs), args.rank, first=len(specs))
        rows.append((f"pool, {n} tenant(s)", throughput(engines, specs[:n], policy, source, args)))
    rows.append(("alone, again", [alone_rate(policy, source, args)]))
    base = (rows[0][1][0]["episodes"] + rows[-1][1][0]["episodes"]) / 2 / args.seconds
    for label, got in rows:
        rate, per = sum(g["episodes"] for g in got) / args.seconds, [g["episodes"] for g in got]
        spread = f"{min(per):.0f}/{max(per):.0f}" if len(per) > 1 else ""
        print(f"{label:<20}{rate:>10.2f}{sum(g['tokens'] for g in got) / args.seconds:>10.0f}{rate / base:>10.2f}"
              f"{spread:>20}{sum(g['errors'] for g in got):>8.0f}")
    print(f"(vs alone: against the mean of the two alone windows, {base:.2f} samples/s)")
    return specs


def part2(policy: str, engines: list[Any], args: argparse.Namespace) -> None:

    from cluster.actors import start_actors
    from cluster.config import load_config

    per_adapter = _adapter_growth(engines, policy, args)
    sets = ["learner.lora={rank: %d, alpha: %d}" % (args.rank, 2 * args.rank), f"policy.path={policy}",
            "policy.sft.enabled=false", "eval.num_tasks=0", "progress=none", "learner.num_cpus=0.2",
            "rollout.engine.num_cpus=0.2", "cluster.reward_num_cpus=0.1", "cluster.replay_num_cpus=0.1"]
    sizes, roles = {}, {}
    for label, extra in (("whole stack", []), ("on the pool", ["rollout.pool=bench"])):
        cfg = load_config(None, [*sets, *extra])
        with tempfile.TemporaryDirectory() as run_dir:
            actors = start_actors(cfg, policy, run_dir, f"mem-{label.split()[0]}")
            try:
                named = {"engine": actors.engines if actors.pool is None else [], "learner": actors.learner.ranks,
                         "rollout": actors.rollouts, "reward": [actors.reward], "replay": [actors.replay],
                         "weight sync": [actors.weights]}
                roles[label] = {role: uss_mb([pid_of(a) for a in handles]) for role, handles in named.items()}
                sizes[label] = sum(roles[label].values())
            finally:
                actors.release()
    tenant = sizes["on the pool"] + per_adapter
    print("\n2. memory (USS of the run's actors, MB)")
    print(f"whole stack (own engine) {sizes['whole stack']:.0f}; the same run on the pool {sizes['on the pool']:.0f} "
          f"+ one adapter in the pool's engine {per_adapter:.1f} = {tenant:.0f}: a tenant adds "
          f"{tenant / sizes['whole stack']:.2f} of a whole stack; in the shared engine alone, "
          f"{per_adapter / (sizes['whole stack'] - sizes['on the pool']):.3f} of an engine")
    print("by actor: " + "; ".join(f"{role} {mb:.0f}" for role, mb in roles["whole stack"].items()))


def _adapter_growth(engines: list[Any], policy: str, args: argparse.Namespace) -> float:
    """MB one more adapter adds to the pool engine's process (the mean over eight)."""
    import ray

    pid = pid_of(engines[0])
    before = uss_mb([pid])
    load_adapters(engines, policy, 8, args.rank, first=1000)
    grown = (uss_mb([pid]) - before) / 8
    state, _ = make_adapter(policy, args.rank, 0)
    print(f"\n(a rank-{args.rank} adapter: {nbytes(state) / 2**20:.2f} MB of tensors; the engine grew "
          f"{grown:.2f} MB per adapter, mean of 8)")
    ray.get([e.remove_adapter.remote(f"tenant-{i}") for e in engines for i in range(1000, 1008)])
    return max(grown, nbytes(state) / 2**20)


def part3(policy: str, engines: list[Any], specs: list[Any], source: Any, args: argparse.Namespace) -> None:
    import ray

    n = args.repeats
    idle = asyncio.run(publish_times(engines[0], policy, args.rank, range(1, n + 1)))
    actor = ray.remote(num_cpus=0)(Tenant)
    tenants = [actor.remote(engines, policy, source, spec, i) for i, spec in enumerate(specs)]
    ray.get([t.warm.remote() for t in tenants])
    loads = [t.play.remote(n * 2.0 + 10, args.in_flight, args.max_new_tokens) for t in tenants]
    time.sleep(3.0)  # the tenants are decoding
    busy = asyncio.run(publish_times(engines[0], policy, args.rank, range(n + 1, 2 * n + 1)))
    ray.get(loads)
    print(f"\n3. adapter publish, rank {args.rank}, object store -> pool engine (ms, best / median of {args.repeats})")
    print(f"idle: {min(idle) * 1e3:.1f} / {statistics.median(idle) * 1e3:.1f}; while {len(specs)} tenants decode: "
          f"{min(busy) * 1e3:.1f} / {statistics.median(busy) * 1e3:.1f}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="tenants 1,2; 10 s windows; 3 repeats")
    p.add_argument("--model", choices=["tiny", "smollm2"], default="tiny")
    p.add_argument("--tenants", default="1,4,8", help="tenant counts on the pool, ascending")
    p.add_argument("--seconds", type=float, default=40.0)
    p.add_argument("--in-flight", type=int, default=4)
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--parts", default="1,2,3", help="which parts to run (3 alone: the publish latency)")
    args = p.parse_args()
    args.tenants = sorted(int(n) for n in args.tenants.split(","))
    if args.quick:
        args.tenants, args.seconds, args.repeats = [1, 2], 10.0, 3
    import ray

    from cluster.actors import job_env

    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    policy, source = policy_and_source(args.model, show_progress=False)
    ray.init(num_cpus=os.cpu_count(), include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": job_env()})
    t0, parts = time.perf_counter(), {int(n) for n in args.parts.split(",")}
    pool, engines = make_pool(policy, args)
    if 1 in parts:
        specs = part1(policy, source, engines, args)
    else:
        specs = load_adapters(engines, policy, max(args.tenants), args.rank)
    if 2 in parts:
        part2(policy, engines, args)
    if 3 in parts:
        part3(policy, engines, specs, source, args)
    ray.kill(pool)
    print(f"\n({time.perf_counter() - t0:.0f} s)")
    ray.shutdown()


if __name__ == "__main__":
    main()
