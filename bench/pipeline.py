"""Async vs sync training throughput, measured side by side in one process tree.

Runs the same config twice on one Ray cluster -- ``train.async=false`` (generate, then train)
and ``train.async=true`` (rollout actors run ahead under the staleness bound) -- and prints
samples/s of each, their ratio, and the ideal ratio (g + t) / max(g, t) from the generation
time g and training time t measured per step in the sync run.

Both modes run with the same core split: generation (engine and rollout actors) on the first
half of this machine's cores, the learner on the other half (``cpu_affinity``, intra-op
threads to match), so async can overlap the two instead of time-sharing the same cores.
``--shared-cores`` runs both modes unpinned instead.

    python bench/pipeline.py [--config configs/demo.yaml] [--steps 8] [--quick] [--set k=v ...]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

DEMO = str(ROOT / "configs" / "demo.yaml")
QUICK = ["policy.sft.steps=30", "policy.tiny.hidden_size=64", "policy.tiny.num_layers=2",
         "policy.tiny.num_heads=2", "policy.tiny.intermediate_size=128", "env.num_entities=80",
         "env.num_train_tasks=300", "env.num_heldout_tasks=20",
         # a world this small has too few facts for the demo's three-way split: SFT on RL's pairs
         "env.max_train_pairs=null", "policy.sft.env={}"]


def core_split() -> list[str]:
    """Overrides giving generation and training disjoint halves of this process's cores."""
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        raise SystemExit("a core split needs two cores; run with --shared-cores")
    gen, train = cores[: len(cores) // 2], cores[len(cores) // 2:]
    return [f"rollout.engine.cpu_affinity={gen}", f"rollout.cpu_affinity={gen}",
            f"rollout.engine.torch_threads={len(gen)}", f"learner.cpu_affinity={train}",
            f"learner.torch_threads={len(train)}"]


def mode_config(cfg_path: str, overrides: list[str], mode: str, steps: int) -> Any:
    """The RunConfig of one mode (``sync`` or ``async``)."""
    from cluster.config import load_config

    return load_config(cfg_path, [*overrides, f"train.async={'true' if mode == 'async' else 'false'}",
                                  f"train.steps={steps}", "eval.num_tasks=0", "progress=none",
                                  f"name=bench-pipeline-{mode}", "output_dir=runs/bench"])


def run(cfg_path: str, overrides: list[str], mode: str, steps: int) -> dict[str, float]:
    from cluster.driver import train

    cfg = mode_config(cfg_path, overrides, mode, steps)
    result = train(cfg, on_stage=lambda s: print(f"  [{mode}] {s}", flush=True))
    rows = [json.loads(x) for x in (result.run_dir / "metrics.jsonl").read_text().splitlines()][-steps:]
    samples = sum(r["samples"] for r in rows)
    out = {"samples_per_s": samples / result.timings["train_s"], "train_s": result.timings["train_s"]}
    if mode == "sync":
        out["g"] = statistics.mean(r["time/generate_s"] for r in rows)
        out["t"] = statistics.mean(r["time/step_s"] - r["time/wait_s"] for r in rows)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default=DEMO)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--quick", action="store_true", help="tiny model and world (a smoke run)")
    ap.add_argument("--shared-cores", action="store_true", help="no core split: every actor on every core")
    ap.add_argument("--set", dest="overrides", action="append", default=[])
    args = ap.parse_args()
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    split = [] if args.shared_cores else core_split()
    overrides = (QUICK if args.quick else []) + split + args.overrides
    sync = run(args.config, overrides, "sync", args.steps)
    asyn = run(args.config, overrides, "async", args.steps)
    ideal = (sync["g"] + sync["t"]) / max(sync["g"], sync["t"])
    print(f"\ncores: {'shared' if args.shared_cores else ' '.join(split[:1] + split[3:4])}")
    print(f"steps per mode: {args.steps}; generation g = {sync['g']:.2f}s/step, training t = {sync['t']:.2f}s/step")
    print(f"{'mode':<8}{'samples/s':>12}{'train s':>10}")
    for name, res in (("sync", sync), ("async", asyn)):
        print(f"{name:<8}{res['samples_per_s']:>12.2f}{res['train_s']:>10.1f}")
    ratio = asyn["samples_per_s"] / sync["samples_per_s"]
    print(f"async/sync ratio: {ratio:.2f}   ideal (g+t)/max(g,t): {ideal:.2f}   "
          f"share of ideal: {ratio / ideal:.2f} (goal >= 0.9)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
