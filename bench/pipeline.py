"""Async vs sync training throughput, measured side by side in one process tree.

Runs the same config in sync mode (``train.async=false``: generate, then train) and async mode
(``train.async=true``: rollout actors run ahead under the staleness bound), ``--pairs`` times
alternated (sync first, then async first, ...), and prints samples/s of each, their ratio, and
the ideal ratio (g + t) / max(g, t) from the generation time g and training time t measured
per step in the pair's sync run; then each pair's share of the ideal and their median. Rates,
g and t leave out the first ``--warmup`` steps of each run (one-time costs; async's pipeline
fill); the "all steps" column counts every step from the run's start. One pair is not a
measurement on this 2-core VM: its speed drifts 10-20% from minute to minute, and a short
run's batches come out wider or narrower by chance (a step trains for as long as its longest
row). Runs are 72 steps (24 with ``--quick``): on 2026-11-27, with continuous admission (below),
six pairs of 24-step runs ranged 0.69-1.04 of the ideal (medians of three 0.82 and 0.97 within
the hour), nine pairs of 72-step runs 0.82-1.00 (medians 0.93, 0.90 and 0.85).

Both modes run with the same core split: generation (engine and rollout actors) on the first
half of this machine's cores, the learner on the other half, so async can overlap the two
instead of time-sharing the same cores. Everything else the run starts (Ray, driver, reward,
environments, replay: ``cluster.cpu_affinity``) goes with the faster side, which has slack in
async while the slower one limits: ``--glue auto`` (the default) first runs a short sync probe
with the glue on the learner's cores and moves it to the generation cores when training is
the slower side (t > g). With generation the slower side (g > t, 2026-11-26) the glue on the
generation cores had made async's generation take 1.96 s a step against sync's 1.36 s; with
training the slower (t > g, 2026-11-27) the glue on the learner's cores made async's updates
17% slower than sync's and async reached 0.83 of the ideal. ``--glue learner|generation``
fixes the side; ``--glue split`` puts Ray and the driver with generation and the run's
services (reward, replay, weight sync: ``cluster.services_cpu_affinity``) with the learner;
``--shared-cores`` runs both modes unpinned instead. The "engine s" column is the seconds the
engines spent decoding per step: near g when generation limits, and higher in async than in
sync when the glue shares the engine's core (docs/results/pipeline.md); "prefilled" is the prompt tokens
they computed a step rather than took from a prefix cache, "stale kv" those taken from KV an
older weights version computed (``rollout.engine.stale_kv_versions``: an update mid-episode
leaves the episode's cached turns on the older version's KV, reused up to 4 versions old).

Async runs two batches deep: ``replay.eta=2`` and two batches' groups in flight per rollout
actor (``rollout.groups_in_flight``, 8 on the demo) unless ``--depth 1`` (the demo's own
``eta=1``, 4 groups in flight). One batch ahead is not enough to
hide how a batch's generation time varies with its episodes (0.7-2.5 s a step here): the
learner waited whenever one batch ran long, and async reached 0.70-0.80 of the ideal on
either core split. Sync is unaffected (it generates each batch fresh). Staleness does not
change what is measured: the learning rate is 0 (below).

Async starts its groups in waves (``rollout.admission=waves``, ``--admission``): a rollout
actor starts new groups only when all of its last ones have ended, as sync does each step. The
engines load each new version when the learner's weight sync pushes it, mid-wave included (until
2026-11-27 they held a wave's version until the next wave started, ``rollout.wave_hold_s``; the
numbers below with "the hold" are from then; docs/results/weight_sync.md has the runs since,
and those since episodes reuse KV across versions).
Admitted continuously instead (a group starts whenever one ends) the rows of a batch were at
different turns, padded to the longest (24.6% of the key/value columns a decode step attended to
were padding, against 4.4% in sync), and a weight update mid-episode made the episode's cached
turns stale: async's engines decoded 0.48-0.56 s a step against sync's 0.38-0.42, and on
2026-11-27 nine 72-step pairs reached 0.82-1.00 of the ideal (median 0.92), generation the
slower side in every pair below 0.9. In waves without the hold, two batches' groups started
together prefilled 1,300 tokens a step against sync's 800 (updates mid-wave); with the hold,
nine 72-step pairs (three runs) prefilled as much as sync, async's learner trained 97-100% of
its steps, and the pairs reached 0.95 0.88 1.11 / 0.93 1.00 0.91 / 1.02 0.98 0.91 (medians 0.95,
0.93 and 0.98): what is left is which mode drew the wider batches.

Both modes run with ``learner.lr=0`` unless ``--learn``: every update is computed and applied,
weights are published and engines reload them, but the policy stays the warm start, so both
modes draw episodes from one distribution and do the same work per sample. Learning, the two
runs' policies drift apart (async trains on one-step-stale data), and so do their episode
lengths and the per-step training time, which follows a batch's longest row: measured on the
demo model, async's batches averaged 283 tokens wide against sync's 235 in one pair of runs,
which no overlap can make up for. The ratio then measures the runs' workloads as much as the
overlap.

    python bench/pipeline.py [--config configs/demo.yaml] [--steps 72] [--warmup 1] [--pairs 3] [--quick]
                             [--learn] [--shared-cores | --glue auto|learner|generation|split] [--depth 2]
                             [--admission waves|continuous]
                             [--set k=v ...]
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


def core_split(glue: str, cores: list[int]) -> list[str]:
    """Overrides giving generation and training disjoint halves of ``cores``, and everything
    else those of ``glue``: "learner" or "generation" put Ray, the driver and the run's
    services (reward, replay, weight sync) there; "split" puts Ray and the driver with
    generation and the services with the learner. Both modes run on it alike."""
    if len(cores) < 2:
        raise SystemExit("a core split needs two cores; run with --shared-cores")
    gen, train = cores[: len(cores) // 2], cores[len(cores) // 2:]
    rest = train if glue == "learner" else gen
    services = [f"cluster.services_cpu_affinity={train}"] if glue == "split" else []
    return [f"cluster.cpu_affinity={rest}", *services, f"rollout.engine.cpu_affinity={gen}",
            f"rollout.cpu_affinity={gen}", f"rollout.engine.torch_threads={len(gen)}",
            f"learner.cpu_affinity={train}", f"learner.torch_threads={len(train)}"]


def pipeline_depth(cfg_path: str, overrides: list[str], batches: int) -> list[str]:
    """Overrides letting async producers run ``batches`` batches ahead of the learner (with
    the groups of that many batches in flight)."""
    from cluster.config import load_config

    cfg = load_config(cfg_path, overrides)
    per_batch = -(-cfg.learner.batch_groups // cfg.rollout.num_workers)
    return [f"replay.eta={batches}", f"rollout.groups_in_flight={batches * per_batch}"]


def mode_config(cfg_path: str, overrides: list[str], mode: str, steps: int, label: str = "") -> Any:
    """The RunConfig of one mode (``sync`` or ``async``), in the run dir of ``label`` (the mode's
    name unless given)."""
    from cluster.config import load_config

    return load_config(cfg_path, [*overrides, f"train.async={'true' if mode == 'async' else 'false'}",
                                  f"train.steps={steps}", "eval.num_tasks=0", "progress=none",
                                  f"name=bench-pipeline-{label or mode}", "output_dir=runs/bench"])


def run(cfg_path: str, overrides: list[str], mode: str, steps: int, warmup: int,
        label: str = "") -> dict[str, float]:
    """One mode's throughput over its steps after ``warmup`` (from the metrics' step clock)."""
    from cluster.driver import train

    cfg = mode_config(cfg_path, overrides, mode, steps, label)
    result = train(cfg, on_stage=lambda s: print(f"  [{label or mode}] {s}", flush=True))
    rows = [json.loads(x) for x in (result.run_dir / "metrics.jsonl").read_text().splitlines()][-steps:]
    # The first step pays one-time costs (kernels, allocator, DeepSpeed's first step: ~4 s here,
    # in both modes) and async's pipeline fill; the steady state after it is what overlap buys.
    timed = rows[warmup:]
    span = timed[-1]["time/elapsed_s"] - rows[warmup - 1]["time/elapsed_s"] if warmup else timed[-1]["time/elapsed_s"]
    out = {"samples_per_s": sum(r["samples"] for r in timed) / span,
           "all_samples_per_s": sum(r["samples"] for r in rows) / result.timings["train_s"],
           "train_s": result.timings["train_s"],
           # the work per sample, which must match between the modes for the ratio to be overlap
           "width": statistics.mean(r["tokens/row_width"] for r in timed),
           "turns": statistics.mean(r["rollout/turns_mean"] for r in timed),
           # the engine's decode steps a training step and their rows (HF engine only)
           "decode_steps": statistics.mean(r.get("engine/decode_steps", 0.0) for r in timed),
           "rows": statistics.mean(r.get("engine/rows_per_decode_step", 0.0) for r in timed),
           # seconds the engines decoded a step: near g when generation is busy, less when starved
           "busy": statistics.mean(r.get("engine/busy_s", 0.0) for r in timed),
           "prefilled": statistics.mean(r.get("engine/prefill_tokens", 0.0) for r in timed),
           "stale": statistics.mean(r.get("engine/stale_kv_tokens", 0.0) for r in timed)}
    out["t"] = statistics.mean(r["time/step_s"] - r["time/wait_s"] for r in timed)
    out["step"] = statistics.mean(r["time/step_s"] for r in timed)
    if mode == "sync":
        out["g"] = statistics.mean(r["time/generate_s"] for r in timed)
    return out


def probe_glue(args: argparse.Namespace, base: list[str], cores: list[int]) -> tuple[str, dict[str, float]]:
    """A short sync run with the glue on the learner's cores; the glue belongs with the faster
    side ("generation" when training is the slower, else "learner") and the probe's numbers."""
    import ray

    probe = run(args.config, base + core_split("learner", cores) + args.overrides, "sync", args.probe_steps, 1,
                label="probe")
    ray.shutdown()  # the modes' runs start their cluster afresh, pinned where their glue goes
    return ("generation" if probe["t"] > probe["g"] else "learner"), probe


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default=DEMO)
    ap.add_argument("--steps", type=int, default=None,
                    help="steps per mode (default 72; 24 with --quick): a step's training time doubles "
                         "with its batch's longest row, so fewer steps give a ratio that swings by a "
                         "third from run to run")
    ap.add_argument("--warmup", type=int, default=1,
                    help="first steps of each mode left out of samples/s, g and t (one-time costs)")
    ap.add_argument("--quick", action="store_true", help="tiny model and world (a smoke run)")
    ap.add_argument("--shared-cores", action="store_true", help="no core split: every actor on every core")
    ap.add_argument("--glue", choices=["auto", "learner", "generation", "split"], default="auto",
                    help="whose cores run everything but generation and training; auto: the faster "
                         "side's, from a short sync probe")
    ap.add_argument("--probe-steps", type=int, default=6, help="sync steps of --glue auto's probe")
    ap.add_argument("--learn", action="store_true",
                    help="keep the config's learning rate (default 0: both modes sample one policy)")
    ap.add_argument("--depth", type=int, default=2,
                    help="batches async may generate ahead of the learner (replay.eta, with a batch's "
                         "groups in flight for each); the demo's config runs 1")
    ap.add_argument("--admission", choices=["waves", "continuous"], default="waves",
                    help="when async's rollout actors start groups (rollout.admission): in waves, as sync "
                         "does, or whenever one ends")
    ap.add_argument("--pairs", type=int, default=None,
                    help="sync/async pairs of runs, alternated; the bench reports each pair's share of "
                         "the ideal and their median (default 3; 1 with --quick)")
    ap.add_argument("--set", dest="overrides", action="append", default=[])
    args = ap.parse_args()
    if args.pairs is None:
        args.pairs = 1 if args.quick else 3
    if args.steps is None:
        args.steps = 24 if args.quick else 72
    if args.pairs < 1:
        raise SystemExit(f"--pairs {args.pairs} must be at least 1")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    if not 0 <= args.warmup < args.steps:
        raise SystemExit(f"--warmup {args.warmup} must be >= 0 and below --steps {args.steps}")
    base = (QUICK if args.quick else []) + ([] if args.learn else ["learner.lr=0"])
    # Taken before any run: a run pins this process (the driver) to the glue's cores.
    cores, glue = sorted(os.sched_getaffinity(0)), args.glue
    if glue == "auto" and not args.shared_cores:
        glue, probe = probe_glue(args, base, cores)
        print(f"glue probe ({args.probe_steps} sync steps, glue with the learner): g = {probe['g']:.2f}s/step, "
              f"t = {probe['t']:.2f}s/step: the glue goes with the {glue}", flush=True)
    split = [] if args.shared_cores else core_split(glue, cores)
    overrides = base + split
    depth = pipeline_depth(args.config, overrides + args.overrides, args.depth) + [f"rollout.admission={args.admission}"]
    overrides += depth + args.overrides
    pairs = []
    for i in range(args.pairs):
        # Alternated (sync first, then async first, ...): this VM's speed drifts by 10-20%
        # from minute to minute, so the run that always went second would carry the drift.
        order = ("sync", "async") if i % 2 == 0 else ("async", "sync")
        pairs.append({mode: run(args.config, overrides, mode, args.steps, args.warmup) for mode in order})
    affinity = [o for o in split + args.overrides if "affinity" in o]
    print(f"\ncores: {'shared' if args.shared_cores else ' '.join(affinity)}")
    print(f"async depth and admission: "
          f"{' '.join(depth + [o for o in args.overrides if 'eta' in o or 'in_flight' in o or 'admission' in o])}")
    print(f"weights: {'learning at the config lr' if args.learn else 'lr 0, one policy for both modes'}")
    print(f"steps per mode: {args.steps}, the first {args.warmup} left out of the rates; "
          f"{args.pairs} pair(s) of runs, alternated")
    print_pairs(pairs)
    return 0


def share_of_ideal(sync: dict[str, float], asyn: dict[str, float]) -> tuple[float, float, float]:
    """(async/sync ratio, ideal (g + t) / max(g, t) from the sync run, their quotient)."""
    ideal = (sync["g"] + sync["t"]) / max(sync["g"], sync["t"])
    ratio = asyn["samples_per_s"] / sync["samples_per_s"]
    return ratio, ideal, ratio / ideal


def print_pairs(pairs: list[dict[str, dict[str, float]]]) -> None:
    """A row per run, each pair's share of the ideal, and their median."""
    print(f"{'pair':<5}{'mode':<7}{'samples/s':>10}{'all steps':>10}{'train s':>9}{'g s':>6}{'t s':>6}"
          f"{'wait s':>7}{'row width':>10}{'turns':>6}{'decode steps':>13}{'rows each':>10}{'engine s':>9}{'prefilled':>10}{'stale kv':>9}")
    for i, pair in enumerate(pairs):
        for name in ("sync", "async"):
            res = pair[name]
            g = f"{res['g']:.2f}" if "g" in res else "-"
            print(f"{i + 1:<5}{name:<7}{res['samples_per_s']:>10.2f}{res['all_samples_per_s']:>10.2f}"
                  f"{res['train_s']:>9.1f}{g:>6}{res['t']:>6.2f}{res['step'] - res['t']:>7.2f}{res['width']:>10.1f}"
                  f"{res['turns']:>6.2f}{res['decode_steps']:>13.1f}{res['rows']:>10.1f}{res['busy']:>9.2f}{res['prefilled']:>10.0f}{res['stale']:>9.0f}")
    shares = []
    for i, pair in enumerate(pairs):
        ratio, ideal, share = share_of_ideal(pair["sync"], pair["async"])
        shares.append(share)
        # Where a pair's share went: async waiting for data is overlap lost; slower async
        # updates are the learner's core doing other work, or wider batches (row width above)
        print(f"pair {i + 1}: async/sync ratio {ratio:.2f}, ideal (g+t)/max(g,t) {ideal:.2f}, share of ideal "
              f"{share:.2f}; async's learner busy {pair['async']['t'] / pair['async']['step']:.0%} of its steps")
    print(f"share of ideal, median of {len(shares)} alternated pair(s): {statistics.median(shares):.2f} "
          f"(goal >= 0.9; pairs {' '.join(f'{s:.2f}' for s in shares)})")


if __name__ == "__main__":
    sys.exit(main())
