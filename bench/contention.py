"""A busy machine slows TurnRL down, not to a halt: each workload alone and beside busy processes.

    .venv/bin/python bench/contention.py [--quick] [--busy 1] [--rounds 2] [--policy on|off]
                                         [--workloads sft,learner,hf,vllm]

Each workload runs in a fresh process of its own (OpenMP reads its settings when torch loads
it), timed after a warm-up, alone and then beside ``--busy`` processes spinning
``while True: pass``, alternated for ``--rounds`` rounds; the best rate of each side counts:

- sft: warm-start SFT steps (``learner.sft._batch_loss``, AdamW) on the demo's tiny model and
  demonstrations (``bench/sft.py``'s setup), torch's default threads as in the driver;
- learner: ``LearnerWorker._update`` (DeepSpeed ZeRO 1) on ``bench/learner.py --quick``'s batch,
  ``learner.torch_threads`` at its default;
- hf / vllm: an engine's decode, 8 concurrent requests of 32 new tokens on a tiny Llama,
  ``rollout.engine.torch_threads`` at its default (vllm: only where vLLM is installed).

Prints per workload the rates, the slowdown (alone / busy; goal <= 3x), the CPU seconds a unit
took (the workload's own process: vLLM's engine runs in processes of its own, not counted), and
the 1-minute load average before each side. ``--policy off`` runs the workloads with
OpenMP's own defaults instead of ``rollout.cores.THREAD_POLICY`` (the before of the fix).
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run as a script from anywhere

from rollout.cores import THREAD_POLICY, apply_thread_policy  # noqa: E402

GOAL = 3.0


def _timed(step, units: int, warmup: int) -> dict[str, float]:
    """Rate of ``step`` (which returns the units it did) after ``warmup`` calls, and the
    process's CPU seconds per unit."""
    for _ in range(warmup):
        step()
    cpu0, t0, done = time.process_time(), time.perf_counter(), 0
    while done < units:
        done += step()
    wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    return {"rate": done / wall, "cpu_per_unit": cpu / done}


def child_sft(steps: int) -> dict[str, float]:
    import random

    import torch

    sys.path.insert(0, str(ROOT / "bench"))
    from sft import setup  # bench/sft.py

    from learner.sft import _batch_loss

    model, pad, data, sft = setup(argparse.Namespace(config=str(ROOT / "configs" / "demo.yaml"), overrides=[]))
    rng = random.Random(sft.seed)
    opt = torch.optim.AdamW(model.parameters(), lr=sft.lr)

    def step() -> int:
        batch = [row for rows in rng.sample(data, sft.batch_size) for row in rows]
        loss = _batch_loss(model, batch, pad, sft.context_loss_weight)
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        return 1

    return _timed(step, steps, warmup=2)


def child_learner(steps: int) -> dict[str, float]:
    from bench.learner import CORPUS, trajectories
    from bench.tiny_llama import build_tiny_llama
    from learner.config import LearnerConfig
    from learner.worker import LearnerWorker

    args = argparse.Namespace(groups=2, group_size=4, turns=3, prompt_tokens=48, action_tokens=24, obs_tokens=64)
    tmp = tempfile.mkdtemp(prefix="bench-contention-")
    _, tok = build_tiny_llama(Path(tmp), CORPUS, vocab=2048, hidden=64, layers=2, max_positions=2048)
    cfg = LearnerConfig(batch_groups=args.groups, micro_batch_size=16)
    worker = LearnerWorker(cfg, tmp, tempfile.mkdtemp(), ports=None, group_size=args.group_size, temperature=1.0)
    trajs = trajectories(args, len(tok))
    return _timed(lambda: (worker._update(trajs), 1)[1], steps, warmup=1)


def child_engine(kind: str, rounds: int) -> dict[str, float]:
    """Decode tokens/s of ``kind``'s engine in this process, its threads as an engine actor's."""
    import torch

    from bench.learner import CORPUS
    from bench.tiny_llama import build_tiny_llama
    from rollout.config import HFEngineConfig, VLLMEngineConfig
    from rollout.engines import local_client
    from rollout.engines.base import SamplingParams

    tmp = tempfile.mkdtemp(prefix="bench-contention-")
    # hidden 128 over 4 heads: vLLM's CPU attention needs a head size of at least 32
    build_tiny_llama(Path(tmp), CORPUS, vocab=2048, hidden=128, layers=2, max_positions=2048)
    cfg = HFEngineConfig() if kind == "hf" else VLLMEngineConfig(max_model_len=512)
    torch.set_num_threads(cfg.torch_threads)  # what EngineServer.start does in an engine actor
    client = local_client(cfg, tmp)
    params = SamplingParams(temperature=1.0, max_new_tokens=32)
    prompts = [[5 + (i * 7 + j) % 500 for j in range(64)] for i in range(8)]

    async def batch() -> int:
        done = await asyncio.gather(*[client.generate(p, params) for p in prompts])
        return sum(len(c.token_ids) for c in done)

    loop = asyncio.new_event_loop()
    out = _timed(lambda: loop.run_until_complete(batch()), rounds * 8 * 32, warmup=1)
    loop.run_until_complete(client.engine.close())  # vLLM's engine processes end with it
    return out


def child(names: list[str], units: dict[str, int]) -> None:
    """Run ``names`` in this process, one after another, printing a RESULT line for each."""
    if os.environ.get("TURNRL_BENCH_POLICY", "on") == "on":
        apply_thread_policy()
    runs = {"sft": child_sft, "learner": child_learner,
            "hf": lambda n: child_engine("hf", n), "vllm": lambda n: child_engine("vllm", n)}
    for name in names:
        print("RESULT " + json.dumps({"name": name, **runs[name](units[name])}), flush=True)
    os._exit(0)  # vLLM's and DeepSpeed's exit handlers add seconds and nothing to measure


def run_child(names: list[str], units: dict[str, int], busy: int, policy: str) -> dict[str, dict]:
    """One fresh process running ``names`` beside ``busy`` spinning processes: name -> result,
    with the 1-minute load average when it started."""
    env = {**os.environ, "TURNRL_BENCH_POLICY": policy, "TOKENIZERS_PARALLELISM": "false",
           "HF_HUB_OFFLINE": "1", "DS_BUILD_OPS": "0"}
    if policy == "off":  # OpenMP's own defaults, as before the fix
        for key in THREAD_POLICY:
            env.pop(key, None)
    spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(busy)]
    load = os.getloadavg()[0]
    try:
        proc = subprocess.run([sys.executable, __file__, "--child", ",".join(names), "--units", json.dumps(units)],
                              capture_output=True, text=True, env=env, cwd=ROOT, timeout=1200)
    finally:
        for s in spinners:
            s.kill()
            s.wait()
    out = {r["name"]: {**r, "load": load} for r in
           (json.loads(ln[7:]) for ln in proc.stdout.splitlines() if ln.startswith("RESULT "))}
    if set(out) != set(names):
        raise RuntimeError(f"{','.join(names)} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="sft, learner and hf, one round, few steps")
    ap.add_argument("--busy", type=int, default=1, help="busy processes beside the workload")
    ap.add_argument("--rounds", type=int, default=2, help="alone / busy pairs per workload")
    ap.add_argument("--policy", choices=["on", "off"], default="on")
    ap.add_argument("--workloads", default="sft,learner,hf,vllm")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--units", default="{}", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return child(args.child.split(","), json.loads(args.units))
    names = [w for w in args.workloads.split(",") if w]
    # about 2-5 s of work each on 2 idle cores: long enough to span the scheduler's time slices
    units = {"sft": 20, "learner": 40, "hf": 20, "vllm": 20}
    if args.quick:
        names, args.rounds, units = ["sft", "learner", "hf"], 1, {"sft": 8, "learner": 16, "hf": 8}
    if "vllm" in names and importlib.util.find_spec("vllm") is None:
        names.remove("vllm")
    # vLLM spawns engine processes of its own: its own child, the rest share one
    groups = [g for g in ([n for n in names if n != "vllm"], [n for n in names if n == "vllm"]) if g]
    print(f"{os.cpu_count()} cores; policy {args.policy}; beside {args.busy} busy process(es); "
          f"best of {args.rounds} round(s); goal: slowdown <= {GOAL:g}x; units: SFT steps, "
          "learner updates, engine tokens")
    print(f"{'workload':9s} {'alone/s':>9s} {'busy/s':>9s} {'slowdown':>9s} {'cpu/unit alone':>15s} "
          f"{'cpu/unit busy':>14s} {'load alone':>10s} {'load busy':>9s}")
    worst = 0.0
    for group in groups:
        alone, busy = [], []
        for _ in range(args.rounds):  # alternated: a change in the machine's load hits both sides
            alone.append(run_child(group, units, 0, args.policy))
            busy.append(run_child(group, units, args.busy, args.policy))
        for name in group:
            a = max((r[name] for r in alone), key=lambda r: r["rate"])
            b = max((r[name] for r in busy), key=lambda r: r["rate"])
            slow = a["rate"] / b["rate"]
            worst = max(worst, slow)
            print(f"{name:9s} {a['rate']:9.2f} {b['rate']:9.2f} {slow:8.2f}x {a['cpu_per_unit']:15.4f} "
                  f"{b['cpu_per_unit']:14.4f} {a['load']:10.2f} {b['load']:9.2f}", flush=True)
    print(f"worst slowdown {worst:.2f}x (goal <= {GOAL:g}x): {'met' if worst <= GOAL else 'NOT met'}")


if __name__ == "__main__":
    main()
