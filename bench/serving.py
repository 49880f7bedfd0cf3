"""Live serving under weight publishes: latency with and without, side by side in one run.

    .venv/bin/python bench/serving.py [--quick] [--seconds S] [--sessions C] [--publish-every P]

Builds the tiny test policy (SFT-warm-started, cached), then serves it the way a run does: the
gateway (FastAPI + uvicorn on its own event loop), the HF engine behind the engine client, a real
reward service and in-process replay store, and a consumer that claims live groups and
acknowledges them as the learner would. A steady load of ``C`` concurrent multi-turn sessions
(loopback HTTP; each: a question, the assistant's reply sent back with a follow-up, feedback,
end) runs for ``S`` seconds twice:

1. **no publishes**: the weights never change;
2. **publishes**: every ``P`` seconds a new version (the state perturbed, so the load is real) is
   published through the run's weight sync (``learner.weights.WeightSync.publish``, which pushes
   it to the engine's ``update_weights``; an in-memory handle: the transport the object store
   hands over, without Ray), and the consumer acknowledges with it.

It prints p50 and p99 chat latency of each phase, their ratio (goal: p99 with publishes <=
1.2 x p99 without), failed requests (goal 0), the weight versions reached, and live episodes
recorded in replay per second. What it does not include: the learner's own CPU use (on a
real 2-core run the DeepSpeed step competes with serving for cores; this bench isolates what
publishing itself costs a request).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere

import httpx  # noqa: E402
import torch  # noqa: E402

QUESTIONS = ["In which city was {} born?", "Where does {} work?", "Who is the sibling of {}?"]


POLICY_OVERRIDES = [
    "policy.tiny.hidden_size=64", "policy.tiny.num_layers=2", "policy.tiny.num_heads=2",
    "policy.tiny.intermediate_size=128", "policy.tiny.vocab_size=600", "policy.sft.steps=300",
    "policy.sft.num_demos=200", "policy.sft.batch_size=8", "env.num_entities=80",
    "env.num_train_tasks=300", "env.num_heldout_tasks=40"]
"""The tiny agent policy and its world (``--set`` overrides): a run given them finds it cached."""


def build_policy(show_progress: bool = True) -> tuple[str, Any]:
    """The tiny warm-started policy the serving and engine benches share (cached)."""
    from cluster.config import load_config
    from envs.registry import make_task_source
    from learner.bootstrap import ensure_policy

    cfg = load_config(None, POLICY_OVERRIDES)
    source = make_task_source(cfg.env)
    return str(ensure_policy(cfg.policy, cfg.env, source, show_progress=show_progress)), source


class Stack:
    """Gateway + engine + reward service + replay on one event-loop thread."""

    def __init__(self, policy: str) -> None:
        from cluster.live import LocalLivePorts, local_reward_service
        from gateway.config import LiveConfig
        from gateway.server import LiveGateway
        from learner.weights import WeightSync
        from replay.config import ReplayConfig
        from replay.memory import InProcessReplayStore
        from rollout.config import HFEngineConfig
        from rollout.engines import local_client

        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, daemon=True).start()
        self.engine = local_client(HFEngineConfig(), policy)
        self.sync = WeightSync([self.engine])
        self.store = InProcessReplayStore(ReplayConfig(eta=1_000_000, live_capacity_groups=512), batch_groups=1)
        self.reward = local_reward_service(self.store)
        self.gateway = LiveGateway(LiveConfig(enabled=True, default_max_tokens=24), self.engine,
                                   LocalLivePorts(self.reward, self.store))
        self.url = self.run(self.gateway.start())
        self.version = 0

    def run(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout=600)


async def session(http: httpx.AsyncClient, url: str, sid: str, task: Any, lat: list[float], failed: list[str]) -> None:
    headers = {"X-Session-Id": sid}
    messages = list(task.messages)
    try:
        for turn in range(2):
            t0 = time.perf_counter()
            res = await http.post(f"{url}/chat/completions", headers=headers, json={
                "model": "turnrl-policy", "messages": messages, "max_tokens": 24, "temperature": 0.7})
            lat.append(time.perf_counter() - t0)
            if res.status_code != 200:
                failed.append(f"{res.status_code}: {res.text[:120]}")
                return
            messages += [res.json()["choices"][0]["message"], {"role": "user", "content": "Are you sure?"}]
        await http.post(f"{url}/sessions/{sid}/feedback", json={"outcome": 1.0})
        await http.post(f"{url}/sessions/{sid}/end")
    except httpx.HTTPError as exc:
        failed.append(f"{type(exc).__name__}: {exc}")


async def load(url: str, tasks: list[Any], seconds: float, concurrency: int, tag: str) -> tuple[list[float], list[str]]:
    lat: list[float] = []
    failed: list[str] = []
    stop = time.perf_counter() + seconds
    counter = iter(range(10**9))

    async def worker(w: int) -> None:
        async with httpx.AsyncClient(timeout=120) as http:
            while time.perf_counter() < stop:
                i = next(counter)
                await session(http, url, f"{tag}-{w}-{i}", tasks[i % len(tasks)], lat, failed)

    await asyncio.gather(*[worker(w) for w in range(concurrency)])
    return lat, failed


def consume(stack: Stack, stop: threading.Event) -> None:
    """The learner's side of replay: claim whatever live groups are ready, acknowledge them."""
    while not stop.is_set():
        claim = stack.store.claim(1, live=(1, 1))
        if claim is None:
            time.sleep(0.02)
            continue
        stack.store.ack(claim.claim_id, stack.version)


def publisher(stack: Stack, every: float, stop: threading.Event) -> None:
    from rollout.engines.transport import InMemoryWeights

    base = {k: v.clone() for k, v in stack.engine.engine.model.state_dict().items()}
    while not stop.wait(every):
        stack.version += 1
        gen = torch.Generator().manual_seed(stack.version)
        state = {k: v + 1e-3 * torch.randn(v.shape, generator=gen) for k, v in base.items()}
        stack.run(stack.sync.publish(stack.version, InMemoryWeights(state)))


def phase(stack: Stack, tasks: list[Any], args: argparse.Namespace, publish: bool, tag: str) -> dict[str, Any]:
    stop = threading.Event()
    threads = [threading.Thread(target=consume, args=(stack, stop), daemon=True)]
    if publish:
        threads.append(threading.Thread(target=publisher, args=(stack, args.publish_every, stop), daemon=True))
    for t in threads:
        t.start()
    before = stack.gateway.stats()["episodes"]["recorded"]
    v0 = stack.engine.version
    t0 = time.perf_counter()
    lat, failed = asyncio.run(load(stack.url, tasks, args.seconds, args.sessions, tag))
    stack.run(stack.gateway.drain())
    elapsed = time.perf_counter() - t0
    stop.set()
    for t in threads:
        t.join(timeout=30)
    q = statistics.quantiles(lat, n=100)
    return {"p50": q[49], "p99": q[98], "requests": len(lat), "failed": failed, "elapsed": elapsed,
            "versions": stack.engine.version - v0,
            "recorded_per_s": (stack.gateway.stats()["episodes"]["recorded"] - before) / elapsed}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="10 s phases, 4 sessions")
    p.add_argument("--seconds", type=float, default=45.0, help="length of each phase")
    p.add_argument("--sessions", type=int, default=8, help="concurrent sessions")
    p.add_argument("--publish-every", type=float, default=1.0, help="seconds between weight publishes")
    args = p.parse_args()
    if args.quick:
        args.seconds, args.sessions = 10.0, 4
    torch.set_num_threads(1)
    policy, source = build_policy()
    stack = Stack(policy)
    tasks = source.tasks("train")
    phase(stack, tasks, argparse.Namespace(**{**vars(args), "seconds": 3.0}), False, "warmup")
    quiet = phase(stack, tasks, args, publish=False, tag="quiet")
    busy = phase(stack, tasks, args, publish=True, tag="busy")
    print(f"\nserving: {args.sessions} concurrent 2-turn sessions, {args.seconds:.0f} s per phase, "
          f"publish every {args.publish_every:g} s")
    print(f"{'phase':<16}{'requests':>9}{'failed':>8}{'p50 ms':>9}{'p99 ms':>9}{'versions':>10}{'recorded/s':>12}")
    for name, r in (("no publishes", quiet), ("publishes", busy)):
        print(f"{name:<16}{r['requests']:>9}{len(r['failed']):>8}{r['p50'] * 1e3:>9.1f}{r['p99'] * 1e3:>9.1f}"
              f"{r['versions']:>10}{r['recorded_per_s']:>12.2f}")
    print(f"p99 ratio (publishes / none): {busy['p99'] / quiet['p99']:.2f}  (goal <= 1.20)")
    print(f"p50 ratio (publishes / none): {busy['p50'] / quiet['p50']:.2f}")
    for msg in (quiet["failed"] + busy["failed"])[:5]:
        print("failed:", msg)


if __name__ == "__main__":
    main()
