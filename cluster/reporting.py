"""End-of-run report: held-out success before/after with a paired bootstrap, and plots."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable

from cluster.config import RunConfig
from cluster.evaluation import aligned
from cluster.paired_bootstrap import paired_bootstrap
from cluster.progress import plot_curves, read_metrics


def final_report(cfg: RunConfig, run_dir: Path, before: dict[str, float], after: dict[str, float],
                 say: Callable[[str], None]) -> dict[str, Any]:
    b, a = aligned(before, after)
    diff = paired_bootstrap(b, a, cfg.eval.bootstrap_resamples, seed=cfg.train.seed)
    say(diff.describe())
    report = {"tasks": diff.n, "before": diff.before, "after": diff.after, "diff": diff.diff,
              "ci95": [diff.low, diff.high], "excludes_zero": diff.excludes_zero,
              "temperature": cfg.eval.temperature, "samples_per_task": cfg.eval.samples_per_task}
    (run_dir / "eval.json").write_text(json.dumps(report, indent=2))
    # per task, as eval_before.json: per-category or per-task comparisons need both sides
    (run_dir / "eval_after.json").write_text(json.dumps(after))
    metrics = run_dir / "metrics.jsonl"
    if metrics.exists() and metrics.stat().st_size:
        trained = sum(r.get("samples", 0.0) for r in read_metrics(metrics))
        png = plot_curves(metrics, run_dir / "curves.png", [(0.0, diff.before), (trained, diff.after)])
        report["plot"] = str(png)
        say(f"curves: {png}")
    return report
