"""Many tenants on one engine pool, through the run service.

- Admission (no Ray behind the service): a run naming a pool gets the pool's model and
  engines; naming an unknown pool, another model, engines of its own, a warm start or no
  adapter is refused naming the field; a full pool, or a tenant at its share of it, gets 429.
- For real (slow): the service starts the pool as a Ray job; alice's and bob's LoRA runs
  attach to it, each serving its own endpoint through the pool with its adapter (the OpenAI
  ``model`` is the run's adapter: another run's is a 404, another tenant's token a 401), its
  sessions recorded by its own run only; a third tenant is refused while the pool is full;
  bob's run fails hard (its driver killed) and the pool's watch unloads his adapter while
  alice's run trains on; alice's is stopped and detaches; the pool serves on, the same job.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from conftest import ROOT

from cluster.config import apply_overrides
from services.registry import RunRecord

from service_fixture import ALICE, BOB, bearer, ray_down, serve

CAROL = "carol-token-0123456789abc"
TOKENS = f"alice={ALICE},bob={BOB},carol={CAROL}"
ENV = ["env.num_entities=80", "env.num_train_tasks=300", "env.num_heldout_tasks=40"]


def pool_run(name: str, steps: int, *extra: str) -> dict[str, Any]:
    return apply_overrides({}, [*ENV, f"name={name}", f"train.steps={steps}", "rollout.pool=shared",
                                "learner.lora={rank: 4, alpha: 8}", "eval.num_tasks=0", "rollout.group_size=2",
                                "learner.batch_groups=2", "rollout.groups_in_flight=2",
                                "rollout.max_new_tokens=24", "learner.num_cpus=0.3", *extra])


def pools(model: str, **pool: Any) -> dict[str, Any]:
    return {"shared": {"model": model, "engine": {"type": "hf", "count": 1, "num_cpus": 0.2}, "max_adapters": 2,
                       "watch_s": 1.0, **pool}}


def engine_adapters(endpoint: str) -> float:
    """The adapters an engine holds, from its Prometheus endpoint (``turnrl_engine_adapters``)."""
    text = httpx.get(f"http://{endpoint}/metrics", timeout=30).text
    return float(re.search(r"^turnrl_engine_adapters(?:\{[^}]*\})? (\S+)$", text, re.M).group(1))


def test_runs_naming_a_pool_are_admitted_to_its_model_and_engines_or_refused(tmp_path, capsys) -> None:
    model = str(tmp_path / "base")
    cfg = ray_down(tmp_path / "state", pools=pools(model), limits={"max_pool_adapters": 1})
    with serve(cfg, TOKENS) as service:
        def submit(body: dict[str, Any], token: str = ALICE) -> httpx.Response:
            return httpx.post(f"{service.url}/v1/runs", json=body, headers=bearer(token), timeout=30)

        res = submit(pool_run("ok", 2))
        assert res.status_code == 503  # admitted: Ray is down behind this service
        admitted = yaml.safe_load(_latest_run_yaml(service).read_text())
        assert admitted["policy"]["path"] == model and admitted["policy"]["sft"]["enabled"] is False
        assert admitted["rollout"]["engine"]["count"] == 1 and admitted["rollout"]["pool"] == "shared"

        def refused(body: dict[str, Any]) -> dict[str, str]:
            res = submit(body)
            assert res.status_code == 422, res.text
            return {e["loc"]: e["msg"] for e in res.json()["detail"]}

        assert "this service's pools are ['shared']" in refused(pool_run("x", 2, "rollout.pool=other"))["rollout.pool"]
        assert "remove policy.path" in refused(pool_run("x", 2, "policy.path=builtin:tiny"))["policy.path"]
        assert "remove rollout.engine" in refused(pool_run("x", 2, "rollout.engine.count=3"))["rollout.engine"]
        assert "remove policy.sft" in refused(pool_run("x", 2, "policy.sft.steps=5"))["policy.sft"]
        assert "remove it" in refused(pool_run("x", 2, "live.model_name=mine"))["<root>"]
        no_lora = pool_run("x", 2)
        del no_lora["learner"]["lora"]
        assert "set learner.lora" in refused(no_lora)["<root>"]

        registry = service.state.manager.registry
        for i, owner in enumerate(("alice", "bob")):  # two active runs on the pool
            run_dir = tmp_path / f"busy-{i}"
            run_dir.mkdir()
            (run_dir / "run.yaml").write_text(yaml.safe_dump({"rollout": {"pool": "shared"}}))
            registry.add(RunRecord(id=f"busy-{i}", owner=owner, name="busy", status="running", run_dir=str(run_dir),
                                   total_steps=1, created_at=1e12, updated_at=1e12))
        res = submit(pool_run("third", 2), CAROL)
        assert res.status_code == 429 and "max_adapters=2" in res.json()["detail"]
        registry.delete("busy-1")
        res = submit(pool_run("second", 2))  # room in the pool, but alice has her one
        assert res.status_code == 429 and "limits.max_pool_adapters=1" in res.json()["detail"]
        listed = httpx.get(f"{service.url}/v1/pools", headers=bearer(ALICE), timeout=30).json()["pools"]
        assert listed == [{"name": "shared", "model": model, "engine": "hf", "engines": 1, "max_adapters": 2,
                           "attached": 1, "learner": False, "mine": 1, "status": "unknown", "job": None}]
        token = tmp_path / "token"
        token.write_text(BOB)
        from services.cli import main

        assert main(["runs", "--url", service.url, "--token-file", str(token), "pools"]) == 0
        assert capsys.readouterr().out == f"shared\tunknown\t1/2 runs (0 yours)\t1 hf engine(s) of {model}\n"


def _latest_run_yaml(service) -> Path:
    return max(service.state.manager.runs_dir.glob("*/run.yaml"), key=lambda p: p.stat().st_mtime)


def test_a_vllm_pool_refuses_an_adapter_above_its_rank(tmp_path) -> None:
    vllm = {"type": "vllm", "count": 1, "max_loras": 2, "max_lora_rank": 8}
    cfg = ray_down(tmp_path / "state", pools=pools(str(tmp_path / "base"), engine=vllm))
    with serve(cfg, TOKENS) as service:
        res = httpx.post(f"{service.url}/v1/runs", json=pool_run("big", 2, "learner.lora.rank=16"),
                         headers=bearer(ALICE), timeout=30)
    assert res.status_code == 422
    assert "learner.lora.rank=16 is above rollout.engine.max_lora_rank=8" in res.json()["detail"][0]["msg"]


@pytest.mark.slow
def test_tenants_share_a_pool_each_with_its_own_adapter_endpoint_and_sessions(tiny_policy, tmp_path) -> None:
    from openai import NotFoundError, OpenAI

    from services.client import ServiceClient
    from tests.test_services_e2e import wait_for

    alice_live, bob_live = "alice-live-token-0123456789", "bob-live-token-0123456789"
    cfg = {"state_dir": str(tmp_path / "state"), "ray": {"local": {"num_cpus": 4}},
           "jobs": {"poll_s": 1.0, "stop_grace_s": 60, "working_dir": str(ROOT)}, "pools": pools(tiny_policy[0])}
    from services.config import ServiceConfig

    with serve(ServiceConfig.model_validate(cfg), TOKENS) as service:
        alice, bob = ServiceClient(service.url, ALICE), ServiceClient(service.url, BOB)

        def pool_state() -> dict[str, Any]:
            return httpx.get(f"{service.url}/v1/pools", headers=bearer(ALICE), timeout=30).json()["pools"][0]

        job = wait_for(lambda: pool_state()["status"] == "running" and pool_state()["job"], "the pool's job")
        a = alice.submit(pool_run("alice-a", 500, "live.enabled=true", f"live.tokens=[{alice_live}]"))["id"]
        b = bob.submit(pool_run("bob-b", 500, "live.enabled=true", f"live.tokens=[{bob_live}]"))["id"]
        res = httpx.post(f"{service.url}/v1/runs", json=pool_run("carol-c", 2), headers=bearer(CAROL), timeout=30)
        assert res.status_code == 429  # the pool serves two adapters at most

        url = wait_for(lambda: alice.status(a)["live_url"], "alice's endpoint", timeout_s=300)
        oa = OpenAI(base_url=url, api_key=alice_live, max_retries=0)
        assert [m.id for m in oa.models.list().data] == [a]  # her run's adapter is the model
        reply = oa.chat.completions.create(model=a, messages=[{"role": "user", "content": "Who founded Tarn?"}],
                                           max_tokens=8, extra_headers={"X-Session-Id": "alice-s1"})
        assert reply.model == a and reply.choices[0].finish_reason in ("stop", "length", "tool_calls")
        assert 1 <= reply.usage.completion_tokens <= 8  # decoded by her adapter, within max_tokens
        with pytest.raises(NotFoundError):  # bob's adapter is not served at alice's endpoint
            oa.chat.completions.create(model=b, messages=[{"role": "user", "content": "hi"}], max_tokens=4)
        assert httpx.get(f"{url}/models", headers=bearer(bob_live), timeout=30).status_code == 401
        httpx.post(f"{url}/sessions/alice-s1/end", headers=bearer(alice_live), timeout=30)

        targets = json.loads((tmp_path / "state" / "prometheus" / "pool-shared.json").read_text())
        assert targets[0]["labels"] == {"component": "engine"}  # the pool's engine, scraped like runs' actors
        wait_for(lambda: engine_adapters(targets[0]["targets"][0]) == 2, "both adapters in the pool's engine")

        # bob's run fails hard (its driver killed): the pool's watch unloads his adapter
        os.kill(int(service.state.jobs.client.get_job_info(b).driver_info.pid), signal.SIGKILL)
        wait_for(lambda: bob.status(b)["status"] == "failed", "bob's run to fail")
        wait_for(lambda: engine_adapters(targets[0]["targets"][0]) == 1, "bob's adapter to leave the engine")
        step = alice.status(a)["step"]
        wait_for(lambda: alice.status(a)["step"] > step, "alice's run to go on training after bob's failed")

        alice.stop(a)  # cancelled: it detaches as it ends
        wait_for(lambda: alice.status(a)["status"] == "stopped", "alice's run to stop")
        assert engine_adapters(targets[0]["targets"][0]) == 0
        state = pool_state()
        assert state["status"] == "running" and state["job"] == job and state["attached"] == 0
        sessions = [json.loads(line) for line in (Path(alice.status(a)["run_dir"]) / "live_sessions.jsonl")
                    .read_text().splitlines()]
        assert sessions and all(s["trajectory"]["live"]["session_id"] == "alice-s1" for s in sessions)
        # every token of what she served was sampled with her run's adapter (named by its driver's
        # run id, her run's id and a suffix), and the turns say so
        (adapter,) = {t["adapter"] for s in sessions for t in s["trajectory"]["turns"]}
        assert adapter.startswith(f"{a}-")
        assert not (Path(bob.status(b)["run_dir"]) / "live_sessions.jsonl").exists()
        for client in (alice, bob):
            client.close()


def _pool_learner_stats(state_dir: Path) -> dict[str, Any]:
    """The pool learner's ``stats()``, asked from a process of its own joining the service's
    local Ray head (this test process may hold another Ray session)."""
    gcs = json.loads((state_dir / "local_ray.json").read_text())["gcs_address"]
    code = ("import json, ray; from cluster.pool import POOL_NAMESPACE; from cluster.pool_learner import "
            f"pool_learner_name; ray.init(address={gcs!r}, namespace=POOL_NAMESPACE, log_to_driver=False); "
            "print(json.dumps(ray.get(ray.get_actor(pool_learner_name('shared')).stats.remote())))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_three_tenants_train_at_once_through_the_pools_one_learner(tiny_policy, tmp_path) -> None:
    """A pool with a learner: three tenants' runs (different data, ranks, learning rates and
    estimators) attach over HTTP, start no learner of their own and are trained by the pool's
    one process; each run's steps, versions and trained groups are its own, each tenant sees
    only its own run, and every slot is free again when they end."""
    from services.client import ServiceClient
    from services.config import ServiceConfig
    from tests.test_services_e2e import wait_for

    learner = {"num_cpus": 0.3, "coalesce_s": 0.3, "torch_threads": 1}
    cfg = {"state_dir": str(tmp_path / "state"), "ray": {"local": {"num_cpus": 4}},
           "jobs": {"poll_s": 1.0, "stop_grace_s": 60, "working_dir": str(ROOT)},
           "pools": pools(tiny_policy[0], max_adapters=3, learner=learner)}
    settings = {ALICE: ("learner.lora={rank: 4, alpha: 8}", "learner.lr=1e-2"),
                BOB: ("learner.lora={rank: 8, alpha: 8}", "learner.lr=5e-3", "env.seed=5"),
                CAROL: ("learner.lora={rank: 2, alpha: 4}", "learner.lr=2e-2",
                        "learner.estimator={type: grpo, scale_by_std: false}")}
    with serve(ServiceConfig.model_validate(cfg), TOKENS) as service:
        clients = {token: ServiceClient(service.url, token) for token in settings}
        assert clients[ALICE].pools()[0]["learner"] is True
        wait_for(lambda: clients[ALICE].pools()[0]["status"] == "running", "the pool's job")
        runs = {token: clients[token].submit(pool_run(f"t{i}", 3, "learner.checkpoint_every=3", *extra))["id"]
                for i, (token, extra) in enumerate(settings.items())}
        for token, run in runs.items():
            wait_for(lambda c=clients[token], r=run: c.status(r)["status"] in ("succeeded", "failed"),
                     f"run {run} to end", timeout_s=900)
        for token, run in runs.items():
            status = clients[token].status(run)
            assert (status["status"], status["step"]) == ("succeeded", 3), status
            run_dir = Path(status["run_dir"])
            admitted = json.loads((run_dir / "config.json").read_text())
            assert admitted["learner"]["on_pool"] is True  # set by the service for this pool
            rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
            assert [r["version"] for r in rows] == [1, 2, 3] and all(r["samples"] == 4 for r in rows)
            groups = [g for line in (run_dir / "trained_groups.jsonl").read_text().splitlines()
                      for g in json.loads(line)["group_ids"]]
            assert len(groups) == len(set(groups)) == 6
            others = [r for t, r in runs.items() if t != token]
            assert all(httpx.get(f"{service.url}/v1/runs/{r}", headers=bearer(token), timeout=30).status_code == 404
                       for r in others)  # each tenant reaches only its own run
        stats = _pool_learner_stats(tmp_path / "state")
        assert stats["tenants"] == [] and stats["failed"] == {} and stats["rounds"] <= 9
        for client in clients.values():
            client.close()


def test_a_pool_that_cannot_serve_adapters_is_refused_naming_the_key(tmp_path) -> None:
    from services.config import ServiceConfigError, load_service_config

    def load(pool: dict[str, Any], name: str = "p") -> Any:
        path = tmp_path / "service.yaml"
        path.write_text(yaml.safe_dump({"pools": {name: pool}}))
        return load_service_config(path)

    assert load({"model": "builtin:smollm2"}).pools["p"].engine.type == "hf"
    with pytest.raises(ServiceConfigError, match="pools.p.*builtin:tiny is built per run"):
        load({"model": "builtin:tiny"})
    with pytest.raises(ServiceConfigError, match="engine.max_loras: a pool serves LoRA adapters"):
        load({"model": "builtin:smollm2", "engine": {"type": "vllm"}})
    with pytest.raises(ServiceConfigError, match=r"pool names \['a b'\]"):
        load({"model": "builtin:smollm2"}, name="a b")
    with pytest.raises(ServiceConfigError, match="max_adapters"):
        load({"model": "builtin:smollm2", "max_adapters": 0})
