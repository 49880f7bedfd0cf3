"""The registered statistics of the credit study (docs/results/credit.md), from its cells' run
directories (``bench/credit.py run``): ``report(out)`` prints the table and writes ``table.txt``,
``curves.png`` and ``per_cell.csv`` under ``out``.

Primary, for each method against GRPO, paired by question: held-out success after the last
step, and the area under the held-out curve (evaluations every ``eval.every_steps``, step 0
included, trapezoids over steps divided by the last step); per seed the paired difference with
its bootstrap interval over questions, pooled the hierarchical bootstrap (seeds, then
questions) and the sign test across seeds. Secondary: steps to reach the warm start + 0.15,
success per hop count, the share of groups without signal per step (outcome and the method's
own), searches per episode and the share of queries naming the right entity.
"""

from __future__ import annotations

import csv
import json
import math
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from cluster.paired_bootstrap import bootstrap_mean_ci, hierarchical_bootstrap, sign_test  # noqa: E402

BASELINE = "grpo"
GAIN = 0.15
"""Secondary: steps until held-out success first reaches the warm start's plus this."""
RESAMPLES = 2000


@dataclass
class CellResult:
    method: str
    seed: int
    run_dir: Path
    evals: dict[int, dict[str, dict[str, Any]]]
    """Step -> task id -> its row (``RolloutWorker.score_task``); the last record of a step wins."""
    metrics: list[dict[str, Any]] = field(default_factory=list)
    info: dict[str, Any] = field(default_factory=dict)

    @property
    def last_step(self) -> int:
        return max(self.evals)

    def success(self, step: int) -> dict[str, float]:
        return {tid: float(row["success"]) for tid, row in self.evals[step].items()}

    def auc(self) -> dict[str, float]:
        """Per question: the area under its held-out curve over steps, divided by the last step."""
        steps = sorted(self.evals)
        tasks = set.intersection(*(set(self.evals[s]) for s in steps))
        span = max(steps[-1] - steps[0], 1)
        return {t: float(np.trapezoid([self.evals[s][t]["success"] for s in steps], steps)) / span for t in tasks}

    def mean_metric(self, step: int, name: str) -> float:
        values = [row["metrics"][name] for row in self.evals[step].values() if name in row.get("metrics", {})]
        return float(np.mean(values)) if values else math.nan

    def steps_to_gain(self, gain: float = GAIN) -> int | None:
        """The first evaluated step whose mean success is at least step 0's plus ``gain``."""
        base = np.mean(list(self.success(0).values()))
        return next((s for s in sorted(self.evals) if s > 0 and np.mean(list(self.success(s).values())) >= base + gain),
                    None)

    def signal_shares(self) -> tuple[float, float]:
        """Mean over trained steps of (groups without outcome signal, groups without the method's)."""
        def mean(key: str) -> float:
            values = [r[key] for r in self.metrics if key in r]
            return float(np.mean(values)) if values else math.nan

        return mean("groups/no_outcome_signal"), mean("groups/no_signal")


def load_cells(out: Path) -> list[CellResult]:
    """Every cell of ``out`` whose command ended well, in (method, seed) order; cells set aside
    for running loaded (``<cell>.loaded-<n>``) are not read."""
    from bench.credit import cells_dir, is_done

    found = []
    for run_dir in sorted(p for p in cells_dir(out).glob("*-s*[0-9]") if p.is_dir() and is_done(p)
                          and ".loaded-" not in p.name):
        info = json.loads((run_dir / "cell.json").read_text())
        if info.get("tag"):  # a tuning cell (``bench/credit.py tune``): not part of the comparison
            continue
        evals: dict[int, dict[str, dict[str, Any]]] = {}
        for line in (run_dir / "evals.jsonl").read_text().splitlines():
            record = json.loads(line)
            evals[int(record["step"])] = {row["task_id"]: row for row in record["rows"]}
        metrics_file = run_dir / "metrics.jsonl"
        metrics = [json.loads(x) for x in metrics_file.read_text().splitlines() if x] if metrics_file.exists() else []
        found.append(CellResult(info["method"], int(info["seed"]), run_dir, evals, metrics, info))
    return sorted(found, key=lambda c: (c.method != BASELINE, c.method, c.seed))


def task_hops(cell: CellResult) -> dict[str, int | None]:
    """Task id -> hop count, from the environment the cell's run was configured with."""
    from cluster.config import RunConfig
    from envs.registry import make_task_source

    cfg = RunConfig.model_validate_json((cell.run_dir / "config.json").read_text())
    return {t.task_id: t.metadata.get("hops") for t in make_task_source(cfg.env).tasks("heldout")}


@dataclass
class Comparison:
    """One method against the baseline on one measure (per-question values)."""

    method: str
    measure: str
    per_seed: dict[int, tuple[float, float, float]]
    """Seed -> (mean paired difference, bootstrap 95% interval over questions)."""
    pooled: tuple[float, float, float]
    """Hierarchical bootstrap: pooled difference and its 95% interval."""
    sign: tuple[int, int, float]

    def line(self) -> str:
        seeds = "; ".join(f"s{s} {d:+.3f} [{lo:+.3f}, {hi:+.3f}]" for s, (d, lo, hi) in sorted(self.per_seed.items()))
        d, lo, hi = self.pooled
        wins, losses, p = self.sign
        return (f"{self.method:<9}{self.measure:<9} pooled {d:+.3f} [{lo:+.3f}, {hi:+.3f}]  "
                f"sign {wins}+/{losses}- p={p:.3f}  | {seeds}")


def compare(cells: list[CellResult], method: str, measure: str) -> Comparison | None:
    """``method`` against the baseline, seed by seed, on ``measure`` (``final`` or ``auc``)."""
    def values(cell: CellResult) -> dict[str, float]:
        return cell.success(cell.last_step) if measure == "final" else cell.auc()

    base = {c.seed: values(c) for c in cells if c.method == BASELINE}
    diffs: dict[int, np.ndarray] = {}
    for cell in cells:
        if cell.method == method and cell.seed in base:
            mine = values(cell)
            tasks = sorted(set(mine) & set(base[cell.seed]))
            diffs[cell.seed] = np.array([mine[t] - base[cell.seed][t] for t in tasks])
    if not diffs:
        return None
    per_seed = {seed: (float(d.mean()), *bootstrap_mean_ci(d, RESAMPLES, seed=seed)) for seed, d in diffs.items()}
    pooled = hierarchical_bootstrap(list(diffs.values()), RESAMPLES)
    return Comparison(method, measure, per_seed, pooled, sign_test([v[0] for v in per_seed.values()]))


def secondary_rows(cells: list[CellResult], hops: dict[str, int | None]) -> list[dict[str, Any]]:
    """One row per cell: its secondary measures (and its wall time and load)."""
    rows = []
    for c in cells:
        last = c.last_step
        by_hop: dict[Any, list[float]] = {}
        for tid, s in c.success(last).items():
            by_hop.setdefault(hops.get(tid), []).append(s)
        no_outcome, no_signal = c.signal_shares()
        rows.append({
            "method": c.method, "seed": c.seed, "steps": last,
            "success@0": np.mean(list(c.success(0).values())), "success@last": np.mean(list(c.success(last).values())),
            "auc": np.mean(list(c.auc().values())), "steps_to_gain": c.steps_to_gain(),
            **{f"hop{h}": np.mean(v) for h, v in sorted(by_hop.items(), key=lambda kv: str(kv[0]))},
            "no_outcome_signal": no_outcome, "no_signal": no_signal,
            "searches": c.mean_metric(last, "searches"), "query_names_entity": c.mean_metric(last, "query_names_entity"),
            "wall_min": c.info.get("wall_s", math.nan) / 60, "load_mean": c.info.get("load", {}).get("mean", math.nan),
        })
    return rows


def _fmt(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float | np.floating):
        return "nan" if math.isnan(value) else f"{value:.3f}"
    return str(value)


def plot_curves(cells: list[CellResult], path: Path) -> None:
    """Held-out success against step per method: mean over seeds with a 95% t-interval band."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from scipy import stats

    fig, ax = plt.subplots(figsize=(6.5, 4))
    for method in dict.fromkeys(c.method for c in cells):
        runs = [c for c in cells if c.method == method]
        steps = sorted(set.intersection(*(set(c.evals) for c in runs)))
        means = np.array([[np.mean(list(c.success(s).values())) for s in steps] for c in runs])
        mean = means.mean(axis=0)
        ax.plot(steps, mean, marker="o", label=f"{method} (n={len(runs)})")
        if len(runs) > 1:
            half = stats.t.ppf(0.975, len(runs) - 1) * means.std(axis=0, ddof=1) / math.sqrt(len(runs))
            ax.fill_between(steps, mean - half, mean + half, alpha=0.15)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("held-out success")
    ax.set_title("multi-hop search QA, SmolLM2-135M: mean over seeds, 95% t-interval")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def report(out: Path) -> str:
    cells = load_cells(out)
    if not cells:
        return f"no finished cells under {out}/cells (bench/credit.py run writes them)"
    hops = task_hops(cells[0])
    lines = ["primary: method - grpo, paired by question (per seed: bootstrap over questions; pooled: "
             "seeds then questions; sign test across seeds)"]
    for method in dict.fromkeys(c.method for c in cells if c.method != BASELINE):
        lines += [cmp.line() for m in ("final", "auc") if (cmp := compare(cells, method, m)) is not None]
    rows = secondary_rows(cells, hops)
    keys = list(dict.fromkeys(k for r in rows for k in r))
    lines += ["", "per cell:", "  ".join(keys)]
    lines += ["  ".join(_fmt(r.get(k)) for k in keys) for r in rows]
    with (out / "per_cell.csv").open("w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=keys)
        writer.writeheader()
        writer.writerows(rows)
    plot_curves(cells, out / "curves.png")
    lines.append(f"\nwritten: {out / 'table.txt'}, {out / 'per_cell.csv'}, {out / 'curves.png'}")
    text = "\n".join(lines)
    (out / "table.txt").write_text(text + "\n")
    return text
