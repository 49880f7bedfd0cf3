"""The run's curves: rolling means and the PNG written at the end of a run."""

from __future__ import annotations

import json
import math
import struct

import pytest

from cluster.progress import plot_curves, rolling_mean


def test_rolling_mean_skips_nan_and_starts_short() -> None:
    out = rolling_mean([1.0, math.nan, 3.0, 5.0, math.nan, math.nan, math.nan], 3)
    # windows: [1], [1, nan], [1, nan, 3], [nan, 3, 5], [3, 5, nan], [5, nan, nan], [nan x 3]
    assert out[:6] == [1.0, 1.0, 2.0, 4.0, 4.0, 5.0] and math.isnan(out[6])


def test_curves_png_has_three_panels_from_the_metrics(tmp_path) -> None:
    import matplotlib.pyplot as plt

    from cluster.progress import curves_figure

    rows = [{"step": i + 1, "samples": 32, "rollout/success_rate": i / 20, "reward/outcome_mean": i / 20,
             "rollout/turns_mean": 1.5 + i / 40, "rollout/invalid_rate": 0.1} for i in range(20)]
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text("".join(json.dumps(r) + "\n" for r in rows))
    png = plot_curves(metrics, tmp_path / "curves.png", [(0.0, 0.2), (640.0, 0.4)])
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = struct.unpack(">II", data[16:24])
    assert (width, height) == (1650, 418)  # 15 x 3.8 inches at 110 dpi: three panels side by side

    fig = curves_figure(rows, [(0.0, 0.2), (640.0, 0.4)], window=10)
    success, reward, behaviour = fig.axes
    assert [ax.get_title() for ax in fig.axes] == ["success", "reward", "behaviour"]
    x = [32.0 * (i + 1) for i in range(20)]  # cumulative trajectories trained
    raw, mean, held_out = success.get_lines()
    assert list(raw.get_xdata()) == x and list(raw.get_ydata()) == [i / 20 for i in range(20)]
    # rolling mean of i/20 over 10 steps: step 20 averages i = 10..19 -> 14.5 / 20
    assert mean.get_ydata()[-1] == pytest.approx(14.5 / 20) and mean.get_ydata()[0] == 0.0
    assert list(held_out.get_xdata()) == [0.0, 640.0] and list(held_out.get_ydata()) == [0.2, 0.4]
    assert list(reward.get_lines()[0].get_ydata()) == [i / 20 for i in range(20)]
    turns, _, invalid, _ = behaviour.get_lines()  # raw and mean per series
    assert turns.get_ydata()[-1] == pytest.approx(1.5 + 19 / 40) and set(invalid.get_ydata()) == {0.1}
    plt.close(fig)


def test_final_report_writes_the_paired_comparison_and_each_side_per_task(tmp_path) -> None:
    from cluster.config import load_config
    from cluster.reporting import final_report

    before, after = {"t1": 0.0, "t2": 1.0, "t3": 0.0}, {"t1": 1.0, "t2": 1.0, "t3": 1.0}
    said: list[str] = []
    report = final_report(load_config(None, []), tmp_path, before, after, said.append)
    assert report["tasks"] == 3 and report["before"] == pytest.approx(1 / 3) and report["after"] == 1.0
    assert json.loads((tmp_path / "eval.json").read_text())["diff"] == pytest.approx(2 / 3)
    assert json.loads((tmp_path / "eval_after.json").read_text()) == after
    assert said and "paired bootstrap 95% CI" in said[0]
