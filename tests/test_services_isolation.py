"""Runs are separated: every run endpoint answers another tenant's run exactly as a missing one,
the read-only role changes nothing, and run ids and directories are not guessable or open.

Real HTTP, no Ray: bob's run is written into the registry and onto disk as a run leaves it.
"""

from __future__ import annotations

import re
import stat
from typing import Iterator

import httpx
import pytest

from services.registry import RunRecord

from service_fixture import ALICE, BOB, VIEWER, Service, bearer, ray_down, serve

BOBS = "bobs-run-8d5f0a7c1e2b4a6f9c3d0e1f"
# method, path template, needs a writer: every route with a run id (checked against the app below)
RUN_ROUTES = [("GET", "/v1/runs/{run_id}", False), ("GET", "/v1/runs/{run_id}/metrics", False),
              ("GET", "/v1/runs/{run_id}/logs", False), ("POST", "/v1/runs/{run_id}/stop", True),
              ("DELETE", "/v1/runs/{run_id}", True)]


@pytest.fixture(scope="module")
def service(tmp_path_factory) -> Iterator[Service]:
    cfg = ray_down(tmp_path_factory.mktemp("iso"))
    with serve(cfg) as svc:
        run_dir = cfg.runs_path() / BOBS
        (run_dir / "checkpoints" / "step_000001").mkdir(parents=True)
        (run_dir / "metrics.jsonl").write_text('{"step": 1}\n')
        svc.state.manager.registry.add(RunRecord(id=BOBS, owner="bob", name="bobs-run", status="succeeded",
                                                 run_dir=str(run_dir), total_steps=1, created_at=1.0, updated_at=1.0))
        yield svc


def test_the_route_list_covers_every_run_endpoint(service: Service) -> None:
    spec = httpx.get(f"{service.url}/openapi.json", headers=bearer(BOB)).json()
    in_spec = {(m.upper(), p) for p, ops in spec["paths"].items() if "{run_id}" in p for m in ops}
    assert in_spec == {(m, p) for m, p, _ in RUN_ROUTES}


@pytest.mark.parametrize("method, path, writes", RUN_ROUTES)
def test_another_tenants_run_is_a_404_like_a_missing_one(service: Service, method: str, path: str,
                                                         writes: bool) -> None:
    other = httpx.request(method, service.url + path.format(run_id=BOBS), headers=bearer(ALICE))
    missing = httpx.request(method, service.url + path.format(run_id="no-such-run"), headers=bearer(ALICE))
    # 404 before Ray is asked: with Ray down, bob's own logs would be a 503
    assert (other.status_code, other.json()) == (missing.status_code, missing.json()) == (404, {"detail": "run not found"})


@pytest.mark.parametrize("method, path, writes", RUN_ROUTES)
def test_the_read_only_role_reads_nothing_of_others_and_writes_nothing(service: Service, method: str, path: str,
                                                                       writes: bool) -> None:
    res = httpx.request(method, service.url + path.format(run_id=BOBS), headers=bearer(VIEWER))
    assert (res.status_code, res.json()) == ((403, {"detail": "token 'viewer' is read-only"}) if writes
                                             else (404, {"detail": "run not found"}))
    if method == "GET":  # the same read with bob's token finds it (logs: 503, Ray is down)
        own = httpx.get(service.url + path.format(run_id=BOBS), headers=bearer(BOB))
        assert own.status_code == (503 if path.endswith("/logs") else 200)


def test_run_ids_in_paths_cannot_walk_the_filesystem(service: Service) -> None:
    for run_id in ("..", "%2e%2e%2f" + BOBS, f"x/../{BOBS}", f"../runs/{BOBS}"):
        res = httpx.get(f"{service.url}/v1/runs/{run_id}/metrics", headers=bearer(ALICE))
        assert res.status_code == 404


def test_run_ids_are_unguessable_and_run_directories_private(service: Service) -> None:
    ids = []
    for _ in range(3):
        assert httpx.post(f"{service.url}/v1/runs", json={"name": "mine"}, headers=bearer(ALICE),
                          timeout=120).status_code == 503  # the first admission imports torch
    for run in httpx.get(f"{service.url}/v1/runs", headers=bearer(ALICE)).json()["runs"]:
        ids.append(run["id"])
        mode = stat.S_IMODE((service.state.manager.runs_dir / run["id"]).stat().st_mode)
        assert mode == 0o700  # other users of the machine cannot list or read it
    assert len(set(ids)) == 3 and all(re.fullmatch(r"mine-[0-9a-f]{24}", i) for i in ids)  # 96 random bits each
    assert [r["id"] for r in httpx.get(f"{service.url}/v1/runs", headers=bearer(BOB)).json()["runs"]] == [BOBS]


def test_unknown_query_parameters_are_refused(service: Service) -> None:
    res = httpx.delete(f"{service.url}/v1/runs/{BOBS}?keep_file=true", headers=bearer(BOB))  # typo of keep_files
    assert res.status_code == 422
    assert res.json() == {"detail": [{"loc": "query.keep_file", "msg": "unknown query parameter; known: "
                                      "['keep_files']", "type": "extra_forbidden"}]}


def test_a_query_parameter_given_twice_or_outside_its_values_is_refused(service: Service) -> None:
    res = httpx.get(f"{service.url}/v1/runs?status=running&status=failed", headers=bearer(BOB))
    assert res.status_code == 422  # FastAPI alone would keep the last and list failed runs only
    assert res.json() == {"detail": [{"loc": "query.status", "msg": "given more than once; give it once",
                                      "type": "repeated"}]}
    res = httpx.get(f"{service.url}/v1/runs?status=runing", headers=bearer(BOB))
    assert res.status_code == 422 and res.json()["detail"][0]["loc"] == "query.status"
    assert "'pending', 'running'" in res.json()["detail"][0]["msg"]
    for status, ids in (("succeeded", [BOBS]), ("running", [])):
        res = httpx.get(f"{service.url}/v1/runs?status={status}", headers=bearer(BOB))
        assert [r["id"] for r in res.json()["runs"]] == ids
