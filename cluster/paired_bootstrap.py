"""Bootstrap intervals over tasks: of a success rate, of a paired difference in success
rates, and of a difference pooled over seeds (seeds, then tasks); the sign test across seeds.
Pure numpy (scipy for the binomial test)."""

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


def hierarchical_bootstrap(diffs: list[np.ndarray], resamples: int = 2000,
                           seed: int = 0) -> tuple[float, float, float]:
    """Pooled mean of paired differences over seeds, with a 95% percentile interval that
    resamples seeds with replacement and then tasks within each drawn seed. ``diffs``: one
    array per seed of per-task differences (method - baseline, same seed, same tasks). Both
    sources of variation, which seed ran and which tasks were asked, widen the interval."""
    arrays = [np.asarray(d, float) for d in diffs]
    if not arrays or any(a.ndim != 1 or len(a) == 0 for a in arrays):
        raise ValueError("need one non-empty 1-D array of per-task differences per seed")
    rng = np.random.default_rng(seed)
    means = np.empty(resamples)
    for b in range(resamples):
        drawn = rng.integers(0, len(arrays), size=len(arrays))
        means[b] = np.mean([arrays[s][rng.integers(0, len(arrays[s]), len(arrays[s]))].mean() for s in drawn])
    low, high = np.percentile(means, [2.5, 97.5])
    return float(np.mean([a.mean() for a in arrays])), float(low), float(high)


def sign_test(per_seed: list[float]) -> tuple[int, int, float]:
    """(seeds where the difference is above 0, seeds below, two-sided exact binomial p-value);
    ties (exactly 0) are dropped, as the sign test does."""
    from scipy.stats import binomtest

    wins, losses = sum(d > 0 for d in per_seed), sum(d < 0 for d in per_seed)
    p = binomtest(wins, wins + losses, 0.5).pvalue if wins + losses else 1.0
    return wins, losses, float(p)
