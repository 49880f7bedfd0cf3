"""The driver's per-step engine metrics: deltas of the engines' cumulative counters."""

from __future__ import annotations

from cluster.driver import _decode_steps


def test_decode_steps_are_per_step_deltas_summed_over_engines() -> None:
    last: dict[str, float] = {}
    first = _decode_steps([{"forwards": 10, "forward_rows": 80, "decode_s": 1.5, "prefill_tokens": 300},
                           {"forwards": 5, "forward_rows": 10, "decode_s": 0.5}], last)
    assert first == {"engine/decode_steps": 15, "engine/rows_per_decode_step": 6.0, "engine/busy_s": 2.0,
                     "engine/prefill_tokens": 300.0}
    second = _decode_steps([{"forwards": 14, "forward_rows": 100, "decode_s": 1.75, "prefill_tokens": 350},
                            {"forwards": 9, "forward_rows": 30, "decode_s": 1.0}], last)
    assert second == {"engine/decode_steps": 8, "engine/rows_per_decode_step": 5.0,  # 40 rows / 8 steps
                      "engine/busy_s": 0.75, "engine/prefill_tokens": 50.0}
    idle = _decode_steps([{"forwards": 14, "forward_rows": 100, "decode_s": 1.75, "prefill_tokens": 350},
                          {"forwards": 9, "forward_rows": 30, "decode_s": 1.0}], last)
    assert idle == {"engine/decode_steps": 0, "engine/rows_per_decode_step": 0.0, "engine/busy_s": 0.0,
                    "engine/prefill_tokens": 0.0}
