"""cluster/telemetry.py: worker stats as Prometheus families, served per actor process.

Real workers where they are cheap (ReplayHost with the in-process store, RewardService);
the learner's recorder is driven by a stand-in with the learner's train_step contract,
because a DeepSpeed learner is not what is under test here.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from redis_fixture import make_group

from cluster.telemetry import (SPECS, StatsCollector, build_families, instrument, metric_names,
                               publish_metrics_targets, write_targets)


def scrape(endpoint: str) -> dict[str, list]:
    """family name -> samples (name, labels, value), parsed like Prometheus would."""
    text = httpx.get(f"http://{endpoint}/metrics", timeout=5).text
    return {f.name: f.samples for f in text_string_to_metric_families(text)}


def value(samples: list, name: str, **labels: str) -> float:
    hits = [s.value for s in samples if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())]
    assert len(hits) == 1, (name, labels, samples)
    return hits[0]


def test_rollout_stats_map_to_named_families() -> None:
    stats = {"groups": 3, "episodes": 12, "errors": 1, "tokens": 400, "successes": 5, "extra_key": 60.0,
             "version": 2}
    families = {f.name: f for f in build_families("rollout", stats, {"run": "r1", "worker": "0"})}
    eps = families["turnrl_rollout_episodes"]
    assert eps.type == "counter" and eps.samples[0].value == 12
    assert eps.samples[0].labels == {"run": "r1", "worker": "0"}
    assert families["turnrl_rollout_policy_version"].type == "gauge"
    assert "extra_key" not in {s.key for s in SPECS["rollout"]}  # unmapped keys are ignored, not errors


def test_engine_stats_map_to_named_families() -> None:
    stats = {"tokens": 900.0, "batches": 30.0, "rows": 60.0, "decode_s": 4.5, "weight_loads": 2.0,
             "requests": 70.0, "aborted": 1.0, "open_requests": 3.0, "weight_changes_mid_request": 4.0,
             "version": 2.0}
    families = {f.name: f for f in build_families("engine", stats, {"run": "r1"})}
    gen = families["turnrl_engine_generated_tokens"]
    assert gen.type == "counter" and gen.samples[0].value == 900.0
    assert families["turnrl_engine_open_requests"].type == "gauge"
    assert families["turnrl_engine_open_requests"].samples[0].value == 3.0
    assert families["turnrl_engine_requests_spanning_versions"].samples[0].value == 4.0


def test_replay_host_serves_depth_and_staleness_histogram() -> None:
    from replay.config import ReplayConfig
    from replay.host import ReplayHost

    host = instrument(ReplayHost, "replay")(ReplayConfig(), 1, "/tmp", "t-replay")
    # admission with B=1, eta=1: (eta + version + 1) * B - (accepted + running) = 2 at version 0
    assert host.reserve(2) == 2
    for gid in ("g1", "g2"):
        assert host.put(make_group(gid, version=0)).status == "accepted"
    first = host.claim(1)
    host.ack(first.claim_id, 1)  # version 1 now: groups generated at version 0 are 1 behind
    assert host.reserve(1) == 1  # (1 + 1 + 1) * 1 - 2 = 1
    assert host.put(make_group("g3", version=0)).status == "accepted"
    assert host.claim(1).staleness == [1]
    endpoint = host.start_metrics_server("run-a")
    assert host.start_metrics_server("run-a") == endpoint  # idempotent
    fams = scrape(endpoint)
    depth = fams["turnrl_replay_depth_groups"]
    # 3 accepted, 1 trained and acked, 1 claimed and not acked, 1 still ready
    assert value(depth, "turnrl_replay_depth_groups", state="ready", run="run-a") == 1
    assert value(depth, "turnrl_replay_depth_groups", state="claimed") == 1
    assert value(depth, "turnrl_replay_depth_groups", state="retained") == 1  # acked, never committed
    hist = fams["turnrl_replay_staleness_versions"]
    # claimed staleness [0] then [1]: buckets le=0 -> 1, le=1.. -> 2; sum 0+1 = 1; count 2
    assert value(hist, "turnrl_replay_staleness_versions_bucket", le="0.0") == 1
    assert value(hist, "turnrl_replay_staleness_versions_bucket", le="1.0") == 2
    assert value(hist, "turnrl_replay_staleness_versions_bucket", le="+Inf") == 2
    assert value(hist, "turnrl_replay_staleness_versions_sum") == 1
    accepted = fams["turnrl_replay_accepted_groups"]
    assert value(accepted, "turnrl_replay_accepted_groups_total", origin="rollout") == 3
    assert value(accepted, "turnrl_replay_accepted_groups_total", origin="live") == 0
    assert value(fams["turnrl_metrics_errors"], "turnrl_metrics_errors_total") == 0


class Flaky:
    """stats() that fails: the scrape must still answer and count the failure."""

    def __init__(self) -> None:
        self.calls = 0

    def stats(self) -> dict:
        self.calls += 1
        raise RuntimeError("stats exploded")


def test_a_failing_stats_is_counted_never_raised() -> None:
    worker = instrument(Flaky, "rollout")()
    endpoint = worker.start_metrics_server("run-b")
    for expected in (1, 2):
        fams = scrape(endpoint)
        assert value(fams["turnrl_metrics_errors"], "turnrl_metrics_errors_total", run="run-b") == expected
    assert worker.calls == 2 and "turnrl_rollout_episodes" not in fams


class LearnerLike:
    """The learner's contract: train_step() returns that step's metrics dict."""

    def __init__(self) -> None:
        self.steps = [{"samples": 8.0, "time/step_s": 2.0, "time/publish_s": 0.25, "time/wait_s": 0.5,
                       "time/update_s": 1.0, "tokens/trained": 640.0, "reward/outcome_mean": float("nan"),
                       "rollout/success_rate": 0.5, "staleness/mean": 1.0, "version": 1},
                      {"samples": 8.0, "time/step_s": 4.0, "time/publish_s": 0.5, "time/wait_s": 1.0,
                       "time/update_s": 2.0, "tokens/trained": 600.0, "reward/outcome_mean": 0.75,
                       "rollout/success_rate": 0.25, "staleness/mean": 0.0, "version": 2}]

    def train_step(self) -> dict:
        return dict(self.steps.pop(0))


def test_learner_subclass_records_train_step_metrics() -> None:
    learner = instrument(LearnerLike, "learner")()
    assert learner.stats() == {}  # nothing before the first step
    assert learner.train_step()["version"] == 1  # the step's own result is passed through unchanged
    assert "reward" not in learner.stats()  # NaN reward (no outcomes) is not exported
    learner.train_step()
    stats = learner.stats()
    # totals: 2 steps, 8+8 samples, 640+600 tokens, 2+4 s; last step: 8 samples / 4 s = 2 samples/s
    assert stats["steps"] == 2 and stats["samples"] == 16 and stats["trained_tokens"] == 1240
    assert stats["step_s_total"] == pytest.approx(6.0)
    assert stats["samples_per_s"] == pytest.approx(2.0) and stats["publish_s"] == 0.5
    assert stats["reward"] == 0.75 and stats["version"] == 2
    names = {f.name for f in build_families("learner", stats, {"run": "r"})}
    assert {"turnrl_learner_weight_publish_latency_seconds", "turnrl_learner_throughput_samples_per_second",
            "turnrl_learner_step_duration_seconds"} <= names


def test_reward_service_counts_groups_in_flight() -> None:
    from replay.base import PutResult
    from replay.client import StoreOutlet
    from replay.config import ReplayConfig
    from rewards.config import RewardsConfig
    from rewards.service import RewardService

    async def scenario() -> tuple[dict, dict]:
        gate = asyncio.Event()

        async def put_many(groups, scheduled):  # replay that holds the groups until the gate opens
            await gate.wait()
            return [PutResult("accepted") for _ in groups]

        service = instrument(RewardService, "reward")(RewardsConfig(), StoreOutlet(put_many, ReplayConfig()))
        pending = asyncio.ensure_future(service.submit(make_group("g1")))
        for _ in range(100):
            await asyncio.sleep(0)
        during = service.stats()
        gate.set()
        await pending
        return during, service.stats()

    during, after = asyncio.run(scenario())
    assert during["inflight_groups"] == 1 and after["inflight_groups"] == 0
    fams = {f.name: f for f in build_families("reward", after, {"run": "r"})}
    assert fams["turnrl_reward_replay_puts"].samples[0].labels["status"] == "accepted"
    assert fams["turnrl_reward_source_score"].samples[0].labels["source"] == "outcome"


def test_instrumented_class_keeps_name_and_pickles_by_value() -> None:
    import cloudpickle

    from replay.host import ReplayHost

    cls = instrument(ReplayHost, "replay")
    assert cls.__name__ == "ReplayHost" and issubclass(cls, ReplayHost)
    assert not hasattr(ReplayHost, "start_metrics_server")  # the worker class itself is untouched
    assert cloudpickle.loads(cloudpickle.dumps(cls)).__name__ == "ReplayHost"  # what ray.remote does
    with pytest.raises(ValueError, match="known: engine, rollout, reward, replay, learner"):
        instrument(ReplayHost, "replayy")


def test_publish_targets_is_best_effort_and_file_sd_shaped(tmp_path) -> None:
    assert publish_metrics_targets([("replay", object())], tmp_path / "missing" / "dir", "r") is None
    path = write_targets(tmp_path, {"rollout": ["10.0.0.2:9001", "10.0.0.1:9000"], "learner": ["10.0.0.1:9002"]})
    assert json.loads(path.read_text()) == [
        {"targets": ["10.0.0.1:9002"], "labels": {"component": "learner"}},
        {"targets": ["10.0.0.1:9000", "10.0.0.2:9001"], "labels": {"component": "rollout"}},
    ]
    written = path.stat().st_mtime_ns
    write_targets(tmp_path, {"learner": ["10.0.0.1:9002"], "rollout": ["10.0.0.1:9000", "10.0.0.2:9001"]})
    assert path.stat().st_mtime_ns == written  # the same targets: not rewritten (Prometheus re-reads on writes)


@pytest.mark.slow  # Ray in this worker (~5 s)
def test_targets_follow_an_actor_that_ray_started_again(ray_cluster, tmp_path) -> None:
    """Killed and started again by Ray, an actor serves its metrics from a new process on a new
    port; the refresh writes the new endpoint into the targets file, and it answers."""
    import time

    from cluster.telemetry import TargetsRefresh

    class Quiet:  # defined here, so Ray's workers get it by value: nothing to report but its endpoint
        def stats(self) -> dict:
            return {}

    ray = ray_cluster
    actor = ray.remote(num_cpus=0, max_restarts=1)(instrument(Quiet, "rollout")).remote()
    path = publish_metrics_targets([("rollout", actor)], tmp_path, "run-r")
    first = json.loads(path.read_text())[0]["targets"]
    refresh = TargetsRefresh(lambda: [("rollout", actor)], tmp_path, "run-r", every_s=0.5)
    try:
        ray.kill(actor, no_restart=False)
        deadline = time.monotonic() + 60
        while json.loads(path.read_text())[0]["targets"] == first:
            assert time.monotonic() < deadline, "the targets file still names the dead process's endpoint"
            time.sleep(0.2)
    finally:
        refresh.stop()
    (now,) = json.loads(path.read_text())[0]["targets"]
    assert "turnrl_metrics_errors" in scrape(now)  # the new process's server answers
    ray.kill(actor)


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool (Debian package prometheus) not installed")
def test_exposition_passes_promtool_lint() -> None:
    from prometheus_client import CollectorRegistry, generate_latest

    samples = {
        "rollout": {"engine_tokens": 5, "episodes": 2, "groups": 1, "errors": 0, "tokens": 9, "successes": 1,
                    "engine_decode_s": 1.0, "engine_batches": 3, "engine_weight_loads": 1, "version": 1},
        "reward": {"groups": 1, "trajectories": 2, "missing": {"ig": 1}, "score_s": 0.1, "put": {"accepted": 1},
                   "outcome_sum": 1.0, "queue_groups": 0, "judge_queue_turns": 0, "inflight_groups": 0},
        "replay": {"ready": 1, "claimed": 0, "running": 2, "bytes": 10, "accepted": 3, "trained": 1,
                   "refused": {"stale": 1}, "evicted": {}, "version": 1, "staleness_hist": {0: 1, 2: 1}},
        "learner": LearnerLike().steps[1] | {"steps": 1, "samples": 8, "step_s": 1.0, "samples_per_s": 8.0},
    }
    for component, stats in samples.items():
        registry = CollectorRegistry()
        registry.register(StatsCollector(type("S", (), {"stats": lambda self, s=stats: s})(), component, {"run": "r"}))
        text = generate_latest(registry).decode()
        out = subprocess.run(["promtool", "check", "metrics"], input=text, capture_output=True, text=True)
        assert out.returncode == 0, f"{component}: {out.stdout}{out.stderr}"
        exported = {f.name for f in text_string_to_metric_families(text)}
        assert all(name.startswith(f"turnrl_{component}_") or name == "turnrl_metrics_errors" for name in exported)
    assert "turnrl_learner_steps_total" in metric_names()


def test_step_levels_read_the_same_table_as_the_endpoint() -> None:
    """metrics.jsonl's levels (cluster/rates.py) come from SPECS' ``step`` names: a breakdown
    summed over its rows, a rollout counter summed over the workers that answered."""
    from cluster.telemetry import step_levels
    from replay.base import ReplayStats

    replay = ReplayStats(ready=3, running=2, refused={"stale": 1, "full": 4}, evicted={"stale": 2})
    assert step_levels("replay", [replay]) == {"replay/ready": 3, "replay/running": 2, "replay/refused": 5,
                                              "replay/evicted": 2}
    assert step_levels("rollout", [{"dropped": 1}, {"dropped": 2}, {}]) == {"rollout/dropped_groups": 3}
    names = {f.name for f in build_families("rollout", {"dropped": 3}, {"run": "r"})}
    assert names == {"turnrl_rollout_dropped_groups"}
