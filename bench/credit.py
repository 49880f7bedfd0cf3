"""Does turn-level credit help? The comparison registered in docs/results/credit.md, run cell by
cell and tabulated.

A cell is one (method, seed): one ``turnrl train`` of ``configs/credit_search_qa.yaml`` (multi-hop
search QA on SmolLM2-135M-Instruct, vLLM CPU engine) in its own run directory,
``OUT/cells/<method>-s<seed>``. ``run`` skips the cells already done (``cell.json`` written once a
cell's command ended well), so the matrix can be spread over sessions: run it, stop it, run it
again. Each cell records the machine's load average, sampled while it ran, beside its wall time.
``table`` reads every cell's held-out evaluations (``evals.jsonl``: per task, every 5 steps) and
metrics and prints the registered statistics (``bench/credit_table.py``); ``calibrate`` measures
the warm start's held-out success per hop count, which chose the task's hop mix.

    python bench/credit.py tune [--out runs/credit]       # GRPO's lr x batch grid, first
    python bench/credit.py run [--methods grpo,igpo,matchtir,gigpo,prm] [--seeds 0,1,2]
                               [--out runs/credit] [--set KEY=VALUE ...] [--quick]
    python bench/credit.py table [--out runs/credit]
    python bench/credit.py calibrate [--set KEY=VALUE ...] [--quick]

``--quick``: the tiny policy on a small world and the HF engine, one step (the test's
two-cell matrix). Run the matrix itself on a quiet machine: nothing else running.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from bench.offline_env import offline_env, use_offline_env  # noqa: E402

CONFIG = ROOT / "configs" / "credit_search_qa.yaml"
METHODS: dict[str, tuple[str, ...]] = {
    "grpo": ("learner.estimator.type=grpo",),
    # The model scorer (IG, the PRM) shares the 2 cores like every actor (addendum 3).
    "igpo": ("learner.estimator.type=igpo", "rewards.ig={}", "rewards.service.scorer_num_cpus=0"),
    "matchtir": ("learner.estimator.type=matchtir", "rewards.match={}"),
    "gigpo": ("learner.estimator.type=gigpo",),
    "prm": ("learner.estimator.type=prm", "rewards.service.scorer_num_cpus=0"),  # rewards.prm: ``prepare_prm``'s PRM
    # The three IGPO variants of docs/results/credit.md's addendum 4 (named before they ran):
    # one change each against "igpo".
    "igpo_sep": ("learner.estimator.type=igpo", "learner.estimator.normalisation=separate", "rewards.ig={}",
                 "rewards.service.scorer_num_cpus=0"),
    "igpo_w03": ("learner.estimator.type=igpo", "learner.estimator.ig_weight=0.3", "rewards.ig={}",
                 "rewards.service.scorer_num_cpus=0"),
    "igpo_log": ("learner.estimator.type=igpo", "rewards.ig={mode: log_prob_diff}", "rewards.service.scorer_num_cpus=0"),
}
"""Each method's overrides; everything else (task, warm start, lr, batch) is the config's."""
SEEDS = (0, 1, 2)
QUICK = ["policy.path=builtin:tiny", "policy.tiny.hidden_size=64", "policy.tiny.num_layers=2",
         "policy.tiny.num_heads=2", "policy.tiny.intermediate_size=128", "policy.tiny.vocab_size=600",
         "policy.sft.steps=30", "policy.sft.num_demos=200", "policy.sft.guess_fraction=0.0",
         "policy.sft.lr=1e-3", "policy.sft.env={}", "rollout.engine.type=hf", "rollout.engine.dtype=float32", "env.num_entities=80",
         "env.num_train_tasks=300", "env.num_heldout_tasks=6", "env.max_train_pairs=null",
         "rollout.group_size=2", "learner.batch_groups=2", "learner.lr=1e-3", "rollout.max_new_tokens=32",
         "train.steps=1", "eval.every_steps=0", "eval.num_tasks=6", "learner.claim_timeout_s=240"]
"""``--quick``: tiny policy, small world, one step (tests/test_credit.py)."""
QUICK_PRM = ["rewards.prm.train.num_tasks=8", "rewards.prm.train.heldout_tasks=0", "rewards.prm.train.epochs=1"]
LOAD_EVERY_S = 10.0
LONE_LOAD = {2: 3.3, 4: 4.5}
"""Groups per step -> the load average a cell of that batch puts on this 2-core machine alone."""
LOAD_MARGIN = 1.0
"""A cell that ran at a mean load more than this above its batch's lone load is run again, the
loaded run set aside (docs/results/credit.md, addenda 1-2). ``--max-load`` sets one threshold
for every cell (another machine); ``--quick`` runs (the tests) keep whatever they ran at."""


TUNE_GRID = tuple((lr, groups) for lr in (1e-5, 3e-5) for groups in (2, 4))
"""(learning rate, groups per step) tried on GRPO, seed 0, before the matrix (registration)."""
TUNE_STEPS = (11, 20)
"""The steps whose mean training success is the tuning criterion (the held-out set is not used)."""


@dataclass(frozen=True)
class Cell:
    method: str
    seed: int
    tag: str = ""
    """A tuning cell's settings in its name (``lr1e-05-b2``); empty for the matrix's cells."""
    extra: tuple[str, ...] = ()
    """Overrides only this cell has (a tuning cell's lr and batch)."""

    @property
    def name(self) -> str:
        return f"{self.method}-{self.tag + '-' if self.tag else ''}s{self.seed}"


def cells_dir(out: Path) -> Path:
    return out / "cells"


def is_done(run_dir: Path) -> bool:
    """The cell's command ended well and left its result (an interrupted run is not done)."""
    try:
        info = json.loads((run_dir / "cell.json").read_text())
        result = json.loads((run_dir / "result.json").read_text())
    except (OSError, ValueError):
        return False
    return info.get("rc") == 0 and not result.get("interrupted", True)


def max_load(run_dir: Path, args: argparse.Namespace) -> float | None:
    """The mean load above which the cell counts as run beside other work (None: never)."""
    if args.quick:
        return None
    if args.max_load is not None:
        return args.max_load
    config = json.loads((run_dir / "config.json").read_text())
    return LONE_LOAD[config["learner"]["batch_groups"]] + LOAD_MARGIN


def ran_loaded(run_dir: Path, limit: float | None) -> bool:
    """The cell ran while the machine's mean load was above ``limit`` (None: never counts)."""
    if limit is None:
        return False
    return json.loads((run_dir / "cell.json").read_text())["load"]["mean"] > limit


def set_aside(run_dir: Path) -> Path:
    """Move a loaded cell (and its log) to ``<cell>.loaded-<n>``, kept for the report."""
    n = 1 + sum(1 for _ in run_dir.parent.glob(f"{run_dir.name}.loaded-*[0-9]"))
    dest = run_dir.with_name(f"{run_dir.name}.loaded-{n}")
    run_dir.rename(dest)
    log = run_dir.with_name(f"{run_dir.name}.log")
    if log.exists():
        log.rename(dest.with_name(f"{dest.name}.log"))
    return dest


def cell_overrides(cell: Cell, args: argparse.Namespace) -> list[str]:
    """Later overrides win: --quick, the method's, --set, then what makes the cell this cell."""
    prm = [f"rewards.prm={{type: model, path: {prm_dir(args.out)}}}"] if cell.method == "prm" else []
    return [*(QUICK if args.quick else []), *METHODS[cell.method], *prm, *args.overrides, *cell.extra,
            f"train.seed={cell.seed}", f"name={cell.name}", f"output_dir={cells_dir(args.out)}", "progress=none"]


def prm_dir(out: Path) -> Path:
    return out / "prm"


class LoadSampler:
    """The 1-minute load average every ``LOAD_EVERY_S`` seconds while a cell runs."""

    def __init__(self) -> None:
        self.samples: list[float] = [os.getloadavg()[0]]
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(LOAD_EVERY_S):
            self.samples.append(os.getloadavg()[0])

    def stop(self) -> dict[str, float]:
        self._stop.set()
        self._thread.join()
        return {"start": round(self.samples[0], 2), "mean": round(sum(self.samples) / len(self.samples), 2),
                "max": round(max(self.samples), 2), "samples": len(self.samples)}


def commit() -> str:
    out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                           capture_output=True, text=True).stdout.strip()
    return out.stdout.strip() + ("+dirty" if dirty else "")


def run_logged(cmd: list[str], log: Path) -> tuple[int, float, dict[str, float]]:
    """(exit code, wall seconds, load) of ``cmd``, its output into ``log``."""
    log.parent.mkdir(parents=True, exist_ok=True)
    load, t0 = LoadSampler(), time.time()
    with log.open("w") as fh:
        rc = subprocess.run(cmd, cwd=ROOT, stdout=fh, stderr=subprocess.STDOUT, env=offline_env()).returncode
    return rc, time.time() - t0, load.stop()


def run_cell(cell: Cell, args: argparse.Namespace) -> dict[str, Any]:
    overrides = cell_overrides(cell, args)
    run_dir = cells_dir(args.out) / cell.name
    cmd = [sys.executable, "-m", "cluster.cli", "train", str(args.config), *[a for o in overrides for a in ("--set", o)]]
    started, at = time.strftime("%Y-%m-%d %H:%M:%S"), commit()  # the code the cell starts with
    rc, wall, load = run_logged(cmd, cells_dir(args.out) / f"{cell.name}.log")
    info = {"method": cell.method, "seed": cell.seed, "tag": cell.tag, "rc": rc, "wall_s": round(wall, 1), "load": load,
            "started": started, "commit": at, "config": str(args.config), "overrides": overrides}
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "cell.json").write_text(json.dumps(info, indent=2))
    return info


def prepare_prm(args: argparse.Namespace) -> None:
    """The PRM the ``prm`` cells read: ``turnrl prm train`` on environment-labelled turns of the
    warm start, once (kept in ``OUT/prm``)."""
    out = prm_dir(args.out)
    if (out / "turnrl_prm.json").exists():
        return
    overrides = [*(QUICK if args.quick else []), *args.overrides, f"rewards.prm={{type: model, path: {out}}}",
                 *(QUICK_PRM if args.quick else [])]
    print(f"preparing the PRM: turnrl prm train -> {out}", flush=True)
    cmd = [sys.executable, "-m", "cluster.cli", "prm", "train", str(args.config),
           *[a for o in overrides for a in ("--set", o)]]
    rc, wall, load = run_logged(cmd, args.out / "prm.log")
    if rc != 0:
        raise SystemExit(f"turnrl prm train failed (exit {rc}); see {args.out / 'prm.log'}")
    print(f"  PRM ready in {wall:.0f} s (load mean {load['mean']})", flush=True)


def tuning_cells() -> list[Cell]:
    """GRPO at seed 0 for each (lr, groups) of ``TUNE_GRID``, with no held-out evaluation."""
    return [Cell("grpo", 0, f"lr{lr:g}-b{groups}", (f"learner.lr={lr}", f"learner.batch_groups={groups}",
                                                   "eval.num_tasks=0"))
            for lr, groups in TUNE_GRID]


def tuning_report(out: Path) -> str:
    """Each tuning cell's mean training success over ``TUNE_STEPS``, and the registered choice:
    the best, ties within 0.02 going to the smaller batch."""
    lo, hi = TUNE_STEPS
    scores, groups = {}, {}
    for (_, batch), cell in zip(TUNE_GRID, tuning_cells()):
        run_dir = cells_dir(out) / cell.name
        if is_done(run_dir):
            scores[cell] = _train_success(run_dir, lo, hi)
            groups[cell] = batch
    lines = [f"{c.tag}: mean training success, steps {lo}-{hi}: {v:.3f} ({_minutes(_wall(cells_dir(out) / c.name))})"
             for c, v in scores.items()]
    for cell in tuning_cells():
        for aside in sorted(cells_dir(out).glob(f"{cell.name}.loaded-*[0-9]")):
            lines.append(f"{cell.tag} (set aside, load mean {_load(aside)}; not used): steps {lo}-{hi}: "
                         f"{_train_success(aside, lo, hi):.3f}")
    if len(scores) == len(TUNE_GRID):
        best = max(scores.values())
        choice = min((c for c, v in scores.items() if v >= best - 0.02), key=lambda c: (groups[c], -scores[c]))
        lines.append(f"chosen: {choice.tag} ({' '.join(choice.extra[:2])})")
    else:
        lines.append(f"{len(scores)} of {len(TUNE_GRID)} tuning cells done")
    return "\n".join(lines)


def run_matrix(args: argparse.Namespace) -> int:
    cells = (tuning_cells() if args.action == "tune" else
             [Cell(m, s) for s in args.seeds for m in args.methods])  # seed-major: comparable cells early
    for c in cells:
        run_dir = cells_dir(args.out) / c.name
        if is_done(run_dir) and ran_loaded(run_dir, limit := max_load(run_dir, args)):
            print(f"{c.name} ran at load mean above {limit}: set aside as {set_aside(run_dir).name}, "
                  "to run again", flush=True)
    todo = [c for c in cells if not is_done(cells_dir(args.out) / c.name)]
    print(f"{len(cells) - len(todo)} of {len(cells)} cells done; {len(todo)} to run", flush=True)
    if any(c.method == "prm" for c in todo):
        prepare_prm(args)
    walls: list[float] = [_wall(cells_dir(args.out) / c.name) for c in cells if c not in todo]
    failed = 0
    for k, cell in enumerate(todo):
        eta = f"; ETA {_minutes(sum(walls) / len(walls) * (len(todo) - k))}" if walls else ""
        print(f"[{k + 1}/{len(todo)}] {cell.name} (load {os.getloadavg()[0]:.2f}{eta})", flush=True)
        info = run_cell(cell, args)
        walls.append(info["wall_s"])
        failed += info["rc"] != 0
        status = "done" if info["rc"] == 0 else f"FAILED (exit {info['rc']}, log {cells_dir(args.out) / cell.name}.log)"
        print(f"  {status} in {_minutes(info['wall_s'])}, load mean {info['load']['mean']} max {info['load']['max']}",
              flush=True)
    return 1 if failed else 0


def _train_success(run_dir: Path, lo: int, hi: int) -> float:
    """Mean training success over steps ``lo``-``hi``."""
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x]
    return sum(r["rollout/success_rate"] for r in rows[lo - 1:hi]) / len(rows[lo - 1:hi])


def _load(run_dir: Path) -> float:
    return float(json.loads((run_dir / "cell.json").read_text())["load"]["mean"])


def _wall(run_dir: Path) -> float:
    return float(json.loads((run_dir / "cell.json").read_text())["wall_s"])


def _minutes(seconds: float) -> str:
    return f"{seconds / 60:.1f} min"


def calibrate(args: argparse.Namespace) -> int:
    """The warm start (built as ``turnrl train`` builds it) on the held-out questions: success
    per hop count, the numbers the task's hop mix was chosen from."""
    use_offline_env()
    from cluster.config import load_config
    from cluster.eval_cli import evaluate_checkpoint
    from envs.registry import make_task_source
    from learner.bootstrap import ensure_policy

    cfg = load_config(str(args.config), [*(QUICK if args.quick else []), *args.overrides])
    source = make_task_source(cfg.env)
    policy = ensure_policy(cfg.policy, cfg.env, source, show_progress=True,
                           history_turns=cfg.rollout.history_turns, chat_format=cfg.rollout.chat_format)
    t0 = time.time()
    rows = evaluate_checkpoint(cfg, Path(policy), show_progress=True)
    hops = {t.task_id: t.metadata.get("hops") for t in source.tasks("heldout")}
    by_hop: dict[int, list[float]] = {}
    for row in rows:
        by_hop.setdefault(hops[row["task_id"]], []).append(row["success"])
    report = {"overrides": args.overrides, "tasks": len(rows), "eval_s": round(time.time() - t0, 1),
              "load": os.getloadavg()[0], "success": sum(r["success"] for r in rows) / len(rows),
              "per_hop": {h: {"tasks": len(v), "success": sum(v) / len(v)} for h, v in sorted(by_hop.items())}}
    print(json.dumps(report, indent=2))
    args.out.mkdir(parents=True, exist_ok=True)
    with (args.out / "calibration.jsonl").open("a") as fh:
        fh.write(json.dumps(report) + "\n")
    return 0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("action", choices=("tune", "run", "table", "calibrate"))
    ap.add_argument("--methods", default=",".join(METHODS), help="comma-separated, from " + ", ".join(METHODS))
    ap.add_argument("--seeds", default=",".join(map(str, SEEDS)), help="comma-separated seeds")
    ap.add_argument("--config", type=Path, default=CONFIG)
    ap.add_argument("--out", type=Path, default=ROOT / "runs" / "credit")
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--quick", action="store_true", help="tiny policy, small world, one step")
    ap.add_argument("--max-load", type=float, default=None,
                    help="a cell run at a higher mean load is run again (default: its batch's lone load "
                         f"{LONE_LOAD} + {LOAD_MARGIN}; never with --quick)")
    args = ap.parse_args(argv)
    args.methods = [m for m in args.methods.split(",") if m]
    unknown = [m for m in args.methods if m not in METHODS]
    if unknown:
        ap.error(f"--methods: unknown {', '.join(unknown)}; known: {', '.join(METHODS)}")
    args.seeds = [int(s) for s in args.seeds.split(",") if s]
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.action in ("run", "tune"):
        rc = run_matrix(args)
        if args.action == "tune":
            print(tuning_report(args.out))
        return rc
    if args.action == "calibrate":
        return calibrate(args)
    from bench.credit_table import report

    print(report(args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
