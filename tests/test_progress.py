"""The run's curves: rolling means and the PNG written at the end of a run."""

from __future__ import annotations

import json
import math
import struct

from cluster.progress import plot_curves, rolling_mean


def test_rolling_mean_skips_nan_and_starts_short() -> None:
    out = rolling_mean([1.0, math.nan, 3.0, 5.0, math.nan, math.nan, math.nan], 3)
    # windows: [1], [1, nan], [1, nan, 3], [nan, 3, 5], [3, 5, nan], [5, nan, nan], [nan x 3]
    assert out[:6] == [1.0, 1.0, 2.0, 4.0, 4.0, 5.0] and math.isnan(out[6])


def test_curves_png_has_three_panels_from_the_metrics(tmp_path) -> None:
    rows = [{"step": i + 1, "samples": 32, "rollout/success_rate": i / 20, "reward/outcome_mean": i / 20,
             "rollout/turns_mean": 1.5 + i / 40, "rollout/invalid_rate": 0.1} for i in range(20)]
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text("".join(json.dumps(r) + "\n" for r in rows))
    png = plot_curves(metrics, tmp_path / "curves.png", [(0.0, 0.2), (640.0, 0.4)])
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = struct.unpack(">II", data[16:24])
    assert (width, height) == (1650, 418)  # 15 x 3.8 inches at 110 dpi: three panels side by side
