"""Bootstrap intervals over tasks: of a success rate, and of a paired difference in success
rates. Pure numpy."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass
class PairedDiff:
    n: int
    before: float
    after: float
    diff: float
    low: float
    high: float
    """95% percentile interval of the mean difference (after - before)."""

    @property
    def excludes_zero(self) -> bool:
        return self.low > 0 or self.high < 0

    def describe(self) -> str:
        verdict = "excludes 0" if self.excludes_zero else "includes 0"
        return (f"held-out success {self.before:.3f} -> {self.after:.3f} on {self.n} tasks; "
                f"diff {self.diff:+.3f}, paired bootstrap 95% CI [{self.low:+.3f}, {self.high:+.3f}] ({verdict})")


def bootstrap_mean_ci(values: np.ndarray, resamples: int = 2000, seed: int = 0) -> tuple[float, float]:
    """95% percentile interval of the mean of ``values`` (one per task), resampling tasks
    with replacement."""
    values = np.asarray(values, float)
    if values.ndim != 1 or len(values) == 0:
        raise ValueError(f"need a non-empty 1-D array of per-task values, got shape {values.shape}")
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, len(values), size=(resamples, len(values)))
    low, high = np.percentile(values[idx].mean(axis=1), [2.5, 97.5])
    return float(low), float(high)


def paired_bootstrap(before: np.ndarray, after: np.ndarray, resamples: int = 2000, seed: int = 0) -> PairedDiff:
    """``before``/``after``: success per task, same task order. Resamples tasks with replacement."""
    before, after = np.asarray(before, float), np.asarray(after, float)
    if before.shape != after.shape or before.ndim != 1 or len(before) == 0:
        raise ValueError(f"need two equal-length 1-D arrays, got {before.shape} and {after.shape}")
    diffs = after - before
    low, high = bootstrap_mean_ci(diffs, resamples, seed)
    return PairedDiff(len(diffs), float(before.mean()), float(after.mean()), float(diffs.mean()), low, high)
