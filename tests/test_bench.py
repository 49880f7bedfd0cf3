"""Every benchmark command docs/running.md lists runs: the quick ones end to end in a subprocess,
the ones that train (minutes) up to their configs and task splits, where
``bench/pipeline.py --quick`` used to fail ("300 held-out tasks requested but the world has
only 225 1-hop questions")."""

from __future__ import annotations

import importlib.util
import math
import re
import subprocess
import sys
from pathlib import Path

import pytest
from redis_fixture import HAVE_REDIS

ROOT = Path(__file__).resolve().parents[1]


def _bench(name: str):
    spec = importlib.util.spec_from_file_location(f"bench_{name}", ROOT / "bench" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def _splits_build(cfg) -> None:
    """What a run does first with its config: the task splits of its env and of its SFT env."""
    from envs.registry import make_task_source
    from learner.bootstrap import demo_env_config

    assert len(make_task_source(cfg.env).tasks("heldout")) == cfg.env.num_heldout_tasks
    demo_env = demo_env_config(cfg.policy, cfg.env)
    if demo_env is not None:  # the warm start takes its first num_demos training tasks: they exist
        assert len(make_task_source(demo_env).tasks("train")) >= cfg.policy.sft.num_demos


# Cheaper still than --quick where a part repeats what another test checks: the engines bench
# measures weight updates on the HF engine alone (the same harness; every transport into vLLM
# is checked by tests/test_engine_service.py, the object store's by tests/test_weight_transport.py).
QUICKER = {"engines": ["--updates-on", "hf"]}


@pytest.mark.slow
@pytest.mark.parametrize("script, needle", [("envs", "search step p50"), ("ig", "max |v - v_ref|"),
                                            ("replay", "replay -> learner] as models"),
                                            ("codec_floor", "codec / list floor"),
                                            ("serving", "p99 ratio (publishes / none)"),
                                            ("engines", "ratio vLLM engine/generate"),
                                            ("prefix_cache", "cache on / off speed"),
                                            ("kv_cache", "speed-up"),
                                            ("group_prefill", "grouped / distinct"),
                                            ("learner", "ratio learner/plain"),
                                            ("sft", "shared prefix + cuts"),
                                            ("stream_parse", "incremental / re-scan time (worst format)"),
                                            ("adapters", "time ratio"),
                                            ("pool_fused", "vs one by one")])
def test_quick_benchmark_runs(script: str, needle: str) -> None:
    if script == "replay" and not HAVE_REDIS:
        pytest.skip("redis-server not installed")
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / f"{script}.py"), "--quick", *QUICKER.get(script, [])],
                          capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert needle in proc.stdout
    if script != "kv_cache":  # its needle heads a table; the rows below hold the numbers
        value = _number_after(proc.stdout, needle)
        assert math.isfinite(value) and value >= 0, f"{needle!r} line: {value}"
    if script == "engines":  # part 4's harness ran on the HF engine, every transport measured
        rows = [line.split("MB")[0].split() for line in proc.stdout.splitlines() if line.startswith("   HF engine ")]
        assert [row[2:-1] for row in rows] == [["memory", "copy"], ["memory"], ["ray", "object", "store"],
                                               ["file", "(/dev/shm)"], ["gloo", "broadcast"]], proc.stdout[-2000:]
    if script == "serving":  # every request of both phases answered: the failed column is 0
        rows = [line.split() for line in proc.stdout.splitlines()
                if line.startswith(("no publishes", "publishes"))]
        assert len(rows) == 2 and all(row[-5] == "0" for row in rows), proc.stdout[-2000:]
        assert "failed:" not in proc.stdout


def _number_after(stdout: str, needle: str) -> float:
    """The first number printed after ``needle`` on its line."""
    line = next(line for line in stdout.splitlines() if needle in line)
    match = re.search(r"[-+]?\d+(?:\.\d+)?(?:e[-+]?\d+)?", line.split(needle, 1)[1])
    assert match, f"no number after {needle!r} in {line!r}"
    return float(match.group())


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_pipeline_quick_configs_build(mode: str) -> None:
    pipeline = _bench("pipeline")
    cfg = pipeline.mode_config(pipeline.DEMO, pipeline.QUICK, mode, steps=8)
    assert cfg.train.async_ == (mode == "async") and cfg.env.num_entities == 80
    _splits_build(cfg)


def test_learning_quick_cells_build() -> None:
    from cluster.config import load_config

    learning = _bench("learning")
    args = learning.parse_args(["--quick"])
    for cell in learning.MATRIX:
        _splits_build(load_config(None, learning.cell_overrides(cell, 0, args)))


def test_warm_start_demo_config_builds() -> None:
    from cluster.config import load_config

    _splits_build(load_config(str(ROOT / "configs" / "demo.yaml"), []))


def test_pipeline_puts_the_glue_on_the_side_named() -> None:
    """Generation and training keep their halves of the cores either way; Ray, the driver and
    the services (cluster.cpu_affinity) follow the side named, or the services alone go with
    the learner (split), and the config loads."""
    import os

    from cluster.config import load_config

    pipeline = _bench("pipeline")
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        pytest.skip("a core split needs two cores")
    gen, train = str(cores[: len(cores) // 2]), str(cores[len(cores) // 2:])
    glues = ("learner", "generation", "split")
    split = {glue: dict(o.split("=", 1) for o in pipeline.core_split(glue, cores)) for glue in glues}
    assert split["learner"]["cluster.cpu_affinity"] == train and split["generation"]["cluster.cpu_affinity"] == gen
    # split: Ray and the driver with generation, the services with the learner
    assert (split["split"]["cluster.cpu_affinity"], split["split"]["cluster.services_cpu_affinity"]) == (gen, train)
    assert "cluster.services_cpu_affinity" not in split["learner"] | split["generation"]
    for side in split.values():
        assert (side["rollout.engine.cpu_affinity"], side["rollout.cpu_affinity"], side["learner.cpu_affinity"]) == (
            gen, gen, train)
    cfg = load_config(pipeline.DEMO, pipeline.QUICK + pipeline.core_split("split", cores))
    assert (cfg.cluster.cpu_affinity, cfg.cluster.services_cpu_affinity) == (cores[: len(cores) // 2],
                                                                             cores[len(cores) // 2:])


def test_pipeline_runs_async_two_batches_deep_on_any_config() -> None:
    pipeline = _bench("pipeline")
    assert pipeline.pipeline_depth(pipeline.DEMO, [], 2) == ["replay.eta=2", "rollout.groups_in_flight=8"]
    # a batch's groups are shared among the rollout actors: each keeps its share in flight
    two = pipeline.pipeline_depth(pipeline.DEMO, ["rollout.num_workers=2"], 3)
    assert two == ["replay.eta=3", "rollout.groups_in_flight=6"]
    cfg = pipeline.mode_config(pipeline.DEMO, pipeline.pipeline_depth(pipeline.DEMO, [], 2), "async", steps=8)
    assert (cfg.replay.eta, cfg.rollout.groups_in_flight) == (2, 8)


def test_pipeline_reports_each_pair_and_their_median(capsys) -> None:
    pipeline = _bench("pipeline")
    sync = {"samples_per_s": 40.0, "all_samples_per_s": 36.0, "train_s": 20.0, "g": 0.4, "t": 0.5, "step": 0.9,
            "width": 200.0, "turns": 1.5, "decode_steps": 60.0, "rows": 15.0, "busy": 0.35,
            "prefilled": 900.0, "stale": 40.0}
    ratio, ideal, share = pipeline.share_of_ideal(sync, {**sync, "samples_per_s": 64.8})
    assert (round(ratio, 3), round(ideal, 3), round(share, 3)) == (1.62, 1.8, 0.9)
    pairs = [{"sync": sync, "async": {**sync, "samples_per_s": 40.0 * 1.8 * s, "step": 0.5}} for s in (0.8, 1.0, 0.95)]
    pipeline.print_pairs(pairs)
    out = capsys.readouterr().out
    assert "share of ideal, median of 3 alternated pair(s): 0.95 (goal >= 0.9; pairs 0.80 1.00 0.95)" in out
    assert out.count("\n1    sync") == 1 and "3    async" in out
    assert out.count("       900       40\n") == 6  # prefilled, then stale kv, on each of the 6 rows


@pytest.mark.slow
def test_contention_quick_prints_each_workloads_slowdown() -> None:
    # One round on whatever else the machine runs: the slowdowns are printed, not held to the
    # goal here (docs/results/contention.md holds the measured series).
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "contention.py"), "--quick"],
                          capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = {line.split()[0]: line.split() for line in proc.stdout.splitlines()
            if line.split() and line.split()[0] in ("sft", "learner", "hf")}
    assert set(rows) == {"sft", "learner", "hf"}, proc.stdout
    for name, row in rows.items():
        alone, busy, slowdown = float(row[1]), float(row[2]), float(row[3].rstrip("x"))
        assert alone > 0 and busy > 0 and slowdown == pytest.approx(alone / busy, rel=0.02), row
    assert "worst slowdown" in proc.stdout and "(goal <= 3x)" in proc.stdout


@pytest.mark.slow
def test_scale_fanout_quick_pushes_every_version_to_every_engine() -> None:
    # bench/scale.py: synthetic engines (one Ray actor each) behind the real EngineServer, the
    # run's WeightSync actor and the learner's publishers: every transport, 1 and 4 engines
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "scale.py"), "fanout", "--quick"],
                          capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    table = proc.stdout.split("engine start")[0].rsplit("bad sums", 1)[1]
    rows = [line.split() for line in table.splitlines() if line.strip()]
    assert [(r[0], r[1]) for r in rows] == [(t, n) for n in ("1", "4")
                                            for t in ("object_store", "file", "adapter", "broadcast")]
    assert all(r[-1] == "0" and float(r[3]) > 0 for r in rows), table  # no bad checksum; a push took time
    assert "every engine read every version it was pushed" in proc.stdout


@pytest.mark.slow
def test_scale_replay_quick_trains_what_the_producers_put() -> None:
    # bench/scale.py replay: the real ReplayHost actor, producer actors admitted and putting
    # groups, a learner actor claiming and acknowledging; versions advance
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "scale.py"), "replay", "--quick"],
                          capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [line.split() for line in proc.stdout.split("reserve p50 ms")[1].splitlines()[1:] if line.strip()]
    assert [(r[0], r[1]) for r in rows] == [("inproc", "1"), ("inproc", "4")]
    assert all(float(r[2]) > 0 and int(r[4]) > 0 for r in rows), proc.stdout  # trained/s, versions


@pytest.mark.slow
def test_scale_service_quick_queues_past_max_running_and_stops_every_run() -> None:
    # bench/scale.py service: the run service over HTTP with its own Ray head, jobs.max_running 1:
    # one run starts, four wait queued; every run stopped ends stopped
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "scale.py"), "service", "--quick"],
                          capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "'queued': 4" in proc.stdout and "{'stopped': 5}" in proc.stdout


@pytest.mark.slow
def test_learner_memory_quick_compares_the_chunked_head_with_whole_logits_and_checkpointing() -> None:
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "learner.py"), "--memory", "--quick"],
                          capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    variants = ("chunked", "whole", "checkpointed")
    peaks = {line.split()[0]: float(line.split()[4]) for line in proc.stdout.splitlines()  # the peak / ideal column
             if line.split() and line.split()[0] in variants}
    assert set(peaks) == set(variants) and all(v > 0 for v in peaks.values()), proc.stdout
    assert "peak chunked/whole" in proc.stdout and "checkpointed/chunked: peak" in proc.stdout


@pytest.fixture(scope="module")
def live_load(tmp_path_factory) -> dict:
    """One run of bench/live_load.py --quick (a real run trained on live traffic only, two
    engines, Redis replay) driven by AsyncOpenAI sessions at 1 and 4 at once, then serving 4
    while engine 0, the learner and redis-server are killed with -9 in turn: its report."""
    import json

    if not HAVE_REDIS:
        pytest.skip("redis-server not installed")
    out = tmp_path_factory.mktemp("live_load")
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "live_load.py"), "--quick", "--engines", "2",
                           "--replay", "redis", "--fault", "engine,learner,redis", "--out", str(out)],
                          capture_output=True, text=True, timeout=1800, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads((out / "live_load.json").read_text())


@pytest.mark.slow
def test_live_load_quick_accounts_for_every_answered_session(live_load) -> None:
    # every session answered, at each level and through each fault, is in the run's record with its fate
    books = live_load["accounting"]
    assert [r["sessions"] for r in live_load["levels"][:2]] == [1, 4]
    assert all(r["requests_ok"] > 0 and not r["errors"] for r in live_load["levels"][:2]), live_load["levels"]
    assert books["lost_n"] == 0 and books["turns_differ_n"] == 0 and books["client_200"] == books["gateway_200"] > 0
    assert books["recorded"] >= 1 and books["recorded"] + sum(books["counted"].values()) == books["segments"]
    assert books["steps"] >= 1 and books["run_exit"] == 130


@pytest.fixture(scope="module")
def faults_under_load(live_load) -> dict:
    return {r["tag"].removeprefix("fault-"): r for r in live_load["levels"] if r["tag"].startswith("fault-")}


@pytest.mark.slow
def test_an_engine_killed_under_load_costs_only_the_streams_it_was_sending(faults_under_load) -> None:
    phase = faults_under_load["engine"]
    fault = phase["fault"]
    # only streams that had sent tokens fail (an error event; never a truncation, never a
    # non-streamed request: those were retried on the other engine); each is counted
    assert set(fault["errors_after_kill"]) <= {"stream_error_event"}, fault
    assert phase["gateway"]["episodes"].get("engine_failed", 0) == fault["errors_after_kill"].get("stream_error_event", 0)
    # the restarted engine answers again, serving the weights the gateway serves
    assert fault["time_to_recovery_s"] is not None and fault["engine_version_after"] == fault["policy_version_after"]
    assert phase["requests_ok"] > 0


@pytest.mark.slow
@pytest.mark.parametrize("component", ["learner", "redis"])
def test_the_learner_or_redis_killed_under_load_costs_clients_nothing(faults_under_load, component) -> None:
    phase = faults_under_load[component]
    # serving never noticed; training went on (the next step logged)
    assert phase["errors"] == {} and phase["fault"]["errors_after_kill"] == {} and phase["requests_ok"] > 0
    assert phase["fault"]["time_to_recovery_s"] is not None
