"""Learning curves: held-out success against trained samples, per turn-level estimator.

Trains the same seeds with each (environment, estimator) cell of the matrix below -- GRPO as
the baseline on every built-in environment, IGPO on search QA, GiGPO and HGPO on household,
MatchTIR on tool use -- evaluating held-out tasks every ``--eval-every`` steps. Writes
``learning.csv`` (one row per evaluation), ``learning.png`` (one panel per environment: mean
over seeds with a 95% t-interval band per estimator) and ``summary.txt``, and prints the summary:
final success mean and 95% CI per estimator, its difference from GRPO, wall time per cell.

    python bench/learning.py [--seeds 3] [--steps 40] [--eval-every 5] [--quick] [--only ENV]
                             [--estimators grpo,igpo] [--set k=v | --set SCOPE:k=v ...] [--out DIR]

``--set SCOPE:k=v`` applies only to cells whose environment or estimator is SCOPE
(``household:env.max_turns=10``, ``igpo:rewards.ig.weight=0.5``). Every cell runs in this
process, one after another, on one Ray cluster. A cell that fails, or an IGPO cell whose IG
rewards cannot be scored, is skipped with its reason printed: no numbers are made up.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import shutil
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from bench.offline_env import use_offline_env  # noqa: E402


@dataclass(frozen=True)
class Cell:
    """One environment x estimator (with the reward sources it reads)."""

    env: str
    estimator: str
    overrides: tuple[str, ...] = ()


MATRIX: tuple[Cell, ...] = (
    Cell("search_qa", "grpo"),
    Cell("search_qa", "igpo", ("rewards.ig={}",)),
    Cell("household", "grpo"),
    Cell("household", "gigpo"),
    Cell("household", "hgpo"),
    Cell("tool_use", "grpo"),
    Cell("tool_use", "matchtir", ("rewards.match={}",)),
)

DEMO_CONFIG = ROOT / "configs" / "demo.yaml"


def demo_overrides(sections: tuple[str, ...], path: Path = DEMO_CONFIG) -> list[str]:
    """``key=value`` overrides reproducing the dotted ``sections`` of ``path`` (e.g.
    ``policy.sft``), read from the file so the bench and the demo cannot drift apart."""
    tree = yaml.safe_load(path.read_text())
    out = []
    for prefix in sections:
        section = tree
        for part in prefix.split("."):
            section = section[part]
        out += [f"{prefix}.{key}={json.dumps(value)}" for key, value in section.items()]
    return out


def demo_task_overrides(path: Path = DEMO_CONFIG) -> list[str]:
    """The demo's task and warm start: its ``env`` and ``policy.sft`` sections."""
    return demo_overrides(("env", "policy.sft"), path)


# The full run: configs/demo.yaml's rollout settings and learner loss on every environment, except
# max_new_tokens (64, the default): tool-use actions of the tiny tokenizer run to ~50 tokens.
SHARED = ["rollout.num_workers=1", "rollout.group_size=8", "rollout.groups_in_flight=4",
          "rollout.max_new_tokens=64", "rollout.num_cpus=0.5", "rollout.temperature=0.7",
          "eval.temperature=0.7", "learner.batch_groups=4", "learner.lr=2e-4",
          *demo_overrides(("learner.loss",)), "eval.num_tasks=100", "progress=none"]
# search QA: the demo's own task and warm start (docs/results/demo.md "Making the demo learn");
# household plans take up to 10 actions (30 by default is slow on CPU for nothing)
SEARCH_QA_AS_DEMO = demo_task_overrides()
# tool use: two-call questions (3 turns) and a digit-level tokenizer, so the warm start copies
# numbers from the question and tool outputs: 0.34 held-out after 1500 SFT steps, where merged
# digit runs gave 0.01 after 1000. lr 5e-5: at the demo's 2e-4 (without KL) training and
# held-out success both fell in every cell (docs/results/learning_bench.md "Tool use")
TOOL_USE = ["env.min_calls=2", "env.max_calls=2", "env.max_turns=3", "policy.tiny.split_digits=true",
            "policy.sft.steps=1500", "learner.lr=5e-5"]
# household: "place" goals in the kitchen alone (plans of 3-6 actions) in 8 turns, objects visible
# in room descriptions (the planner's demonstrations go straight to objects; without seeing them
# the warm start only guesses), and a 1-turn history window (goal, last action and observation:
# enough to act on), as GiGPO's and HGPO's ALFWorld agents bound theirs. The full house with a
# 2-turn window gave a warm start that solved no task (docs/results/learning_bench.md "Household")
HOUSEHOLD = ["env.goal_types=[place]", "env.other_rooms=0", "env.max_turns=8",
             "env.visible_items=true", "rollout.history_turns=1", "policy.sft.batch_size=8",
             "policy.sft.steps=900", "policy.sft.context_loss_weight=0.3"]
ENV_SHARED = {"search_qa": SEARCH_QA_AS_DEMO, "household": HOUSEHOLD, "tool_use": TOOL_USE}
# --quick: the tiny policy of tests/conftest.py TINY_OVERRIDES, small worlds, short episodes.
QUICK = ["policy.tiny.hidden_size=64", "policy.tiny.num_layers=2", "policy.tiny.num_heads=2",
         "policy.tiny.intermediate_size=128", "policy.tiny.vocab_size=600", "policy.sft.steps=30",
         "policy.sft.num_demos=200", "policy.sft.batch_size=8", "rollout.group_size=4",
         "rollout.groups_in_flight=2", "learner.batch_groups=2",
         "learner.lr=1e-3", "learner.claim_timeout_s=240", "eval.num_tasks=8"]
ENV_QUICK = {
    # a world this small has too few facts for the demo's three-way split: SFT on RL's pairs
    "search_qa": ["env.num_entities=80", "env.num_train_tasks=300", "env.num_heldout_tasks=40",
                  "env.max_train_pairs=null", "policy.sft.env={}"],
    "household": ["env.num_train_tasks=300", "env.num_heldout_tasks=40"],
    "tool_use": ["env.num_train_tasks=300", "env.num_heldout_tasks=40", "env.max_calls=2",
                 "env.max_turns=4"],
}
COLORS = {"grpo": "tab:gray", "igpo": "tab:blue", "gigpo": "tab:orange", "hgpo": "tab:green",
          "matchtir": "tab:purple"}
_RAY_ENV = {"TOKENIZERS_PARALLELISM": "false", "RAY_USAGE_STATS_ENABLED": "0", "PYTHONWARNINGS": "ignore"}


@dataclass
class Point:
    step: int
    samples: float
    success: float
    outcome_mean: float = math.nan


@dataclass
class CellRun:
    cell: Cell
    seed: int
    wall_s: float
    points: list[Point] = field(default_factory=list)
    error: str | None = None
    note: str | None = None
    """A warning about numbers that exist but may mean little (e.g. every action invalid)."""


# -- running -------------------------------------------------------------------------------
def cell_overrides(cell: Cell, seed: int, args: argparse.Namespace) -> list[str]:
    """Overrides of one cell, later ones winning: shared, per env, the cell's, --set, fixed."""
    scoped = []
    for item in args.overrides:
        key, _, value = item.partition("=")
        scope, sep, key = key.rpartition(":")
        if not sep or scope in (cell.env, cell.estimator):
            scoped.append(f"{key}={value}")
    base = (SHARED + ENV_SHARED[cell.env] + (QUICK + ENV_QUICK[cell.env] if args.quick else []))
    name = f"{cell.env}-{cell.estimator}-s{seed}"
    return [f"env.type={cell.env}", *base, f"learner.estimator.type={cell.estimator}",
            *cell.overrides, *scoped, f"train.steps={args.steps}", f"train.seed={seed}",
            f"eval.every_steps={args.eval_every}", f"name={name}", f"output_dir={args.out / 'runs'}"]


def curve(result: Any, rows: list[dict[str, Any]]) -> list[Point]:
    """(step, cumulative samples, held-out success): before training at step 0, every
    in-loop evaluation, and the final evaluation (averaged with an in-loop one at the same
    step: both score the same weights on the same tasks)."""
    points = [Point(0, 0.0, float(result.eval["before"]))] if "before" in result.eval else []
    samples = 0.0
    for row in rows:
        samples += row.get("samples", 0.0)
        if "eval/success" in row:
            points.append(Point(int(row["step"]), samples, float(row["eval/success"]),
                                float(row.get("reward/outcome_mean", math.nan))))
    if "after" in result.eval and rows:
        after, last = float(result.eval["after"]), rows[-1]
        if points and points[-1].step == int(last["step"]):
            points[-1].success = (points[-1].success + after) / 2
        else:
            points.append(Point(int(last["step"]), samples, after,
                                float(last.get("reward/outcome_mean", math.nan))))
    return points


def run_cell(cell: Cell, seed: int, args: argparse.Namespace) -> CellRun:
    from cluster.config import load_config
    from cluster.driver import train

    cfg = load_config(None, cell_overrides(cell, seed, args))
    shutil.rmtree(Path(cfg.output_dir) / cfg.name, ignore_errors=True)  # metrics.jsonl appends
    tag = f"{cell.env}/{cell.estimator}/s{seed}"
    t0 = time.time()
    try:
        result = train(cfg, on_stage=lambda s: print(f"  [{tag}] {s}", flush=True))
    except Exception as exc:  # noqa: BLE001 - one broken cell must not sink the matrix
        _ray_reset(args.verbose)  # train() leaves its actors alive when it raises
        return CellRun(cell, seed, time.time() - t0, error=_brief(exc))
    rows = [json.loads(x) for x in (result.run_dir / "metrics.jsonl").read_text().splitlines() if x]
    run = CellRun(cell, seed, time.time() - t0, curve(result, rows))
    if rows and min(r.get("rollout/invalid_rate", 0.0) for r in rows) >= 0.99:
        run.note = ("every training action was invalid: truncated by rollout.max_new_tokens, "
                    "or a policy that never produces the action format")
    if result.interrupted or not run.points:
        run.error = "interrupted" if result.interrupted else "no held-out evaluation (eval.num_tasks=0?)"
    return run


def ig_problem(cell: Cell, args: argparse.Namespace) -> str | None:
    """Why IG rewards would not reach the learner (None: they do). Scores one demonstration,
    tokenised as plain text, with the run's policy through the reward service's model scorer;
    a scorer that cannot be built or leaves IG missing would train IGPO on masked turns."""
    if not any(o.startswith("rewards.ig") for o in cell.overrides):
        return None
    try:
        from cluster.config import load_config
        from envs.registry import make_task_source
        from learner.bootstrap import ensure_policy
        from rewards.scorer import ModelScorer
        from rollout.trajectory import Trajectory, Turn

        cfg = load_config(None, cell_overrides(cell, 0, args))
        source = make_task_source(cfg.env)
        policy = ensure_policy(cfg.policy, cfg.env, source, show_progress=False,
                               history_turns=cfg.rollout.history_turns)
        scorer = ModelScorer(cfg.rewards, str(policy))
        ids = lambda text: scorer.tokenizer(text, add_special_tokens=False)["input_ids"]  # noqa: E731
        task = source.tasks("train")[0]
        turns: list[Turn] = []
        for msg in source.demonstration(task):
            if msg["role"] == "assistant":
                action = ids(msg["content"])
                turns.append(Turn(action_ids=action, action_logprobs=[0.0] * len(action), policy_version=0))
            else:
                turns[-1].observation_ids += ids(msg["content"])
        traj = Trajectory(trajectory_id="probe", task_id=task.task_id, group_id="probe",
                          prompt_ids=ids(task.messages[-1]["content"]), turns=turns,
                          gold_answers=task.gold_answers)
        res = scorer.score([traj])[0].get("ig")
    except Exception as exc:  # noqa: BLE001 - reported as the reason to skip the cell
        return f"IG scorer failed: {_brief(exc)}"
    if res is None:
        return "the model scorer returned no 'ig' result"
    values = [res.values.get(t) for t in range(len(turns) - 1)]
    if not values or any(v is None or not math.isfinite(v) for v in values):
        return f"IG values missing or non-finite on a demonstration: {values} ({res.error})"
    return None


def _ray_up(verbose: bool) -> None:
    """One local cluster for every cell. Logical CPUs >= 4: actors need 2.0 (2.25 with an IG
    scorer) whatever the core count; on 2 cores they time-share."""
    import ray

    if ray.is_initialized():
        return
    kw: dict[str, Any] = {"include_dashboard": False, "log_to_driver": verbose,
                          "runtime_env": {"env_vars": _RAY_ENV}}
    if os.environ.get("RAY_ADDRESS"):
        ray.init(address=os.environ["RAY_ADDRESS"], **kw)
    else:
        ray.init(num_cpus=max(4, os.cpu_count() or 1), **kw)


def _ray_reset(verbose: bool) -> None:
    import ray

    ray.shutdown()
    _ray_up(verbose)


def _brief(exc: BaseException) -> str:
    """First and last line of an error (Ray wraps the actor's whole traceback into it)."""
    lines = [x for x in str(exc).strip().splitlines() if x.strip()] or [""]
    tail = f" ... {lines[-1].strip()[:300]}" if len(lines) > 1 else ""
    return f"{type(exc).__name__}: {lines[0][:300]}{tail}"


# -- statistics and outputs ----------------------------------------------------------------
def t_interval(values: list[float]) -> tuple[float, float, float]:
    """Mean and 95% t-interval; a single value has a zero-width interval."""
    from scipy import stats

    x = np.asarray(values, float)
    mean = float(x.mean())
    if len(x) < 2:
        return mean, mean, mean
    half = float(stats.t.ppf(0.975, len(x) - 1) * x.std(ddof=1) / math.sqrt(len(x)))
    return mean, mean - half, mean + half


def welch_diff(a: list[float], b: list[float]) -> tuple[float, float, float]:
    """mean(a) - mean(b) with a 95% Welch t-interval (nan bounds with fewer than 2 each)."""
    from scipy import stats

    diff = float(np.mean(a) - np.mean(b))
    if len(a) < 2 or len(b) < 2:
        return diff, math.nan, math.nan
    va, vb = np.var(a, ddof=1) / len(a), np.var(b, ddof=1) / len(b)
    se = math.sqrt(va + vb)
    if se == 0:
        return diff, diff, diff
    dof = (va + vb) ** 2 / (va ** 2 / (len(a) - 1) + vb ** 2 / (len(b) - 1))
    half = float(stats.t.ppf(0.975, dof) * se)
    return diff, diff - half, diff + half


def aggregate(runs: list[CellRun]) -> dict[tuple[str, str], list[tuple[int, float, float, float, float, int]]]:
    """(env, estimator) -> per step: (step, mean samples, mean success, low, high, seeds)."""
    by_step: dict[tuple[str, str], dict[int, list[Point]]] = {}
    for run in runs:
        if run.error is None:
            key = (run.cell.env, run.cell.estimator)
            for p in run.points:
                by_step.setdefault(key, {}).setdefault(p.step, []).append(p)
    out = {}
    for key, steps in by_step.items():
        out[key] = [(step, float(np.mean([p.samples for p in pts])),
                     *t_interval([p.success for p in pts]), len(pts))
                    for step, pts in sorted(steps.items())]
    return out


def write_csv(runs: list[CellRun], path: Path) -> None:
    with path.open("w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(["env", "estimator", "seed", "step", "samples", "heldout_success", "train_outcome_mean"])
        for run in runs:
            if run.error is None:
                for p in run.points:
                    w.writerow([run.cell.env, run.cell.estimator, run.seed, p.step, f"{p.samples:g}",
                                f"{p.success:.4f}", "" if math.isnan(p.outcome_mean) else f"{p.outcome_mean:.4f}"])


def plot(agg: dict[tuple[str, str], list[tuple]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    envs = [e for e in ("search_qa", "household", "tool_use") if any(k[0] == e for k in agg)]
    fig, axes = plt.subplots(1, max(len(envs), 1), figsize=(5 * max(len(envs), 1), 3.8), squeeze=False)
    for ax, env in zip(axes[0], envs):
        for (e, est), rows in sorted(agg.items(), key=lambda kv: (kv[0][1] != "grpo", kv[0][1])):
            if e != env:
                continue
            _, x, mean, lo, hi, n = map(np.asarray, zip(*rows))
            color = COLORS.get(est)
            ax.plot(x, mean, marker="o", color=color, label=f"{est} (n={int(n.min())})")
            ax.fill_between(x, lo, hi, color=color, alpha=0.2)
        ax.set_title(env)
        ax.set_xlabel("trajectories trained")
        ax.set_ylabel("held-out success")
        ax.set_ylim(-0.02, max(ax.get_ylim()[1], 0.1))  # keep 0 in view; all-zero curves stay flat
        ax.grid(alpha=0.3)
        ax.legend(loc="best", fontsize=8)
    fig.suptitle("mean over seeds, 95% t-interval band")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def summary(runs: list[CellRun], agg: dict, skipped: dict[Cell, str], total_s: float) -> str:
    lines = [f"{'env':<10}{'estimator':<10}{'seeds':>6}{'success@0':>11}{'final success [95% CI]':>26}"
             f"{'diff vs grpo [95% CI]':>27}{'wall s/cell':>13}"]
    finals: dict[tuple[str, str], list[float]] = {}
    for run in runs:
        if run.error is None:
            finals.setdefault((run.cell.env, run.cell.estimator), []).append(run.points[-1].success)
    for (env, est), rows in agg.items():
        walls = [r.wall_s for r in runs if (r.cell.env, r.cell.estimator) == (env, est) and r.error is None]
        mean, lo, hi = t_interval(finals[(env, est)])
        diff = ""
        if est != "grpo" and (env, "grpo") in finals:
            d, dlo, dhi = welch_diff(finals[(env, est)], finals[(env, "grpo")])
            diff = f"{d:+.3f} [{dlo:+.3f}, {dhi:+.3f}]"
        lines.append(f"{env:<10}{est:<10}{len(finals[(env, est)]):>6}{rows[0][2]:>11.3f}"
                     f"{f'{mean:.3f} [{lo:.3f}, {hi:.3f}]':>26}{diff:>27}{np.mean(walls):>13.1f}")
    lines.append("wall s per cell: " + ", ".join(
        f"{r.cell.env}/{r.cell.estimator}/s{r.seed} {r.wall_s:.0f}" for r in runs))
    notes: dict[str, list[str]] = {}  # one line per distinct failure or warning
    for run in runs:
        if run.error is not None or run.note is not None:
            text = f"FAILED: {run.error}" if run.error is not None else f"NOTE: {run.note}"
            notes.setdefault(text, []).append(f"{run.cell.env}/{run.cell.estimator}/s{run.seed}")
    lines += [f"{text} [{len(cells)} cells: {', '.join(cells)}]" for text, cells in notes.items()]
    for cell, reason in skipped.items():
        lines.append(f"SKIPPED {cell.env}/{cell.estimator}: {reason}")
    lines.append(f"total wall time: {total_s:.0f} s ({total_s / 60:.1f} min)")
    return "\n".join(lines)


# -- main ----------------------------------------------------------------------------------
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", type=int, default=3, help="seeds 0..N-1 per cell")
    ap.add_argument("--steps", type=int, default=None, help="optimizer steps (default 40; --quick 4)")
    ap.add_argument("--eval-every", type=int, default=None, help="held-out evaluation period in steps")
    ap.add_argument("--quick", action="store_true", help="tiny policy and worlds, a few steps (a smoke run)")
    ap.add_argument("--only", choices=sorted({c.env for c in MATRIX}), help="one environment")
    ap.add_argument("--estimators", default=None, help="comma-separated subset of estimators")
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="[SCOPE:]K=V")
    ap.add_argument("--out", type=Path, default=ROOT / "runs" / "bench" / "learning")
    ap.add_argument("--verbose", action="store_true", help="show actor logs")
    args = ap.parse_args(argv)
    args.steps = args.steps or (4 if args.quick else 40)
    args.eval_every = args.eval_every or max(1, args.steps // (2 if args.quick else 8))
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    use_offline_env()
    wanted = set(args.estimators.split(",")) if args.estimators else None
    cells = [c for c in MATRIX if (args.only in (None, c.env)) and (wanted is None or c.estimator in wanted)]
    args.out.mkdir(parents=True, exist_ok=True)
    _ray_up(args.verbose)
    t0, runs, skipped = time.time(), [], {}
    for cell in cells:
        reason = ig_problem(cell, args)
        if reason:
            skipped[cell] = reason
            print(f"SKIP {cell.env}/{cell.estimator}: {reason}", flush=True)
            continue
        for seed in range(args.seeds):
            run = run_cell(cell, seed, args)
            runs.append(run)
            status = run.error or f"final held-out success {run.points[-1].success:.3f}"
            status += f"; NOTE: {run.note}" if run.note else ""
            print(f"{cell.env}/{cell.estimator}/s{seed}: {status} ({run.wall_s:.0f} s)", flush=True)
            if run.error:
                skipped[cell] = f"seed {seed} failed, later seeds not run: {run.error}"
                break
    agg = aggregate(runs)
    write_csv(runs, args.out / "learning.csv")
    if agg:
        plot(agg, args.out / "learning.png")
    text = summary(runs, agg, skipped, time.time() - t0)
    (args.out / "summary.txt").write_text(text + "\n")
    print(f"\n{text}\noutputs: {args.out / 'learning.csv'}, {args.out / 'learning.png'}")
    return 0 if agg else 1


if __name__ == "__main__":
    sys.exit(main())
