"""The control plane at scale, simulated on one machine: weight-sync fan-out against engine count,
and replay's admission and throughput against the number of rollout workers.

    .venv/bin/python bench/scale.py fanout [--engines 1,4,16,64,128,256]
        [--transports object_store,file,adapter,broadcast] [--broadcast-max 16] [--reps 3]
        [--params 135m] [--quick]
    .venv/bin/python bench/scale.py replay [--workers 1,8,64] [--backends inproc,redis]
        [--seconds 30] [--quick]
    .venv/bin/python bench/scale.py service [--runs 100] [--quick]

Engines are ``bench/synthetic_engine.py`` engines (no model; the engine contract; every byte of
a version read, none held) served by the real ``EngineServer``, one Ray actor each, so one
machine can host a few hundred. The run's own weight sync (``learner.weights.WeightSync`` as a
Ray actor, ``ActorWeightTarget`` per engine, as ``cluster.weight_sync`` starts it) pushes each
version, published by the learner's real publishers:

- ``object_store``: ``ObjectStorePublisher`` (numpy arrays in Ray's shared memory);
- ``file``: ``FilePublisher`` (a safetensors file in /dev/shm, every engine reads it);
- ``broadcast``: ``BroadcastPublisher`` (gloo here; bucketed; every engine a rank; torch in every
  engine process, ~165 MB each, so only up to ``--broadcast-max`` engines);
- ``adapter``: a LoRA adapter (rank 16 on q/v of every layer) through the object store, pushed
  as an adapter version (``EngineServer.load`` with an ``AdapterSpec``), as pool runs publish.

The payload is SmolLM2-135M's parameter set (134.5M float32 parameters, random; 538 MB;
``--params tiny``: 0.4M). After one untimed version (first-use costs), for each transport and engine count it prints the publish time (the
learner's side: put or write), the push time (the sync's ``publish``: until every engine has read
the version), the engines' own read time, and the bytes read per second by all engines; every
engine's checksum must equal the published state's. Engine counts grow in one Ray cluster (the
engines of a count stay for the next), and growth stops early when memory runs short.

``replay``: the run's replay host (``replay.host.ReplayHost`` as a Ray actor, as a run starts it,
in-process or Redis-backed with an embedded redis-server) and ``W`` producer actors doing what
a rollout worker does with it: ask admission for a group (``reserve_wait``), make the group (8
episodes of the demo's length, encoded in the producer as ``GroupRecord.of``) and put it. A
learner actor claims batches of 8 groups and acknowledges each with the next version at once
(no training time: replay's ceiling, not the learner's), which is what widens admission (eta
1). It prints groups/s through replay and the admission and put latencies against ``W``.

``service``: the run service (REST API under uvicorn, its registry, the local Ray head it
starts) takes ``--runs`` submissions over HTTP from one tenant with ``jobs.max_running: 1``: the
first run starts (a real one-step tiny run) and the others wait ``queued`` in the service. It
prints the latency of submit, list (every run in it), run detail and stop, one refresh of every
active run (what the service does each ``jobs.poll_s``), and the time until every run has ended.

What one machine cannot show: bytes crossing a network. On one node the object store maps one
copy into every engine, and the file is read from one page cache; docs/results/scale.md says
what a cluster of many nodes adds on paper.
"""

from __future__ import annotations

import argparse
import collections
import itertools
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import psutil

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run as a script from anywhere

SMOLLM2_135M = {"vocab": 49152, "hidden": 576, "layers": 30, "intermediate": 1536, "kv": 192}
TINY = {"vocab": 2048, "hidden": 64, "layers": 4, "intermediate": 256, "kv": 32}
MEMORY_FLOOR = 3 << 30
"""Start no more engines once less memory than this is available."""
_VERSIONS = itertools.count(1)
"""One counter for every push: an engine serves nothing older than it has."""


def llama_state(d: dict[str, int], seed: int = 0) -> dict[str, Any]:
    """A Llama state dict of the shapes ``d`` gives (tied embeddings: no separate head), random."""
    import torch

    g = torch.Generator().manual_seed(seed)
    h, kv, ff = d["hidden"], d["kv"], d["intermediate"]
    shapes = {"model.embed_tokens.weight": (d["vocab"], h), "model.norm.weight": (h,)}
    for i in range(d["layers"]):
        p = f"model.layers.{i}."
        shapes |= {p + "self_attn.q_proj.weight": (h, h), p + "self_attn.k_proj.weight": (kv, h),
                   p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.o_proj.weight": (h, h),
                   p + "mlp.gate_proj.weight": (ff, h), p + "mlp.up_proj.weight": (ff, h),
                   p + "mlp.down_proj.weight": (h, ff), p + "input_layernorm.weight": (h,),
                   p + "post_attention_layernorm.weight": (h,)}
    return {k: torch.randn(s, generator=g) for k, s in shapes.items()}


def lora_state(d: dict[str, int], rank: int = 16, seed: int = 1) -> dict[str, Any]:
    """A LoRA adapter on every layer's q and v projections."""
    import torch

    g = torch.Generator().manual_seed(seed)
    out = {}
    for i in range(d["layers"]):
        for proj, width in (("q_proj", d["hidden"]), ("v_proj", d["kv"])):
            p = f"model.layers.{i}.self_attn.{proj}."
            out[p + "lora_A.weight"] = torch.randn(rank, d["hidden"], generator=g)
            out[p + "lora_B.weight"] = torch.randn(width, rank, generator=g)
    return out


def checksum(state: dict[str, Any]) -> float:
    return float(sum(float(t.double().sum()) for t in state.values()))


def start_ray() -> None:
    import ray

    from cluster.actors import job_env

    path = os.pathsep.join([str(ROOT), str(ROOT / "bench"), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {**job_env(), "PYTHONPATH": path}})


def grow(engines: list[Any], n: int, rate: float) -> float:
    """Start engine actors until there are ``n``; returns the seconds it took (inf: memory ran
    short first)."""
    import ray

    from rollout.engines.server import EngineServer
    from synthetic_engine import SyntheticEngine

    cls = ray.remote(EngineServer)
    t0 = time.perf_counter()
    while len(engines) < n:
        if psutil.virtual_memory().available < MEMORY_FLOOR:
            return float("inf")
        batch = [cls.options(num_cpus=0, max_concurrency=64).remote(None, "", engine=SyntheticEngine(rate, seed=k))
                 for k in range(len(engines), min(n, len(engines) + 16))]
        ray.get([e.version.remote() for e in batch], timeout=600)
        engines += batch
    return time.perf_counter() - t0


def publisher_for(transport: str, n: int, engines: list[Any], tmp: str) -> Any:
    import ray

    from learner.weights import BroadcastPublisher, FilePublisher, ObjectStorePublisher

    if transport == "file":
        return FilePublisher(tmp)
    if transport != "broadcast":
        return ObjectStorePublisher()
    pub = BroadcastPublisher(n, bucket_mib=256, timeout_s=600)
    joining = threading.Thread(target=pub.join)
    joining.start()
    ray.get([e.join_weight_group.remote({**pub.init, "rank": i + 1}) for i, e in enumerate(engines[:n])], timeout=600)
    joining.join()
    return pub


def fanout(transport: str, engines: list[Any], state: dict[str, Any], reps: int, tmp: str) -> dict[str, Any]:
    """``reps`` versions pushed to every engine in ``engines``; medians and the checks."""
    import ray

    from cluster.weight_sync import ActorWeightTarget
    from learner.weights import WeightSync
    from rollout.engines.base import AdapterSpec

    adapter = AdapterSpec("tenant-a", 2.0) if transport == "adapter" else None
    sync = ray.remote(WeightSync).options(num_cpus=0).remote([ActorWeightTarget(e, False, adapter) for e in engines])
    pub = publisher_for(transport, len(engines), engines, tmp)
    ray.get(sync.stats.remote())  # started: its start is not the push's
    served = ray.get(sync.publish.remote(version := next(_VERSIONS), pub.publish(version, state)), timeout=1800)
    assert served == version, f"{transport}: the sync served {served}, not {version}"  # the first, untimed
    before = ray.get([e.stats.remote() for e in engines])
    puts, pushes = [], []
    for _ in range(reps):
        version = next(_VERSIONS)
        t0 = time.perf_counter()
        handle = pub.publish(version, state)
        t1 = time.perf_counter()
        served = ray.get(sync.publish.remote(version, handle), timeout=1800)
        pushes.append(time.perf_counter() - t1)
        puts.append(t1 - t0)
        assert served == version, f"{transport}: the sync served {served}, not {version}"
    after = ray.get([e.stats.remote() for e in engines])
    ray.kill(sync)
    want = checksum(state)
    wrong = [i for i, s in enumerate(after) if abs(s["checksum"] - want) > 1e-6 * max(1.0, abs(want))]
    read_s = [(a["load_s"] - b["load_s"]) / reps for a, b in zip(after, before)]
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    push = statistics.median(pushes)
    return {"transport": transport, "engines": len(engines), "publish_s": statistics.median(puts), "push_s": push,
            "engine_read_s": statistics.fmean(read_s), "engine_read_max_s": max(read_s),
            "gb_per_s": len(engines) * nbytes / push / 1e9, "bytes": nbytes, "checksum_wrong": len(wrong)}


def print_rows(rows: list[dict[str, Any]]) -> None:
    head = f"{'transport':<13}{'engines':>8}{'publish s':>11}{'push s':>10}{'per engine ms':>15}" \
           f"{'engine read s':>15}{'GB/s read':>11}{'bad sums':>10}"
    print("\n" + head)
    for r in rows:
        print(f"{r['transport']:<13}{r['engines']:>8}{r['publish_s']:>11.3f}{r['push_s']:>10.3f}"
              f"{1e3 * r['push_s'] / r['engines']:>15.2f}{r['engine_read_s']:>15.3f}{r['gb_per_s']:>11.2f}"
              f"{r['checksum_wrong']:>10}")


def run_fanout(args: argparse.Namespace) -> int:
    import ray
    import torch

    torch.set_num_threads(1)
    dims = TINY if args.params == "tiny" else SMOLLM2_135M
    state, adapter = llama_state(dims), lora_state(dims)
    print(f"payload: {sum(t.numel() for t in state.values()) / 1e6:.1f}M parameters "
          f"({sum(t.numel() * 4 for t in state.values()) / 2**20:.0f} MiB); adapter "
          f"{sum(t.numel() for t in adapter.values()) / 1e6:.2f}M (load {os.getloadavg()[0]:.2f})", flush=True)
    start_ray()
    engines: list[Any] = []
    rows, started = [], {}
    counts = [int(x) for x in args.engines.split(",")]
    transports = args.transports.split(",")
    with tempfile.TemporaryDirectory(dir="/dev/shm" if Path("/dev/shm").is_dir() else None) as tmp:
        for k, n in enumerate(counts):
            started[n] = grow(engines, n, args.rate)
            if started[n] == float("inf"):
                print(f"stopped at {len(engines)} engines: less than {MEMORY_FLOOR >> 30} GiB of memory left")
                break
            print(f"[{k + 1}/{len(counts)}] {n} engines up ({started[n]:.1f} s to start the new ones; "
                  f"load {os.getloadavg()[0]:.2f}; {psutil.virtual_memory().available / 2**30:.1f} GiB free)", flush=True)
            for t in transports:
                if t == "broadcast" and n > args.broadcast_max:
                    continue
                rows.append(fanout(t, engines, adapter if t == "adapter" else state, args.reps, tmp))
                print_rows(rows[-1:])
    ray.shutdown()
    print_rows(rows)
    print(f"\nengine start (s, the new ones): {started}")
    bad = sum(r["checksum_wrong"] for r in rows)
    print("every engine read every version it was pushed" if not bad else f"{bad} engine reads did not match")
    return 1 if bad else 0


BATCH_GROUPS = 8


def demo_group(producer: str, k: int, version: int) -> Any:
    """A group as a rollout worker makes it: 8 episodes of a 300-token prompt and 3 turns,
    sampled with weights ``version``."""
    import random

    from rollout.trajectory import Group, Trajectory, Turn

    rng = random.Random(k)
    ids = lambda n: [rng.randrange(5, 49152) for _ in range(n)]  # noqa: E731
    trajs = [Trajectory(trajectory_id=f"{producer}-{k}-{r}", task_id=f"t{k}", group_id=f"{producer}-{k}",
                        prompt_ids=ids(300), producer=producer, outcome=float(r % 2),
                        turns=[Turn(action_ids=ids(40), action_logprobs=[-1.0] * 40, policy_version=version,
                                    observation_ids=ids(60)) for _ in range(3)]) for r in range(8)]
    return Group(group_id=f"{producer}-{k}", task_id=f"t{k}", trajectories=trajs)


class Board:
    """The version engines serve, as the learner last published it (a run's weight sync)."""

    def __init__(self) -> None:
        self.version = 0

    def set(self, version: int) -> None:
        self.version = version

    def get(self) -> int:
        return self.version


class Producer:
    """A rollout worker's side of replay: admission, then the group put (its episodes sampled
    with the version the board shows, as engines stamp the version they serve)."""

    def __init__(self, replay: Any, board: Any, name: str) -> None:
        self.replay, self.board, self.name = replay, board, name

    def run(self, seconds: float) -> dict[str, Any]:
        import ray

        from replay.record import GroupRecord

        reserve, put, k = [], [], 0
        stop = time.perf_counter() + seconds
        while time.perf_counter() < stop:
            t0 = time.perf_counter()
            granted = ray.get(self.replay.reserve_wait.remote(1, self.name, 1.0))
            reserve.append(time.perf_counter() - t0)
            if not granted:
                continue
            record = GroupRecord.of(demo_group(self.name, k, ray.get(self.board.get.remote())))
            t1 = time.perf_counter()
            ray.get(self.replay.put_many.remote([record]))
            put.append(time.perf_counter() - t1)
            k += 1
        return {"groups": k, "reserve_s": reserve, "put_s": put}


class Learner:
    """Claims batches and acknowledges each at once with the next version."""

    def __init__(self, replay: Any, board: Any) -> None:
        self.replay, self.board = replay, board

    def run(self, seconds: float) -> dict[str, Any]:
        import ray

        version, groups, stop = 0, 0, time.perf_counter() + seconds
        while time.perf_counter() < stop:
            claim = ray.get(self.replay.claim_wait.remote(BATCH_GROUPS, None, 1.0))
            if claim is None:
                continue
            version += 1
            ray.get(self.replay.ack.remote(claim.claim_id, version, True))
            ray.get(self.board.set.remote(version))
            groups += len(claim.groups)
        return {"groups": groups, "versions": version}


def replay_round(backend: str, workers: int, seconds: float, tmp: str) -> dict[str, Any]:
    import ray

    from replay.config import ReplayConfig
    from replay.host import ACTOR_THREADS, ReplayHost

    cfg = ReplayConfig(type=backend, eta=1, capacity_groups=max(64, 4 * BATCH_GROUPS))
    run_dir = tempfile.mkdtemp(dir=tmp)
    host = ray.remote(ReplayHost).options(num_cpus=0, max_concurrency=ACTOR_THREADS + workers).remote(
        cfg, BATCH_GROUPS, run_dir, f"scale-{backend}-{workers}")
    ray.get(host.stats.remote())
    board = ray.remote(Board).options(num_cpus=0).remote()
    producers = [ray.remote(Producer).options(num_cpus=0).remote(host, board, f"rollout-{i}") for i in range(workers)]
    learner = ray.remote(Learner).options(num_cpus=0).remote(host, board)
    t0 = time.perf_counter()
    done = ray.get([learner.run.remote(seconds), *[p.run.remote(seconds) for p in producers]], timeout=seconds + 600)
    elapsed = time.perf_counter() - t0
    stats = ray.get(host.stats.remote())
    ray.get(host.close.remote())
    for actor in (host, learner, board, *producers):
        ray.kill(actor)
    trained, made = done[0], done[1:]
    reserve = [x for d in made for x in d["reserve_s"]]
    put = [x for d in made for x in d["put_s"]]
    q = lambda xs, k: 1e3 * statistics.quantiles(xs, n=100)[k - 1] if len(xs) > 1 else float("nan")  # noqa: E731
    return {"backend": backend, "workers": workers, "trained_per_s": trained["groups"] / elapsed,
            "put_per_s": sum(d["groups"] for d in made) / elapsed, "versions": trained["versions"],
            "reserve_p50_ms": q(reserve, 50), "reserve_p99_ms": q(reserve, 99),
            "put_p50_ms": q(put, 50), "put_p99_ms": q(put, 99),
            "refused": dict(stats.refused), "evicted": dict(stats.evicted)}


def run_replay(args: argparse.Namespace) -> int:
    import ray

    start_ray()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for backend in args.backends.split(","):
            for w in (int(x) for x in args.workers.split(",")):
                print(f"{backend}, {w} workers (load {os.getloadavg()[0]:.2f})", flush=True)
                rows.append(replay_round(backend, w, args.seconds, tmp))
    ray.shutdown()
    print(f"\n{'backend':<9}{'workers':>8}{'trained/s':>11}{'put/s':>9}{'versions':>10}"
          f"{'reserve p50 ms':>16}{'p99':>9}{'put p50 ms':>12}{'p99':>9}")
    for r in rows:
        print(f"{r['backend']:<9}{r['workers']:>8}{r['trained_per_s']:>11.1f}{r['put_per_s']:>9.1f}{r['versions']:>10}"
              f"{r['reserve_p50_ms']:>16.1f}{r['reserve_p99_ms']:>9.1f}{r['put_p50_ms']:>12.1f}{r['put_p99_ms']:>9.1f}"
              f"  refused {r['refused']} evicted {r['evicted']}")
    return 0 if all(r["versions"] > 0 for r in rows) else 1


def _ms(xs: list[float]) -> str:
    q = statistics.quantiles(xs, n=100) if len(xs) > 1 else xs * 99
    return f"{1e3 * q[49]:.1f} / {1e3 * q[98]:.1f}"


def run_service(args: argparse.Namespace) -> int:
    import uvicorn

    from services.api import create_app
    from services.config import ServiceConfig
    from services.ray_cluster import LocalRayHead, free_port
    from services.server import build_state

    token = "bench-token-0123456789"
    with tempfile.TemporaryDirectory() as tmp:
        cfg = ServiceConfig(state_dir=tmp, ray={"local": {"num_cpus": 2}}, jobs={"max_running": 1},
                            limits={"max_concurrent_runs": args.runs})
        state = build_state(cfg, {"TURNRL_SERVICE_TOKENS": f"bench={token}"})
        port = free_port()
        server = uvicorn.Server(uvicorn.Config(create_app(state), host="127.0.0.1", port=port, log_level="warning"))
        threading.Thread(target=server.run, daemon=True).start()
        while not server.started:
            time.sleep(0.05)
        try:
            out = _service_calls(f"http://127.0.0.1:{port}", token, args.runs, state.manager)
        finally:
            server.should_exit = True
            state.manager.registry.close()
            LocalRayHead(cfg.ray.local, cfg.state_path()).stop()
    print(f"\n{args.runs} runs from one tenant, jobs.max_running 1; load {os.getloadavg()[0]:.2f}")
    print(f"{'call':<36}{'p50 / p99 ms':>18}")
    for name in ("submit", "list (every run)", "detail", "stop"):
        print(f"{name:<36}{_ms(out[name]):>18}")
    print(f"{'refresh every active run (one poll)':<36}{1e3 * out['refresh']:>15.1f} ms")
    print(f"statuses after submit: {out['submitted']}; {out['ended_s']:.1f} s after the stops: {out['ended']}")
    want = {"queued": args.runs - 1}
    return 0 if {k: v for k, v in out["submitted"].items() if k == "queued"} == want \
        and out["ended"] == {"stopped": args.runs} else 1


def _service_calls(url: str, token: str, runs: int, manager: Any) -> dict[str, Any]:
    import httpx

    out: dict[str, Any] = {k: [] for k in ("submit", "list (every run)", "detail", "stop")}
    with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {token}"}, timeout=300) as http:
        ids = []
        for i in range(runs):
            t0 = time.perf_counter()
            res = http.post("/v1/runs", json={"name": f"r{i}", "train": {"steps": 1}, "eval": {"num_tasks": 0}})
            out["submit"].append(time.perf_counter() - t0)
            ids.append(res.raise_for_status().json()["id"])
        t0 = time.perf_counter()
        manager.reconcile()
        out["refresh"] = time.perf_counter() - t0
        for _ in range(20):
            t0 = time.perf_counter()
            listed = http.get("/v1/runs").raise_for_status().json()["runs"]
            out["list (every run)"].append(time.perf_counter() - t0)
        out["submitted"] = dict(collections.Counter(r["status"] for r in listed))
        for rid in ids:
            t0 = time.perf_counter()
            http.get(f"/v1/runs/{rid}").raise_for_status()
            out["detail"].append(time.perf_counter() - t0)
        for rid in reversed(ids):  # the queued ones first: none of them may start meanwhile
            t0 = time.perf_counter()
            http.post(f"/v1/runs/{rid}/stop").raise_for_status()
            out["stop"].append(time.perf_counter() - t0)
        t0, deadline = time.perf_counter(), time.monotonic() + 600
        while True:
            manager.reconcile()
            statuses = collections.Counter(r["status"] for r in http.get("/v1/runs").json()["runs"])
            if set(statuses) <= {"stopped", "succeeded", "failed", "lost"} or time.monotonic() > deadline:
                break
            time.sleep(1.0)
        out["ended"], out["ended_s"] = dict(statuses), time.perf_counter() - t0
    return out


def main() -> int:
    from bench.offline_env import use_offline_env

    use_offline_env()
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="action", required=True)
    f = sub.add_parser("fanout", help="weight-sync publish fan-out against engine count")
    f.add_argument("--engines", default="1,4,16,64,128,256", help="engine counts, ascending")
    f.add_argument("--transports", default="object_store,file,adapter,broadcast")
    f.add_argument("--broadcast-max", type=int, default=16, help="most engines on the broadcast transport")
    f.add_argument("--reps", type=int, default=3, help="versions pushed per measurement (median)")
    f.add_argument("--params", choices=("135m", "tiny"), default="135m")
    f.add_argument("--rate", type=float, default=50.0, help="synthetic tokens/s per request")
    f.add_argument("--quick", action="store_true", help="tiny payload, 1 and 4 engines, 2 versions (the test)")
    r = sub.add_parser("replay", help="replay admission and throughput against rollout workers")
    r.add_argument("--workers", default="1,8,64", help="producer (rollout worker) counts")
    r.add_argument("--backends", default="inproc,redis")
    r.add_argument("--seconds", type=float, default=30.0, help="length of each round")
    r.add_argument("--quick", action="store_true", help="1 and 4 workers in process, 5 s (the test)")
    v = sub.add_parser("service", help="the run service with many runs submitted, queued and listed")
    v.add_argument("--runs", type=int, default=100)
    v.add_argument("--quick", action="store_true", help="5 runs (the test)")
    args = p.parse_args()
    if args.action == "service":
        args.runs = 5 if args.quick else args.runs
        return run_service(args)
    if args.action == "replay":
        if args.quick:
            args.workers, args.backends, args.seconds = "1,4", "inproc", 5.0
        return run_replay(args)
    if args.quick:
        args.engines, args.params, args.reps = "1,4", "tiny", 2
    return run_fanout(args)


if __name__ == "__main__":
    sys.exit(main())
