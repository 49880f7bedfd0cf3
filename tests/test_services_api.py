"""The REST API over real HTTP (uvicorn on a loopback port), with no Ray behind it.

Auth (401/403/404), validation (422), body limits (413), the 503 when Ray is down, metrics
paging, the OpenAPI spec and its client, and the dashboard's session cookie. Runs that need
Ray are in test_services_e2e.py; here runs of other owners are written into the registry.
"""

from __future__ import annotations

import json
import time
from typing import Iterator

import httpx
import pytest

from services.client import ServiceClient, ServiceError
from services.config import ServiceConfig
from services.registry import RunRecord

from service_fixture import ALICE, BOB, VIEWER, Service, bearer, ray_down, serve


@pytest.fixture(scope="module")
def service(tmp_path_factory) -> Iterator[Service]:
    tmp = tmp_path_factory.mktemp("svc")
    cfg = ray_down(tmp, max_body_bytes=4096)  # nothing listens at its Ray address
    with serve(cfg) as svc:
        _add_bobs_run(cfg, svc.state)
        yield svc


def _add_bobs_run(cfg: ServiceConfig, state) -> None:
    # bob's finished run, written the way a run leaves its directory
    run_dir = cfg.runs_path() / "bobs-run-00000001"
    run_dir.mkdir(parents=True)
    rows = [{"step": 1, "reward/outcome_mean": float("nan"), "replay/ready": 2},
            {"step": 2, "reward/outcome_mean": 0.5, "replay/ready": 1}]
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"step": 3, "repl')
    (run_dir / "checkpoints" / "step_000002").mkdir(parents=True)
    (run_dir / "live.json").write_text(json.dumps({"base_url": "http://10.0.0.5:8100/v1", "model": "turnrl-policy"}))
    state.manager.registry.add(RunRecord(id="bobs-run-00000001", owner="bob", name="bobs-run", status="succeeded",
                                         run_dir=str(run_dir), total_steps=2, created_at=1.0, updated_at=2.0))


def test_health_and_metrics_need_no_token(service: Service) -> None:
    health = httpx.get(f"{service.url}/healthz").json()
    assert health == {"status": "degraded", "ray": {"address": service.state.jobs.address, "up": False}}
    text = httpx.get(f"{service.url}/metrics").text
    assert 'turnrl_service_runs{status="succeeded"} 1.0' in text
    assert "turnrl_service_ray_up 0.0" in text


@pytest.mark.parametrize("path", ["/v1/runs", "/v1/runs/bobs-run-00000001", "/v1/runs/x/logs",
                                  "/openapi.json", "/dashboard/static/dashboard.js"])
@pytest.mark.parametrize("headers", [{}, {"Authorization": f"Basic {BOB}"}, bearer("not-a-token-at-all-xx")])
def test_every_other_endpoint_needs_a_valid_bearer_token(service: Service, path: str, headers: dict) -> None:
    res = httpx.get(service.url + path, headers=headers)
    assert res.status_code == 401 and res.headers["www-authenticate"] == "Bearer"
    assert BOB not in res.text


def test_a_token_sees_only_its_own_runs(service: Service) -> None:
    own = httpx.get(f"{service.url}/v1/runs/bobs-run-00000001", headers=bearer(BOB))
    assert own.status_code == 200 and own.json()["owner"] == "bob"
    assert own.json()["checkpoints"][0]["name"] == "step_000002" and own.json()["step"] == 2
    assert own.json()["live_url"] == "http://10.0.0.5:8100/v1"  # the run's live endpoint (live.json)
    other = httpx.get(f"{service.url}/v1/runs/bobs-run-00000001", headers=bearer(ALICE))
    missing = httpx.get(f"{service.url}/v1/runs/no-such-run", headers=bearer(ALICE))
    assert other.status_code == missing.status_code == 404 and other.json() == missing.json()  # no existence leak
    assert httpx.get(f"{service.url}/v1/runs", headers=bearer(ALICE)).json() == {"runs": []}
    for method, path in (("POST", "/stop"), ("DELETE", ""), ("GET", "/logs"), ("GET", "/metrics")):
        res = httpx.request(method, f"{service.url}/v1/runs/bobs-run-00000001{path}", headers=bearer(ALICE))
        assert res.status_code == 404, (method, path)


def test_read_only_token_reads_but_cannot_change_anything(service: Service) -> None:
    assert httpx.get(f"{service.url}/v1/runs", headers=bearer(VIEWER)).status_code == 200
    assert httpx.post(f"{service.url}/v1/runs", json={}, headers=bearer(VIEWER)).status_code == 403
    assert httpx.post(f"{service.url}/v1/runs/any/stop", headers=bearer(VIEWER)).status_code == 403
    res = httpx.delete(f"{service.url}/v1/runs/any", headers=bearer(VIEWER))
    assert res.status_code == 403 and res.json() == {"detail": "token 'viewer' is read-only"}


def test_invalid_run_config_is_422_with_key_path_and_reason(service: Service) -> None:
    body = {"learner": {"lr": -1, "lrr": 2}, "env": {"type": "nope"}, "train": {"steps": "many"}}
    res = httpx.post(f"{service.url}/v1/runs", json=body, headers=bearer(ALICE))
    assert res.status_code == 422
    errors = {e["loc"]: e["msg"] for e in res.json()["detail"]}
    assert errors["learner.lr"] == "Input should be greater than or equal to 0"  # 0 freezes the weights
    assert errors["learner.lrr"].startswith("unknown key")
    assert "search_qa" in errors["env"]  # names the allowed environment types
    assert errors["train.steps"].startswith("Input should be a valid integer")
    bad_json = httpx.post(f"{service.url}/v1/runs", content=b"{nope", headers=bearer(ALICE))
    assert bad_json.status_code == 422 and bad_json.json()["detail"][0]["loc"] == "<root>"
    not_object = httpx.post(f"{service.url}/v1/runs", json=[1, 2], headers=bearer(ALICE))
    assert not_object.status_code == 422 and "JSON object" in not_object.json()["detail"][0]["msg"]
    bad_query = httpx.get(f"{service.url}/v1/runs/bobs-run-00000001/metrics?cursor=-1", headers=bearer(BOB))
    assert bad_query.status_code == 422 and bad_query.json()["detail"][0]["loc"] == "query.cursor"


def test_request_bodies_are_size_limited(service: Service) -> None:
    big = {"name": "x" * 5000}
    res = httpx.post(f"{service.url}/v1/runs", json=big, headers=bearer(ALICE))
    assert res.status_code == 413
    chunks = (b'{"name": "' + b"x" * 1000 for _ in range(6))  # no Content-Length: counted while read
    res = httpx.post(f"{service.url}/v1/runs", content=chunks, headers=bearer(ALICE))
    assert res.status_code == 413 and "4096" in res.json()["detail"]


def test_valid_run_with_ray_down_is_503_and_recorded_failed(service: Service) -> None:
    # generous: the first admission imports the actor modules (torch: seconds on a busy machine)
    res = httpx.post(f"{service.url}/v1/runs", json={"name": "ok"}, headers=bearer(ALICE), timeout=120)
    assert res.status_code == 503 and "unreachable" in res.json()["detail"]
    runs = httpx.get(f"{service.url}/v1/runs", headers=bearer(ALICE)).json()["runs"]
    assert [r["status"] for r in runs] == ["failed"] and runs[0]["id"].startswith("ok-")


def test_runs_past_max_running_wait_queued_and_a_queued_stop_is_at_once(tmp_path) -> None:
    # jobs.max_running 1 and bob's run holding the slot: alice's runs are admitted and queued
    # (no Ray job: Ray is not even reachable here); a queued run stopped never starts; when the
    # slot frees, the next poll submits the oldest queued run (Ray down: it stays queued).
    with serve(ray_down(tmp_path, jobs={"max_running": 1})) as svc:
        manager = svc.state.manager
        manager.registry.add(RunRecord(id="bobs-live-run-0001", owner="bob", name="b", status="running",
                                       run_dir=str(tmp_path / "b"), total_steps=2, created_at=1.0, updated_at=1.0))
        made = [httpx.post(f"{svc.url}/v1/runs", json={"name": f"q{i}"}, headers=bearer(ALICE), timeout=120)
                for i in range(2)]
        assert [(r.status_code, r.json()["status"]) for r in made] == [(201, "queued"), (201, "queued")]
        first, second = (r.json()["id"] for r in made)
        stopped = httpx.post(f"{svc.url}/v1/runs/{second}/stop", headers=bearer(ALICE))
        assert stopped.status_code == 202 and stopped.json()["status"] == "stopped"
        assert "never started" in manager.registry.get(second).message
        listed = httpx.get(f"{svc.url}/v1/runs?status=queued", headers=bearer(ALICE)).json()["runs"]
        assert [r["id"] for r in listed] == [first]
        manager.registry.update("bobs-live-run-0001", status="succeeded", finished_at=2.0)
        manager.reconcile()
        assert manager.registry.get(first).status == "queued"  # Ray is down: waits for the next poll


def test_metrics_rows_page_by_cursor_with_nan_as_null(service: Service) -> None:
    url = f"{service.url}/v1/runs/bobs-run-00000001/metrics"
    page = httpx.get(url, headers=bearer(BOB), params={"keys": "reward/outcome_mean"}).json()
    # two complete lines; the third is still being written and waits for the next poll
    assert page["rows"] == [{"step": 1, "reward/outcome_mean": None}, {"step": 2, "reward/outcome_mean": 0.5}]
    again = httpx.get(url, headers=bearer(BOB), params={"cursor": page["cursor"]}).json()
    assert again == {"rows": [], "cursor": page["cursor"]}


def test_openapi_spec_has_examples_and_drives_the_client(service: Service) -> None:
    assert httpx.get(f"{service.url}/openapi.json").status_code == 401
    spec = httpx.get(f"{service.url}/openapi.json", headers=bearer(BOB)).json()
    submit = spec["paths"]["/v1/runs"]["post"]
    body = submit["requestBody"]["content"]["application/json"]
    assert body["schema"] == {"$ref": "#/components/schemas/RunConfig"} and "tiny" in body["examples"]
    assert "learner" in spec["components"]["schemas"]["RunConfig"]["properties"]
    assert "LearnerConfig" in spec["components"]["schemas"]  # nested RunConfig models resolve
    assert spec["components"]["schemas"]["RunDetail"]["examples"][0]["checkpoints"]
    assert spec["components"]["schemas"]["ValidationFailed"]["examples"]
    assert spec["paths"]["/healthz"]["get"]["security"] == []
    with ServiceClient(service.url, BOB) as client:
        assert {"submitRun", "listRuns", "getRun", "getRunLogs", "stopRun", "deleteRun"} <= set(client.operations())
        assert client.status("bobs-run-00000001")["status"] == "succeeded"
        assert [r["id"] for r in client.list()] == ["bobs-run-00000001"]
        with pytest.raises(ServiceError) as err:
            client.stop("bobs-run-00000001")
        assert err.value.status == 409  # already finished
    with ServiceClient(service.url, ALICE) as client, pytest.raises(ServiceError) as err:
        client.status("bobs-run-00000001")
    assert err.value.status == 404


def test_dashboard_login_cookie_authenticates_reads_only(service: Service) -> None:
    page = httpx.get(f"{service.url}/dashboard")
    assert page.status_code == 401 and 'id="login-form"' in page.text
    login = httpx.post(f"{service.url}/v1/session", headers=bearer(BOB))
    assert login.status_code == 204
    cookie = login.headers["set-cookie"]
    assert "HttpOnly" in cookie and "SameSite=strict" in cookie and BOB not in cookie
    with httpx.Client(base_url=service.url, cookies=login.cookies) as browser:
        assert 'id="charts"' in browser.get("/dashboard").text
        assert browser.get("/dashboard/static/dashboard.js").headers["content-type"].startswith("text/javascript")
        assert browser.get("/dashboard/static/../config.py").status_code == 404
        assert browser.get("/v1/runs").json()["runs"][0]["owner"] == "bob"
        assert browser.post("/v1/runs", json={"name": "csrf"}).status_code == 401  # cookies never write
        assert browser.delete("/v1/session").status_code == 204
        browser.cookies = login.cookies  # a replayed cookie is dead after logout
        assert browser.get("/v1/runs").status_code == 401
    assert httpx.post(f"{service.url}/v1/session").status_code == 401


def test_stop_and_delete_respect_run_state(service: Service) -> None:
    registry = service.state.manager.registry
    registry.add(RunRecord(id="live-00000002", owner="bob", name="live", status="running",
                           run_dir=str(service.tmp / "runs" / "live-00000002"), total_steps=9,
                           created_at=time.time(), updated_at=time.time()))
    res = httpx.delete(f"{service.url}/v1/runs/live-00000002", headers=bearer(BOB))
    assert res.status_code == 409 and "stop it first" in res.json()["detail"]
    res = httpx.post(f"{service.url}/v1/runs/live-00000002/stop", headers=bearer(BOB))
    assert res.status_code == 503  # Ray is down: the stop could not be delivered
    registry.delete("live-00000002")


def test_last_metrics_of_a_long_run_starts_at_a_whole_line(tmp_path) -> None:
    # A run past 256 KiB of metrics: the tail read begins mid-line, which used to answer
    # GET /v1/runs/{id} with a 500 (JSONDecodeError on the cut line).
    from services.runs import _TAIL_BYTES, last_metrics, read_metrics

    path = tmp_path / "metrics.jsonl"
    rows = [{"step": i, "reward/outcome_mean": i / 7, "pad": "x" * 97} for i in range(3000)]
    text = "".join(json.dumps(r) + "\n" for r in rows)
    assert len(text) > _TAIL_BYTES and text[len(text) - _TAIL_BYTES - 1] != "\n"
    path.write_text(text + '{"step": 3000, "rew')  # the row being written is not read yet
    assert last_metrics(path)["step"] == 2999
    # a line torn by a crash mid-file is skipped, not an error
    path.write_text('{"step": 1}\n{"step": 2, "tor\n{"step": 3}\n')
    assert [r["step"] for r in read_metrics(path)[0]] == [1, 3]
