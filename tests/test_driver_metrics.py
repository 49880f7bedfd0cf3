"""The driver's per-step metrics (cluster/rates.py): growth of the engines' and rollouts'
cumulative counters, per actor, from the mark made when training starts."""

from __future__ import annotations

from cluster.rates import decode_steps, rates


def test_decode_steps_are_per_step_deltas_summed_over_engines() -> None:
    last: dict = {}
    first = decode_steps({0: {"forwards": 10, "forward_rows": 80, "decode_s": 1.5, "prefill_tokens": 300,
                              "prefix_stale_reused_tokens": 40},
                          1: {"forwards": 5, "forward_rows": 10, "decode_s": 0.5}}, last)
    assert first == {"engine/decode_steps": 15, "engine/rows_per_decode_step": 6.0, "engine/busy_s": 2.0,
                     "engine/prefill_tokens": 300.0, "engine/stale_kv_tokens": 40.0}
    second = decode_steps({0: {"forwards": 14, "forward_rows": 100, "decode_s": 1.75, "prefill_tokens": 350,
                               "prefix_stale_reused_tokens": 40},
                           1: {"forwards": 9, "forward_rows": 30, "decode_s": 1.0}}, last)
    assert second == {"engine/decode_steps": 8, "engine/rows_per_decode_step": 5.0,  # 40 rows / 8 steps
                      "engine/busy_s": 0.75, "engine/prefill_tokens": 50.0, "engine/stale_kv_tokens": 0.0}
    idle = decode_steps({0: {"forwards": 14, "forward_rows": 100, "decode_s": 1.75, "prefill_tokens": 350,
                             "prefix_stale_reused_tokens": 40},
                         1: {"forwards": 9, "forward_rows": 30, "decode_s": 1.0}}, last)
    assert idle == {"engine/decode_steps": 0, "engine/rows_per_decode_step": 0.0, "engine/busy_s": 0.0,
                    "engine/prefill_tokens": 0.0, "engine/stale_kv_tokens": 0.0}


def test_generation_rates_count_from_the_mark_over_the_seconds_they_report() -> None:
    """The first call is the mark made when training starts: the 5000 tokens of the held-out
    evaluation before it (and the 100 s the run took to get there) count for no step."""
    last: dict = {}
    mark = rates({0: 5000}, {0: 0}, now=100.0, last=last)
    assert mark["throughput/gen_tokens"] == 0
    first = rates({0: 8094}, {0: 12}, now=332.0, last=last)
    # 3094 tokens in the 232 s since the mark (not 8094 over one second)
    assert first == {"throughput/gen_tokens": 3094, "throughput/interval_s": 232.0,
                     "throughput/gen_tokens_per_s": 3094 / 232.0, "throughput/episodes_per_s": 12 / 232.0}
    # an evaluation between steps generates 700 tokens; the driver marks again after it
    last.clear()
    rates({0: 8794}, {0: 12}, now=340.0, last=last)
    second = rates({0: 9794}, {0: 16}, now=350.0, last=last)
    assert second == {"throughput/gen_tokens": 1000, "throughput/interval_s": 10.0,
                      "throughput/gen_tokens_per_s": 100.0, "throughput/episodes_per_s": 0.4}


def test_a_restarted_or_silent_engine_never_makes_a_rate_negative() -> None:
    """Engine 1 restarts (a new process counts from 0) and engine 0 is silent for a step
    (restarting): each adds only what it generated, never minus its old count."""
    last: dict = {}
    rates({0: 1000, 1: 4000}, {0: 5}, now=0.0, last=last)
    silent = rates({1: 4300}, {0: 6}, now=2.0, last=last)  # engine 0 does not answer
    assert silent["throughput/gen_tokens"] == 300
    restarted = rates({0: 1200, 1: 150}, {0: 8}, now=4.0, last=last)  # engine 1: a new process
    assert restarted["throughput/gen_tokens"] == 200 + 150  # engine 0 since it was last seen, engine 1 anew
    assert restarted["throughput/gen_tokens_per_s"] == 175.0 and restarted["throughput/episodes_per_s"] == 1.0
