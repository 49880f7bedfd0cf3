"""The service against its own OpenAPI spec, fuzzed; and no token anywhere a run or the service writes.

One service on a loopback port with a real local Ray head it starts itself. Its runs are real
Ray jobs whose interpreter (``jobs.python``, the operator's setting) is a script that prints
its environment and exits: submissions that pass admission start and finish in about a second
without training anything.

schemathesis generates requests for every operation from the spec (bounded, derandomized:
the same examples every run) with a writer token, a read-only token and none, and checks every
response against the spec: no 5xx, only documented status codes, bodies and headers that
match their schemas, auth enforced.
"""

from __future__ import annotations

import os
import shutil
import sqlite3
import tempfile
import time
from pathlib import Path
from typing import Iterator

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode
from schemathesis.specs.openapi.checks import positive_data_acceptance

from service_fixture import ALICE, BOB, TOKENS, VIEWER, Service, bearer, serve
from services.config import ServiceConfig
from services.ray_cluster import free_port

pytestmark = pytest.mark.slow
EXAMPLES = 25  # per operation and token kind: ~30 s on 2 cores
FAKE_PYTHON = """#!/bin/sh
# Stands in for the interpreter of `python -m services.job <run.yaml>`: shows what a run sees.
echo "job args: $*"
env
"""


@pytest.fixture(scope="module")
def live(tmp_path_factory) -> Iterator[Service]:
    tmp = tmp_path_factory.mktemp("fuzz")
    python = tmp / "fake-python"
    python.write_text(FAKE_PYTHON)
    python.chmod(0o755)
    # Ray's sockets live under its temp dir, and a Unix socket path has at most 107 bytes: a
    # short dir of its own, not pytest's (pytest -n adds a level per worker).
    ray_temp = Path(tempfile.mkdtemp(prefix="fz", dir="/tmp"))
    cfg = ServiceConfig(state_dir=str(tmp / "state"), port=free_port(),
                        ray={"local": {"num_cpus": 2, "temp_dir": str(ray_temp)}},
                        jobs={"python": str(python), "poll_s": 0.2},
                        limits={"max_concurrent_runs": 1})
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TURNRL_SERVICE_TOKENS", TOKENS)  # what an operator exports: the Ray head must not inherit it
        with serve(cfg, environ=dict(os.environ)) as svc:
            svc.ray_temp = ray_temp
            yield svc
    shutil.rmtree(ray_temp, ignore_errors=True)


@pytest.fixture(scope="module")
def operations(live: Service) -> list:
    spec = httpx.get(f"{live.url}/openapi.json", headers=bearer(ALICE)).json()
    ops = [result.ok() for result in schemathesis.openapi.from_dict(spec).get_all_operations()]
    assert len(ops) == 12  # every operation in the spec: runs (7), pools, session (2), health, metrics
    return ops


def fuzz(live: Service, operations: list, headers: dict[str, str]) -> None:
    """Every operation, with data valid for its schema and with invalid data, checked against
    the spec by all of schemathesis's checks (no 5xx among them) but one: "schema-valid request
    rejected" expects every body the JSON schema allows to be accepted, and a RunConfig has rules
    JSON schema cannot state (cross-field validators, the operator's admission rules), answered
    with the documented 422."""
    for op in operations:
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
            @given(case=op.as_strategy(generation_mode=mode))
            @settings(max_examples=EXAMPLES, derandomize=True, deadline=None, database=None,
                      suppress_health_check=list(HealthCheck))
            def check(case) -> None:
                case.call_and_validate(base_url=live.url, headers=headers, excluded_checks=[positive_data_acceptance])

            try:
                check()
            except Unsatisfiable:
                assert mode is GenerationMode.NEGATIVE, op.label  # no parameter or body to make invalid
            except Exception as exc:
                raise AssertionError(f"{op.label} ({mode.value} data): {exc}") from exc


def test_fuzz_with_a_writer_token(live: Service, operations: list) -> None:
    fuzz(live, operations, bearer(ALICE))


def test_fuzz_with_a_read_only_token(live: Service, operations: list) -> None:
    fuzz(live, operations, bearer(VIEWER))


def test_fuzz_without_a_token(live: Service, operations: list) -> None:
    fuzz(live, operations, {})


def _files(root: Path) -> Iterator[Path]:
    for dirpath, _, names in os.walk(root):
        for name in names:
            path = Path(dirpath) / name
            if path.is_file() and not path.is_symlink():
                yield path


def test_tokens_appear_nowhere_a_run_or_the_service_writes(live: Service) -> None:
    live_token = "bobs-live-endpoint-token-0123456789"  # a run's own secret (live.tokens)
    res = httpx.post(f"{live.url}/v1/runs", json={"name": "leak-check", "eval": {"num_tasks": 0},
                                                  "live": {"enabled": True, "tokens": [live_token]}},
                     headers=bearer(BOB), timeout=120)
    assert res.status_code == 201, res.text
    run_id = res.json()["id"]
    deadline = time.monotonic() + 120
    while (run := httpx.get(f"{live.url}/v1/runs/{run_id}", headers=bearer(BOB)).json())["status"] not in (
            "succeeded", "failed"):
        assert time.monotonic() < deadline, run
        time.sleep(0.5)
    logs = httpx.get(f"{live.url}/v1/runs/{run_id}/logs", headers=bearer(BOB)).text
    assert f"job args: -m services.job {run['run_dir']}/run.yaml" in logs and "PYTHONUNBUFFERED=1" in logs
    assert "TURNRL_SERVICE_TOKENS" not in logs  # the job's whole environment is in its log
    responses = [res.text, logs, httpx.get(f"{live.url}/v1/runs", headers=bearer(BOB)).text,
                 httpx.get(f"{live.url}/openapi.json", headers=bearer(BOB)).text,
                 httpx.get(f"{live.url}/dashboard", headers=bearer(BOB)).text,
                 httpx.get(f"{live.url}/metrics").text, httpx.get(f"{live.url}/healthz").text]
    with sqlite3.connect(live.state.manager.registry.path) as db:  # the registry holds owner names only
        rows = repr(db.execute("SELECT * FROM runs").fetchall())
    assert "'bob'" in rows
    written = [p for root in (live.tmp, live.ray_temp) for p in _files(root)]
    assert any(p.name == "run.yaml" for p in written) and any("job-driver" in p.name for p in written)
    for token in (ALICE, BOB, VIEWER, live_token):
        leaked = [p for p in written if token.encode() in p.read_bytes() and p.name != "secrets.json"]
        assert not leaked, f"{token} written to {leaked}"
        assert all(token not in text for text in [*responses, rows])
    # the live token's one copy: the 0600 file the job's entrypoint reads (services.secrets)
    secrets = Path(run["run_dir"]) / "secrets.json"
    assert live_token in secrets.read_text() and secrets.stat().st_mode & 0o077 == 0
