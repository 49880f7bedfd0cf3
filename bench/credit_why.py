"""Why does IGPO collapse on the credit task? Its signals on the warm start's own episodes.

    .venv/bin/python bench/credit_why.py [--tasks 24] [--group-size 8] [--set KEY=VALUE ...]
                                         [--quick] [--out runs/credit/why.json]
    .venv/bin/python bench/credit_why.py --read runs/credit/why.json   # the report again, no play

The credit matrix's IGPO cell (``bench/credit.py``, docs/results/credit.md) went from 1.7 turns
an episode to 1.0 within 7 steps and held-out success to 0: the policy learned to answer without
searching. This plays what IGPO's first steps train on, with the same config and warm-start
policy, outside Ray: ``--tasks`` train questions, ``--group-size`` episodes each (the HF
engine, the run's sampling settings), scores every turn's information gain with the run's IG
scorer and settings, and runs the run's estimator (``learner.advantages``) on them. It prints,
per turn kind (a search, the answer, any other turn):

- the IG reward: mean, spread and the share below 0 (IG on the answer turn is not used);
- the advantage each kind of turn gets, and its mean per episode length: what the policy
  gradient pushes up or down;
- how many groups have no outcome signal (every episode failed, or every one succeeded),
  the groups IG is meant to rescue, and what IG gives their turns;
- per group: the spread of the pool IGPO z-scores (IG on non-final turns, the outcome on the
  final one), its largest IG, and the advantage of each episode's first turn (the sum of the
  episode's normalised rewards) by episode length: where that spread is IG's numerical noise,
  the z-score makes the noise as large as a success.

Everything per turn goes to ``--out`` (JSON) for the analysis in docs/results/credit.md.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from bench.credit import CONFIG, METHODS, QUICK  # noqa: E402
from bench.offline_env import use_offline_env  # noqa: E402


def turn_kind(turn: Any, last: bool, answered: bool) -> str:
    if any(c.name == "search" for c in turn.tool_calls):
        return "search"
    return "answer" if last and answered else "other"


def play(cfg: Any, tasks: int, group_size: int) -> tuple[list[Any], str]:
    """``tasks`` train questions, ``group_size`` episodes each, on the run's warm-start policy."""
    from envs.registry import make_task_source
    from learner.bootstrap import ensure_policy
    from rewards.inline import score_cheap
    from rollout.config import HFEngineConfig
    from rollout.engines import local_client
    from rollout.episode import sampling_params
    from rollout.worker import RolloutWorker

    source = make_task_source(cfg.env)
    policy = str(ensure_policy(cfg.policy, cfg.env, source, chat_format=cfg.rollout.chat_format))
    engine = local_client(HFEngineConfig(dtype="float32"), policy, seed=0)
    worker = RolloutWorker(0, cfg.rollout, cfg.env, engine, seed=0, ports=None)
    params = sampling_params(cfg.rollout)
    trajs: list[Any] = []
    t0 = time.perf_counter()
    for i, task in enumerate(source.tasks("train")[:tasks]):
        group = asyncio.run(worker.run_group(task, group_size, params))
        for traj in group.trajectories:
            score_cheap(traj, cfg.rewards)
        trajs += group.trajectories
        rate = (time.perf_counter() - t0) / (i + 1)
        print(f"  [{i + 1}/{tasks}] played; ETA {rate * (tasks - i - 1):.0f} s (load {os.getloadavg()[0]:.2f})",
              flush=True)
    return trajs, policy


def analyse(cfg: Any, trajs: list[Any], policy: str) -> dict[str, Any]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from learner.advantages.assemble import batch_advantages
    from rewards.ig_scorer import IGScorer, write_ig_rewards

    model = AutoModelForCausalLM.from_pretrained(policy).eval()
    scorer = IGScorer(model, AutoTokenizer.from_pretrained(policy), cfg.rewards.ig)
    for traj, result in zip(trajs, scorer.score(trajs)):
        write_ig_rewards(traj, result)
    res, mask = batch_advantages(trajs, cfg.learner.estimator, cfg.rewards.trained_weights(), cfg.rewards.on_missing)
    rows, k = [], 0
    for traj in trajs:
        for t, turn in enumerate(traj.turns):
            rows.append({"group": traj.group_id, "traj": traj.trajectory_id, "turn": t, "turns": len(traj.turns),
                         "kind": turn_kind(turn, t == len(traj.turns) - 1, traj.answer is not None),
                         "ig": turn.rewards.get("ig"), "advantage": float(res.advantages[k]), "trained": bool(mask[k]),
                         "success": bool(traj.success), "outcome": traj.outcome})
            k += 1
    return {"turns": rows, "groups": group_signal(trajs, rows)}


def group_signal(trajs: list[Any], rows: list[dict[str, Any]]) -> dict[str, Any]:
    by_group: dict[str, list[Any]] = {}
    for traj in trajs:
        by_group.setdefault(traj.group_id, []).append(traj)
    flat = [g for g, ts in by_group.items() if len({t.outcome for t in ts}) == 1]
    ig_there = [r["ig"] for r in rows if r["group"] in flat and r["ig"] is not None and r["kind"] == "search"]
    return {"groups": len(by_group), "no_outcome_signal": len(flat),
            "all_failed": sum(all(not t.success for t in by_group[g]) for g in flat),
            "search_ig_in_those": summary(ig_there)}


def summary(values: list[float]) -> dict[str, float]:
    if not values:
        return {"n": 0}
    return {"n": len(values), "mean": statistics.fmean(values), "sd": statistics.pstdev(values),
            "below_0": sum(v < 0 for v in values) / len(values)}


def report(found: dict[str, Any]) -> None:
    rows = found["turns"]
    print("\nturn kind   n    IG mean     IG sd  IG<0   adv mean  adv<0")
    for kind in ("search", "answer", "other"):
        mine = [r for r in rows if r["kind"] == kind and r["trained"]]
        ig = summary([r["ig"] for r in mine if r["ig"] is not None])
        adv = summary([r["advantage"] for r in mine])
        if mine:
            print(f"{kind:<8} {len(mine):>4} {ig.get('mean', float('nan')):>10.4f} {ig.get('sd', float('nan')):>9.4f} "
                  f"{ig.get('below_0', float('nan')):>5.2f} {adv['mean']:>10.3f} {adv['below_0']:>6.2f}")
    print("\nepisode length  episodes  success  mean advantage of its turns")
    for n in sorted({r["turns"] for r in rows}):
        eps = {r["traj"]: r for r in rows if r["turns"] == n}
        adv = [r["advantage"] for r in rows if r["turns"] == n and r["trained"]]
        print(f"{n:>14} {len(eps):>9} {statistics.fmean(e['success'] for e in eps.values()):>8.2f} "
              f"{statistics.fmean(adv) if adv else float('nan'):>12.3f}")
    g = found["groups"]
    print(f"\ngroups: {g['groups']}, {g['no_outcome_signal']} without outcome signal ({g['all_failed']} all failed); "
          f"search-turn IG in those: {g['search_ig_in_those']}")
    by_group(rows)


def by_group(rows: list[dict[str, Any]]) -> None:
    """Per group: the z-scored pool's spread and largest IG, and first-turn advantages by
    episode length (what a searching episode is told against answering at once)."""
    groups: dict[str, list[dict[str, Any]]] = {}
    for r in rows:
        groups.setdefault(r["group"], []).append(r)
    print("\ngroup  pool std  largest IG  successes  first-turn advantage by episode length")
    for gid, turns in groups.items():
        pool = [r["outcome"] if r["turn"] == r["turns"] - 1 else r["ig"] for r in turns]
        pool = [v for v in pool if v is not None]
        igs = [r["ig"] for r in turns if r["ig"] is not None and r["turn"] < r["turns"] - 1]
        first = {}
        for r in sorted(turns, key=lambda r: r["turns"]):
            if r["turn"] == 0:
                first.setdefault(r["turns"], []).append(f"{r['advantage']:+.2f}")
        wins = len({r["traj"] for r in turns if r["success"]})
        print(f"{gid[-4:]:<6} {statistics.pstdev(pool) if pool else float('nan'):>8.1e} "
              f"{max(igs) if igs else float('nan'):>+11.1e} {wins:>10}  "
              + "  ".join(f"{n}: {' '.join(a)}" for n, a in first.items()))


def main() -> None:
    from cluster.config import load_config

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tasks", type=int, default=24)
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--quick", action="store_true", help="the tiny policy on a small world (the tests)")
    p.add_argument("--out", type=Path, default=ROOT / "runs" / "credit" / "why.json")
    p.add_argument("--read", type=Path, default=None, metavar="WHY_JSON",
                   help="print the report of an earlier run's --out, playing nothing")
    args = p.parse_args()
    if args.read is not None:
        report(json.loads(args.read.read_text()))
        return
    use_offline_env()
    quick = [q for q in QUICK if not q.startswith(("rollout.engine", "train.", "eval.", "learner.claim"))]
    cfg = load_config(CONFIG, [*(quick if args.quick else []), *METHODS["igpo"], *args.overrides])
    if args.quick:
        args.tasks, args.group_size = min(args.tasks, 2), min(args.group_size, 2)
    print(f"IGPO's signals on the warm start: {args.tasks} tasks x {args.group_size} episodes "
          f"(load {os.getloadavg()[0]:.2f})", flush=True)
    trajs, policy = play(cfg, args.tasks, args.group_size)
    found = analyse(cfg, trajs, policy)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(found, indent=1))
    report(found)
    print(f"\nper turn: {args.out}")


if __name__ == "__main__":
    main()
