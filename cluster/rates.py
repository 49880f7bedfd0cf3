"""The driver's per-step rates and levels in metrics.jsonl, from counters the actors keep.

Every counter is cumulative in the actor that keeps it, so a step reports how much each grew
since the previous step. Counting starts at a mark (``mark``): when training starts (after
the held-out evaluation before it) and again after each evaluation between steps, so no step
counts evaluation's tokens or time. Each actor's counter is followed on its own: one that does
not answer (restarting) adds nothing that step and keeps its count; one whose count went down
is a new process (Ray restarted it) counting from zero, so all of its count is new. A rate is
never negative, and one engine's restart never takes another's tokens away.
"""

from __future__ import annotations

import time
from typing import Any

from cluster.telemetry import step_levels


def step_rates(actors: Any, last: dict[str, Any]) -> dict[str, float]:
    """The step's rates and levels: growth of the actors' counters since ``last`` (the
    previous step, or the last ``mark``); ``last`` moves to now."""
    import ray

    stats = _answering([w.stats.remote() for w in actors.rollouts])
    # A shared pool's engines count every tenant's tokens: a run on one counts its own, the
    # action tokens of its finished episodes.
    engines = _answering([e.stats.remote() for e in actors.owned_engines])
    tokens = {i: s["tokens"] for i, s in (engines if actors.pool is None else stats).items()}
    replay = ray.get(actors.replay.stats.remote())
    out = rates(tokens, {i: s["episodes"] for i, s in stats.items()}, time.time(), last)
    out |= step_levels("replay", [replay]) | step_levels("rollout", stats.values())
    if actors.gateway is not None:
        out |= live_metrics(ray.get(actors.gateway.stats.remote()), last, out["throughput/interval_s"])
    if engines and all("forwards" in s for s in engines.values()):  # the HF engine counts its decode steps
        out |= decode_steps(engines, last)
    return out


def mark(actors: Any, last: dict[str, Any]) -> None:
    """Start the next step's counting now: its rates cover only what follows."""
    last.clear()
    step_rates(actors, last)


def grown(last: dict[str, Any], key: str, counts: dict[int, float]) -> float:
    """How much actor ``i``'s counter ``counts[i]`` grew since it was last seen (kept in
    ``last[key]``), summed over the actors that answered."""
    seen = last.setdefault(key, {})
    total = 0.0
    for i, count in counts.items():
        before = seen.get(i, 0.0)
        total += count - before if count >= before else count  # went down: a new process
        seen[i] = count
    return total


def rates(tokens: dict[int, float], episodes: dict[int, float], now: float, last: dict[str, Any]
          ) -> dict[str, float]:
    """Tokens the engines generated and episodes the rollouts finished since ``last`` (per
    actor index), the seconds since, and their rates. An empty ``last`` is the mark counting
    starts from: everything counted so far is behind it."""
    if "t" not in last:
        last["t"] = now
        grown(last, "tokens", tokens)
        grown(last, "episodes", episodes)
    dt = max(now - last["t"], 1e-9)
    gen, done = grown(last, "tokens", tokens), grown(last, "episodes", episodes)
    last["t"] = now
    return {"throughput/gen_tokens": gen, "throughput/interval_s": dt, "throughput/gen_tokens_per_s": gen / dt,
            "throughput/episodes_per_s": done / dt}


def decode_steps(engines: dict[int, dict[str, Any]], last: dict[str, Any]) -> dict[str, float]:
    """Decode steps the engines ran since the last step, their mean rows, the seconds the
    engines spent decoding and the prompt tokens they computed (not reused from a prefix
    cache), summed over engines: fuller steps are cheaper samples; busy time against the
    step's shows whether generation was slow or starved (engines idle while rollouts had
    nothing to send); prefilled tokens show what weight updates cost the prefix cache, and
    stale-KV tokens the prompt tokens reused from an older version's KV (``stale_kv_versions``)."""
    def growth(key: str) -> float:
        return grown(last, f"engine/{key}", {i: float(s.get(key, 0.0)) for i, s in engines.items()})

    steps = growth("forwards")
    return {"engine/decode_steps": steps, "engine/rows_per_decode_step": growth("forward_rows") / max(steps, 1),
            "engine/busy_s": growth("decode_s"), "engine/prefill_tokens": growth("prefill_tokens"),
            "engine/stale_kv_tokens": growth("prefix_stale_reused_tokens")}


def live_metrics(stats: dict[str, Any], last: dict[str, Any], dt: float) -> dict[str, float]:
    """The gateway's counters as per-step rates and levels (the dashboard's live chart)."""
    requests = grown(last, "live/requests", {0: stats["recorder"]["requests"]})
    recorded = grown(last, "live/recorded", {0: stats["episodes"]["recorded"]})
    return {"live/requests_per_s": requests / dt, "live/recorded_per_s": recorded / dt,
            "live/sessions_open": stats["sessions_open"], "live/shed": stats["episodes"]["shed"],
            "live/feedback": stats["feedback"]["received"], "live/timed_out": stats["feedback"]["timed_out"]}


def _answering(refs: list[Any]) -> dict[int, dict[str, Any]]:
    """The stats of the actors that answer, by index: one that is restarting (its process
    died; the training loop restarts its work) reports nothing this step."""
    import ray

    out = {}
    for i, ref in enumerate(refs):
        try:
            out[i] = ray.get(ref)
        except ray.exceptions.RayActorError:
            pass
    return out
