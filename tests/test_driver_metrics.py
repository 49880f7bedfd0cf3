"""The driver's per-step metrics: deltas of the engines' and rollouts' cumulative counters."""

from __future__ import annotations

from cluster.driver import _decode_steps, _rates


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


def test_generation_rates_count_from_the_mark_over_the_seconds_they_report() -> None:
    """The first call is the mark made when training starts: the 5000 tokens of the held-out
    evaluation before it (and the 100 s the run took to get there) count for no step."""
    last: dict[str, float] = {}
    mark = _rates(tokens=5000, episodes=0, now=100.0, last=last)
    assert mark["throughput/gen_tokens"] == 0
    first = _rates(tokens=8094, episodes=12, now=332.0, last=last)
    # 3094 tokens in the 232 s since the mark (not 8094 over one second)
    assert first == {"throughput/gen_tokens": 3094, "throughput/interval_s": 232.0,
                     "throughput/gen_tokens_per_s": 3094 / 232.0, "throughput/episodes_per_s": 12 / 232.0}
    # an evaluation between steps generates 700 tokens; the driver marks again after it
    _rates(tokens=8794, episodes=12, now=340.0, last=last)
    second = _rates(tokens=9794, episodes=16, now=350.0, last=last)
    assert second == {"throughput/gen_tokens": 1000, "throughput/interval_s": 10.0,
                      "throughput/gen_tokens_per_s": 100.0, "throughput/episodes_per_s": 0.4}
