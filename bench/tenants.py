"""Many LoRA runs on one engine pool against one run alone, side by side in one run, on Ray.

    .venv/bin/python bench/tenants.py [--quick] [--model tiny|smollm2] [--tenants 1,4,8]
                                      [--control 4] [--pool-engines 1] [--seconds 90] [--warm-steps 2] [--rank 16]
                                      [--repeats 5] [--parts 1,2,3] [--engine-cores 0] [--pool-learner]
                                      [--out DIR]

The bench starts a Ray cluster of its own (the run service's local head, in a temporary
directory) and
runs whole LoRA runs in it: each is ``turnrl train``, a job driver of its own with its own
rollout worker, rewards, replay, learner and weight sync, training a rank ``--rank`` adapter
until the bench stops it (SIGTERM: it checkpoints and detaches, as a stopped run does).

1. **Throughput and memory.** *Alone*: one LoRA run with an engine of its own (the pool's
   engine settings as its ``rollout.engine``): a whole stack. *Pool, N*: N LoRA runs naming one
   pool (``rollout.pool``; ``cluster.pool``, held by the bench), started 1, then up to each
   count in ``--tenants``. Samples the runs' learners trained per second over a ``--seconds``
   window that opens once every run has trained ``--warm-steps`` steps (each run's cumulative
   samples interpolated between its steps' arrival times); the ratio aggregate samples/s with
   N runs / samples/s of the run alone, against the mean of an alone window first and last
   (goal >= 0.9: sharing costs at most 10%). *Own engines, N* (``--control``): N whole stacks
   side by side, so that a pool of N runs is also compared with N runs on the same cores that
   share nothing (on a few cores N learners contend whatever the engines do). Memory: unique memory (USS) of each run's
   processes (its driver and every actor of its job) at its window's end, plus a tenant's share
   of what the pool's engines grew by since the pool started; a tenant against the whole stack
   (goal <= 10%). Each window also prints the cores each role kept busy and its CPU
   milliseconds per trained sample (where sharing's cost goes).
With ``--pool-learner`` the pool has a learner (``PoolConfig.learner``) and its runs set
``learner.on_pool``: one process trains every run's adapter, a run keeps no learner of its own,
and the learner's growth counts with the engine's in what a tenant adds.
With ``--engine-cores``, every engine (a run's own and the pool's) runs on those cores and
everything else (drivers, learners, rollout workers, services, Ray's daemons) on the others, as
on a cluster where inference has accelerators of its own: sharing is then measured without the
engines' share of contended cores changing with their count.
2. **Adapter publish.** A rank ``--rank`` adapter version into the pool's engine (Ray's object
   store, ``EngineServer.load``, as a run's weight sync hands it over), end to end, best and
   median of ``--repeats``: idle, and while the largest count of runs trains on the pool (goal
   <= 50 ms).
3. **Fused step** (``--parts 3``, ``pool_fused.py``): the pool learner's step of 4 tenants' LoRA
   adapters through one base pass against their 4 steps one after another (goal >= 1.3x).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from bisect import bisect_right
from pathlib import Path
from typing import Any, Mapping

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run as a script from anywhere

from rollout.cores import apply_thread_policy  # noqa: E402

apply_thread_policy()  # before torch loads OpenMP, as every TurnRL process does

from adapters import make_adapter  # noqa: E402  (bench/ is on sys.path)
from engines import policy_and_source  # noqa: E402

ENGINE = {"type": "hf", "count": 1, "num_cpus": 0.5, "max_batch": 64}
TINY_RUN = ["env.num_entities=80", "env.num_train_tasks=300", "env.num_heldout_tasks=40",  # the policy's world
            "rollout.group_size=8", "rollout.groups_in_flight=4", "rollout.max_new_tokens=32",
            "learner.batch_groups=2", "learner.lr=2e-3", "learner.zero_stage=1"]
SMOLLM2_RUN = ["rollout.group_size=4", "rollout.groups_in_flight=2", "learner.batch_groups=1",
               "learner.micro_batch_size=8", "learner.lr=1e-5"]


class Cluster:
    """A Ray head of the bench's own (the run service's ``LocalRayHead``: a fresh temp dir, free
    ports, and a stop that ends exactly its processes); runs join it as job drivers."""

    def __init__(self, cpus: int, state_dir: Path) -> None:
        from services.config import LocalRayConfig
        from services.ray_cluster import LocalRayHead

        self.head = LocalRayHead(LocalRayConfig(num_cpus=cpus), state_dir)
        self.address = self.head.start()["gcs_address"]
        self.env = self.head.child_env({**os.environ, "RAY_ADDRESS": self.address})

    def stop(self) -> None:
        self.head.stop()


class Run:
    """One LoRA run, ``turnrl train`` as a job driver of its own on the bench's cluster; its
    learner's cumulative trained samples by the time each step's metrics line arrived."""

    def __init__(self, name: str, config: list[str], sets: list[str], cluster: Cluster, out: Path) -> None:
        self.name, self.dir = name, out / name
        self.log = out / f"{name}.log"
        argv = [sys.executable, "-m", "cluster.cli", "train", *config,
                *(x for s in [*sets, f"name={name}", f"output_dir={out}"] for x in ("--set", s))]
        with self.log.open("w") as log:
            self.proc = subprocess.Popen(argv, cwd=ROOT, env=cluster.env, stdout=log, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL)
        self.times: list[float] = []
        self.samples: list[float] = []
        self._read = 0

    def poll(self) -> None:
        if self.proc.poll() is not None:
            tail = self.log.read_text()[-3000:]
            raise RuntimeError(f"run {self.name} ended (rc {self.proc.returncode}) before the bench stopped it:\n{tail}")
        path = self.dir / "metrics.jsonl"
        if not path.exists():
            return
        text = path.read_text()
        lines = text[:text.rfind("\n") + 1].splitlines()  # whole lines: the driver may be writing one
        now = time.monotonic()
        for line in lines[self._read:]:
            self.times.append(now)
            self.samples.append((self.samples[-1] if self.samples else 0.0) + json.loads(line).get("samples", 0.0))
        self._read = len(lines)

    def samples_at(self, t: float) -> float:
        """Cumulative samples at ``t``, linear between the two steps around it."""
        i = bisect_right(self.times, t)
        if i == 0 or i == len(self.times):
            raise ValueError(f"run {self.name}: no step on both sides of {t}")
        (t0, t1), (s0, s1) = self.times[i - 1:i + 1], self.samples[i - 1:i + 1]
        return s0 + (s1 - s0) * (t - t0) / (t1 - t0)

def stop_all(runs: list[Run]) -> None:
    """SIGTERM to every run at once (each checkpoints, detaches from the pool and releases its
    actors, as a stopped run does); SIGKILL to any still there after two minutes."""
    for run in runs:
        if run.proc.poll() is None:
            run.proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + 120
    for run in runs:
        try:
            run.proc.wait(timeout=max(deadline - time.monotonic(), 1))
        except subprocess.TimeoutExpired:
            run.proc.kill()
            run.proc.wait()


def wait_steps(runs: list[Run], steps: int, timeout_s: float = 900.0) -> None:
    t0 = time.monotonic()
    while True:
        for r in runs:
            r.poll()
        behind = [r for r in runs if len(r.times) < steps]
        if not behind:
            return
        if time.monotonic() - t0 > timeout_s:
            raise TimeoutError(f"runs {[r.name for r in behind]} trained < {steps} steps in {timeout_s:.0f} s")
        time.sleep(0.5)


def window(runs: list[Run], seconds: float, warm_steps: int, shared: Mapping[str, list[int]] | None = None
           ) -> list[float]:
    """Samples/s of each run over a window of ``seconds`` once each has ``warm_steps`` steps;
    prints where the CPU went meanwhile (``shared``: a pool's processes by role)."""
    print(f"  waiting for {len(runs)} run(s) to train {warm_steps} step(s) ...", flush=True)
    wait_steps(runs, warm_steps)
    t0, cpu0 = time.monotonic(), cpu_seconds(runs, shared or {})
    print(f"  window open ({seconds:.0f} s)", flush=True)
    while time.monotonic() < t0 + seconds:
        for r in runs:
            r.poll()
        time.sleep(0.5)
    t1, cpu1 = time.monotonic(), cpu_seconds(runs, shared or {})
    while any(r.times[-1] <= t1 for r in runs):  # a step after the window to interpolate to
        for r in runs:
            r.poll()
        time.sleep(0.5)
    rates = [(r.samples_at(t1) - r.samples_at(t0)) / (t1 - t0) for r in runs]
    print(f"  CPU: {cpu_split(cpu0, cpu1, t1 - t0, sum(rates) * (t1 - t0))}", flush=True)
    return rates


def uss_mb(pids: list[int]) -> float:
    import psutil

    return sum(psutil.Process(p).memory_full_info().uss for p in pids) / 2**20


def run_processes(runs: list[Run]) -> dict[str, dict[str, list[int]]]:
    """Each run's processes by role: its driver and its job's live actors (by class). Ray's
    public state API needs the dashboard, which the bench's cluster leaves out; its GCS tables
    answer."""
    from ray._private import state

    jobs = {j["DriverPid"]: j["JobID"] for j in state.state.job_table() if not j["IsDead"]}
    actors = [a for a in state.actors().values() if a["State"] == "ALIVE"]
    out: dict[str, dict[str, list[int]]] = {}
    for r in runs:
        roles: dict[str, list[int]] = {"driver": [r.proc.pid]}
        for a in actors:
            if a["JobID"] == jobs.get(r.proc.pid):
                roles.setdefault(a["ActorClassName"], []).append(a["Pid"])
        out[r.name] = roles
    return out


def run_memory(runs: list[Run]) -> dict[str, dict[str, float]]:
    """USS (MB) of each run's processes by role."""
    return {name: {role: uss_mb(pids) for role, pids in roles.items()}
            for name, roles in run_processes(runs).items()}


def cpu_seconds(runs: list[Run], shared: Mapping[str, list[int]]) -> dict[str, float]:
    """CPU seconds (user + system) each role's processes have used so far, summed over the
    runs; ``shared``: a pool's processes by role (a run's own engine is one of its actors)."""
    import psutil

    def used(pid: int) -> float:
        try:
            t = psutil.Process(pid).cpu_times()
        except psutil.NoSuchProcess:
            return 0.0
        return t.user + t.system

    machine = psutil.cpu_times()
    out = {role: sum(map(used, pids)) for role, pids in shared.items()}
    for roles in run_processes(runs).values():
        for role, pids in roles.items():
            out[role] = out.get(role, 0.0) + sum(map(used, pids))
    # What no run's process used: Ray's daemons, the bench, the pool's own actor, the system.
    out["rest of the machine"] = machine.user + machine.system + machine.nice - sum(out.values())
    return out


def cpu_split(before: dict[str, float], after: dict[str, float], seconds: float, samples: float) -> str:
    """Cores each role kept busy over a window and its CPU milliseconds per trained sample."""
    used = {role: after[role] - before.get(role, 0.0) for role in after}
    rows = sorted(used.items(), key=lambda kv: -kv[1])
    return "; ".join(f"{role} {s / seconds:.2f} cores ({s / max(samples, 1e-9) * 1e3:.0f} ms/sample)"
                     for role, s in rows) + f"; all {sum(used.values()) / seconds:.2f} cores"


def by_role(roles: dict[str, float]) -> str:
    return "; ".join(f"{role} {mb:.0f}" for role, mb in sorted(roles.items(), key=lambda kv: -kv[1]))


def pid_of(actor: Any) -> int:
    import ray

    return ray.get(actor.__ray_call__.remote(lambda _: os.getpid()))


def engine_cfg(args: argparse.Namespace, count: int = 1) -> dict[str, Any]:
    """The engines' settings: a run alone's ``rollout.engine`` and the pool's (``count`` of them)."""
    cores = {"cpu_affinity": args.engine_cores, "torch_threads": len(args.engine_cores)} if args.engine_cores else {}
    return {**ENGINE, "count": count, **cores}


def split_cores(spec: str) -> list[int]:
    """``--engine-cores``: the engines' cores; the bench and everything it starts move to the
    others (an engine pins itself to its ``cpu_affinity`` once started)."""
    if not spec:
        return []
    engines, allowed = sorted({int(c) for c in spec.split(",")}), os.sched_getaffinity(0)
    rest = sorted(allowed - set(engines))
    if not set(engines) <= allowed or not rest:
        raise SystemExit(f"--engine-cores {spec}: name some of this process's cores {sorted(allowed)}, not all")
    os.sched_setaffinity(0, rest)  # before Ray's head starts: its daemons and workers inherit it
    return engines


def run_args(policy: str, args: argparse.Namespace) -> tuple[list[str], list[str]]:
    """A LoRA run of ``--model`` on ``policy`` that trains until stopped: (config, overrides)."""
    config, own = ([], TINY_RUN) if args.model == "tiny" else ([str(ROOT / "configs/smollm2_search_qa.yaml")],
                                                              SMOLLM2_RUN)
    return config, [*own, f"policy.path={policy}", "policy.sft.enabled=false",
            "learner.lora={rank: %d, alpha: %d}" % (args.rank, 2 * args.rank), "eval.num_tasks=0",
            "progress=log", "train.steps=1000000", f"rollout.engine={json.dumps(engine_cfg(args))}"]


def own_engines(policy: str, cluster: Cluster, out: Path, args: argparse.Namespace, n: int,
                label: str) -> dict[str, Any]:
    """``n`` LoRA runs, each with an engine of its own (whole stacks side by side): their
    samples/s and the USS of each whole stack (the mean)."""
    print(f"{label}: {n} LoRA run(s), each with its own engine", flush=True)
    config, sets = run_args(policy, args)
    runs = [Run(f"own-{label.split()[-1]}-{i}", config, sets, cluster, out) for i in range(n)]
    try:
        rates = window(runs, args.seconds, args.warm_steps)
        memory = run_memory(runs)
    finally:
        stop_all(runs)
    first = memory[runs[0].name]
    row = {"rates": rates, "mb": statistics.mean(sum(roles.values()) for roles in memory.values()), "shared": 0.0}
    print(f"  {sum(rates):.2f} samples/s; a whole stack {row['mb']:.0f} MB (the first: {by_role(first)})", flush=True)
    return row


def on_pool(policy: str, cluster: Cluster, out: Path, args: argparse.Namespace, shared: dict[str, list[int]],
            runs: list[Run], n: int) -> dict[str, Any]:
    """Grow ``runs`` (LoRA runs naming the pool) to ``n``; their samples/s and memory, and the
    growth of the pool's processes (``shared``: engines, then its learner) since it started."""
    print(f"pool, {n} run(s): starting {n - len(runs)} more", flush=True)
    config, sets = run_args(policy, args)
    on = [*sets, "rollout.pool=bench", *(["learner.on_pool=true"] if args.pool_learner else [])]
    runs += [Run(f"tenant-{i}", config, on, cluster, out) for i in range(len(runs), n)]
    rates = window(runs, args.seconds, args.warm_steps, shared)
    memory = run_memory(runs)
    grown = uss_mb([pid for pids in shared.values() for pid in pids]) - args.shared_mb
    row = {"rates": rates, "mb": statistics.mean(sum(roles.values()) for roles in memory.values()),
           "shared": max(grown, 0.0) / n}
    what = "engine and learner" if args.pool_learner else "engine"
    print(f"  {sum(rates):.2f} samples/s together (per run {min(rates):.2f}-{max(rates):.2f}); a run's own "
          f"processes {row['mb']:.0f} MB (the first: {by_role(memory[runs[0].name])}), the pool's {what} grew "
          f"{grown:.0f} MB", flush=True)
    return row


def report(rows: list[tuple[str, dict[str, Any]]], seconds: float) -> None:
    """``rows``: (label, measurement), the first and last one run alone (the baseline is their
    mean: this machine's speed drifts over minutes)."""
    first, last = rows[0][1], rows[-1][1]
    base, whole = (sum(first["rates"]) + sum(last["rates"])) / 2, (first["mb"] + last["mb"]) / 2
    own = {len(m["rates"]): sum(m["rates"]) for label, m in rows[1:-1] if label.startswith("own")}
    print(f"\n1. whole LoRA runs ({seconds:.0f} s windows; samples the learners trained)")
    print(f"{'setup':<22}{'samples/s':>10}{'vs alone':>10}{'vs own N':>10}{'per run min/max':>17}"
          f"{'MB per run':>12}{'vs stack':>10}")
    for label, m in rows:
        rates, mb, n = m["rates"], m["mb"] + m["shared"], len(m["rates"])
        spread = f"{min(rates):.2f}/{max(rates):.2f}" if n > 1 else ""
        vs_own = f"{sum(rates) / own[n]:.2f}" if label.startswith("pool") and n in own else ""
        print(f"{label:<22}{sum(rates):>10.2f}{sum(rates) / base:>10.2f}{vs_own:>10}{spread:>17}{mb:>12.0f}"
              f"{mb / whole:>10.2f}")
    print(f"(vs alone: aggregate samples/s against the mean of the two alone windows, {base:.2f}; vs own N: a pool "
          f"of N runs against N runs with engines of their own, side by side on the same cores; MB per run: its "
          f"processes (driver and actors), on the pool plus its share of the pool engine's growth; vs stack: "
          f"that against one run alone, {whole:.0f} MB)")


async def publish_times(engine: Any, policy: str, rank: int, versions: range) -> list[float]:
    """Seconds from a fresh adapter version in hand to the engine serving it, per version
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


def make_pool(policy: str, args: argparse.Namespace) -> tuple[Any, list[Any], dict[str, list[int]]]:
    """The pool (with ``--pool-learner``, a learner of its own): (actor, its engines, the pids
    whose growth its runs share: engines, then the learner)."""
    import ray

    from cluster.config import PoolConfig
    from cluster.pool import start_pool

    engine = engine_cfg(args, args.pool_engines)
    learner = {"num_cpus": 1.0} if args.pool_learner else None
    pool = start_pool("bench", PoolConfig(model=policy, engine=engine, max_adapters=max(args.tenants) + 1,
                                          learner=learner), policy)
    info = ray.get(pool.start.remote())
    shared = {"pool engine": [pid_of(e) for e in info["engines"]]}
    if info["learner"] is not None:
        shared["pool learner"] = [pid_of(info["learner"])]
    return pool, info["engines"], shared


def fused_step(args: argparse.Namespace) -> None:
    """Part 3: ``pool_fused.py``'s fused step of 4 tenants against their 4 steps one by one."""
    import pool_fused

    model, pad_id = pool_fused.load_model(args.model)
    shape = dict(tenants=2, rows=2, width=32, threads=1) if args.quick else dict(tenants=4, rows=8, width=256, threads=0)
    pool_fused.report(argparse.Namespace(rank=args.rank, repeats=args.repeats, **shape), model, pad_id)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="tenants 1,2; 30 s windows; 3 repeats")
    p.add_argument("--model", choices=["tiny", "smollm2"], default="tiny")
    p.add_argument("--tenants", default="1,4,8", help="run counts on the pool, ascending")
    p.add_argument("--control", default="4", help="run counts that also run each with an engine of its own "
                   "(what sharing costs on the same cores; '' for none)")
    p.add_argument("--pool-engines", type=int, default=1, help="the pool's engine count (a run alone has one)")
    p.add_argument("--seconds", type=float, default=90.0, help="each measuring window")
    p.add_argument("--warm-steps", type=int, default=2, help="steps every run trains before a window opens")
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--parts", default="1,2,3", help="which parts to run (2 alone: the publish latency; 3 alone: "
                   "the fused step, without Ray)")
    p.add_argument("--engine-cores", default="", help="cores for every engine, the rest for everything else "
                   "(e.g. 0; default: all share every core)")
    p.add_argument("--pool-learner", action="store_true", help="the pool trains its runs in one learner "
                   "(learner.on_pool): a run on it starts no learner of its own")
    p.add_argument("--out", default=None, help="where the runs' folders and logs go (default: a temp dir)")
    args = p.parse_args()
    args.tenants = sorted(int(n) for n in args.tenants.split(","))
    args.control = sorted(int(n) for n in args.control.split(",") if n)
    if args.quick:
        args.tenants, args.control, args.seconds, args.repeats = [1, 2], [2], 30.0, 3
    parts = {int(n) for n in args.parts.split(",")}
    args.engine_cores = split_cores(args.engine_cores)
    if 3 in parts:  # no Ray: one process, the pool learner's core
        fused_step(args)
    if not parts & {1, 2}:
        return
    import ray

    from cluster.actors import job_env

    policy, _ = policy_and_source(args.model, show_progress=False)
    out = Path(args.out or tempfile.mkdtemp(prefix="tenants-"))
    out.mkdir(parents=True, exist_ok=True)
    print(f"runs' folders and logs: {out}; the pool: {engine_cfg(args, args.pool_engines)}; everything else on "
          f"cores {sorted(os.sched_getaffinity(0))}", flush=True)
    t0, cluster = time.perf_counter(), Cluster(8 + 3 * max(args.tenants), out / "ray")  # logical: every run's actors fit
    runs: list[Run] = []
    try:
        ray.init(address=cluster.address, log_to_driver=False, runtime_env={"env_vars": job_env()})
        pool, engines, shared = make_pool(policy, args)
        args.shared_mb = uss_mb([pid for pids in shared.values() for pid in pids])
        n = args.repeats
        idle = asyncio.run(publish_times(engines[0], policy, args.rank, range(1, n + 1))) if 2 in parts else []
        rows = [("alone (own engine)", own_engines(policy, cluster, out, args, 1, "alone first"))] if 1 in parts else []
        for count in args.control if 1 in parts else []:
            rows.append((f"own engines, {count} runs", own_engines(policy, cluster, out, args, count, f"own {count}")))
        for count in args.tenants if 1 in parts else []:
            rows.append((f"pool, {count} run(s)", on_pool(policy, cluster, out, args, shared, runs, count)))
        if 2 in parts:
            if not runs:
                on_pool(policy, cluster, out, args, shared, runs, max(args.tenants))
            busy = asyncio.run(publish_times(engines[0], policy, args.rank, range(n + 1, 2 * n + 1)))
        stop_all(runs)
        if 1 in parts:
            rows.append(("alone, again", own_engines(policy, cluster, out, args, 1, "alone again")))
            report(rows, args.seconds)
        if 2 in parts:
            print(f"\n2. adapter publish, rank {args.rank}, object store -> pool engine (ms, best / median of {n})")
            print(f"idle: {min(idle) * 1e3:.1f} / {statistics.median(idle) * 1e3:.1f}; while {len(runs)} runs train "
                  f"on the pool: {min(busy) * 1e3:.1f} / {statistics.median(busy) * 1e3:.1f}")
        ray.kill(pool)
    finally:
        stop_all(runs)
        ray.shutdown()
        cluster.stop()
    print(f"\n({time.perf_counter() - t0:.0f} s)")


if __name__ == "__main__":
    main()
