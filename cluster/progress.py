"""Progress you can see: a live bar, a JSONL metrics log and curves as a PNG."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any


class RunMonitor:
    """Writes every step's metrics to ``metrics.jsonl`` and shows them on a bar or log line."""

    def __init__(self, run_dir: Path, total_steps: int, mode: str, initial: int = 0) -> None:
        from tqdm import tqdm

        self.path = run_dir / "metrics.jsonl"
        self.mode = mode
        self.t0 = time.time()
        self.samples = 0.0
        self.bar = tqdm(total=total_steps, initial=initial, desc="train", unit="step",
                        dynamic_ncols=True, disable=mode != "bar")
        self._fh = self.path.open("a")

    def update(self, metrics: dict[str, Any]) -> None:
        elapsed = time.time() - self.t0
        self.samples += metrics.get("samples", 0.0)
        metrics = {**metrics, "time/elapsed_s": elapsed, "throughput/samples_per_s": self.samples / max(elapsed, 1e-9)}
        self._fh.write(json.dumps(metrics, default=float) + "\n")
        self._fh.flush()
        view = {
            "reward": metrics.get("reward/outcome_mean", math.nan),
            "succ": metrics.get("rollout/success_rate", math.nan),
            "smp/s": metrics["throughput/samples_per_s"],
            "tok/s": metrics.get("throughput/gen_tokens_per_s", math.nan),
            "stale": metrics.get("staleness/mean", math.nan),
        }
        text = " ".join(f"{k}={v:.3g}" for k, v in view.items())
        if self.mode == "bar":
            self.bar.set_postfix_str(f"v{metrics.get('version', 0)} {text}")
            self.bar.update(1)
        elif self.mode == "log":
            print(f"step {metrics.get('step')}: {text}", flush=True)

    def rewind(self, step: int) -> None:
        """Forget the steps after ``step`` (a learner restarted from that checkpoint trains
        them again)."""
        from learner.run_files import keep_steps_through

        self._fh.close()
        keep_steps_through(self.path, step)
        self._fh = self.path.open("a")
        self.bar.n = step
        self.bar.refresh()

    def close(self) -> None:
        self.bar.close()
        self._fh.close()


def read_metrics(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def rolling_mean(values: list[float], window: int) -> list[float]:
    """Mean of each value and up to ``window - 1`` before it, NaNs skipped (NaN if all are)."""
    out = []
    for i in range(len(values)):
        part = [v for v in values[max(0, i - window + 1): i + 1] if not math.isnan(v)]
        out.append(sum(part) / len(part) if part else math.nan)
    return out


_PANELS = (  # (title, [(metrics key, label)], y label)
    ("success", [("rollout/success_rate", "training success")], "rate"),
    ("reward", [("reward/outcome_mean", "mean outcome reward")], "reward"),
    ("behaviour", [("rollout/turns_mean", "turns per episode"),
                   ("rollout/invalid_rate", "invalid-action rate")], "per episode / rate"),
)


def plot_curves(metrics_path: Path, out_png: Path, eval_points: list[tuple[float, float]] = (),
                window: int = 10) -> Path:
    """``curves_figure`` of the metrics log, saved as a PNG."""
    import matplotlib.pyplot as plt

    fig = curves_figure(read_metrics(metrics_path), eval_points, window)
    fig.savefig(out_png, dpi=110)
    plt.close(fig)
    return out_png


def curves_figure(rows: list[dict[str, Any]], eval_points: list[tuple[float, float]] = (),
                  window: int = 10) -> Any:
    """Per-step training metrics (faint) with their ``window``-step rolling mean against
    trajectories trained; held-out points (samples, success) as markers on the first panel."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    samples, acc = [], 0.0
    for r in rows:
        acc += r.get("samples", 0.0)
        samples.append(acc)
    fig, axes = plt.subplots(1, len(_PANELS), figsize=(15, 3.8))
    for ax, (title, series, ylabel) in zip(axes, _PANELS):
        for i, (key, label) in enumerate(series):
            color = f"C{i}"
            values = [float(r.get(key, math.nan)) for r in rows]
            ax.plot(samples, values, color=color, alpha=0.25, linewidth=0.8)
            ax.plot(samples, rolling_mean(values, window), color=color, linewidth=2,
                    label=f"{label} ({window}-step mean)")
        ax.set(title=title, xlabel="trajectories trained", ylabel=ylabel)
        ax.grid(alpha=0.3)
    if eval_points:
        xs, ys = zip(*eval_points)
        axes[0].plot(xs, ys, "s--", color="tab:red", label="held-out success")
    for ax in axes:
        ax.legend(loc="best", fontsize=8)
    fig.tight_layout()
    return fig
