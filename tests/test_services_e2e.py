"""The service for real: `turnrl serve` as a subprocess starting its own local Ray head, tiny
training runs as Ray jobs, the API over HTTP, a restart mid-run, a graceful stop, the CLI,
Prometheus endpoints of live actors, and the dashboard driven in headless Chromium.

The tests share one service (module fixture ``stack``) and two runs (module fixture ``runs``,
submitted by whichever test needs them first): run A trains long enough to be watched and
keeps running until it is stopped; run B is short. Each test also runs alone: it waits for
the state it needs (B finished, A past a step) instead of relying on an earlier test. In file
order, the restart test comes first so that B finishes while the service is down.
"""

from __future__ import annotations

import base64
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable, Iterator

import httpx
import pytest
import yaml
from conftest import ARTIFACTS, ROOT, TINY_OVERRIDES

from services.client import ServiceClient, ServiceError
from services.ray_cluster import free_port

pytestmark = pytest.mark.slow
ALICE, BOB, VIEWER = "alice-e2e-token-0123456789", "bob-e2e-token-0123456789", "viewer-e2e-token-0123456789"
LIVE_TOKEN = "alice-live-endpoint-token-0123456789"  # run A's own endpoint token (live.tokens)
WAIT_S = 300  # generous: the first DeepSpeed init compiles an op, and CI machines are shared


def wait_for(check: Callable[[], Any], what: str, timeout_s: float = WAIT_S, every_s: float = 0.5) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(every_s)
    raise AssertionError(f"timed out after {timeout_s:.0f}s waiting for {what}")


def run_body(name: str, steps: int, *extra: str) -> dict[str, Any]:
    """No policy.cache_dir: the service puts alice's runs on her tenant cache (see Stack)."""
    from cluster.config import apply_overrides

    return apply_overrides({}, [*TINY_OVERRIDES, *extra, f"name={name}",
                                f"train.steps={steps}", "eval.num_tasks=0", "rollout.group_size=2",
                                "learner.batch_groups=2", "rollout.groups_in_flight=2", "rollout.max_new_tokens=24",
                                "learner.num_cpus=0.5"])


class Stack:
    """One service process (restartable) over the local Ray head it starts and keeps."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.config = tmp / "service.yaml"
        self.config.write_text(yaml.safe_dump({
            "port": self.port, "state_dir": str(tmp / "state"), "ray": {"local": {"num_cpus": 4}},
            "jobs": {"poll_s": 1.0, "stop_grace_s": 120, "working_dir": str(ROOT)},
            "admission": {"cache_dir": str(tmp / "tenant-cache")}}))
        self.env = {**os.environ, "TURNRL_SERVICE_TOKENS": f"alice={ALICE},bob={BOB},viewer:ro={VIEWER}"}
        self.log = tmp / "service.log"
        self.proc: subprocess.Popen | None = None
        self.ids: dict[str, str] = {}
        self.submitted: dict[str, dict[str, Any]] = {}
        """What the service answered when each run was submitted (``runs`` fixture)."""

    def start(self, wait: bool = True) -> None:
        with self.log.open("ab") as log:
            self.proc = subprocess.Popen([sys.executable, "-m", "cluster.cli", "serve", "--config", str(self.config)],
                                         cwd=ROOT, env=self.env, stdout=log, stderr=subprocess.STDOUT)
        if wait:
            self.wait_healthy()

    def wait_healthy(self) -> None:
        wait_for(self._healthy, "the service to answer /healthz", timeout_s=180)

    def _healthy(self) -> bool:
        assert self.proc.poll() is None, self.log.read_text()[-3000:]
        try:
            return httpx.get(f"{self.url}/healthz", timeout=2).json()["status"] == "ok"
        except httpx.HTTPError:
            return False

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        # uvicorn shuts down gracefully, then re-raises the signal so the exit status shows it
        assert self.proc.wait(timeout=30) in (0, -signal.SIGTERM)
        assert f"Finished server process [{self.proc.pid}]" in self.log.read_text()

    @property
    def ray_url(self) -> str:
        return httpx.get(f"{self.url}/healthz").json()["ray"]["address"]

    def client(self, token: str = ALICE) -> ServiceClient:
        return ServiceClient(self.url, token)


@pytest.fixture(scope="module")
def stack(request, tmp_path_factory, policy_cache) -> Iterator[Stack]:
    stack = Stack(tmp_path_factory.mktemp("e2e"))
    # The operator seeds alice's tenant cache with the policy the tiny_policy fixture builds.
    (stack.tmp / "tenant-cache" / "alice").mkdir(parents=True)
    (stack.tmp / "tenant-cache" / "alice" / "policies").symlink_to(policy_cache)
    stack.start(wait=False)  # the Ray head starts while the tiny policy builds
    try:
        request.getfixturevalue("tiny_policy")  # built once here, so runs skip SFT
        stack.wait_healthy()
        yield stack
    finally:
        if stack.proc and stack.proc.poll() is None:
            stack.stop()
        head = json.loads((stack.tmp / "state" / "local_ray.json").read_text())
        subprocess.run([sys.executable, "-m", "cluster.cli", "serve", "--config", str(stack.config),
                        "--stop-local-ray"], cwd=ROOT, env=stack.env, timeout=120, check=True)
        assert not Path(head["temp_dir"]).exists()  # removed only once the head has exited
        log = stack.log.read_text()
        assert all(token not in log for token in (ALICE, BOB, VIEWER)), "a token reached the service log"


@pytest.fixture(scope="module")
def runs(stack: Stack) -> dict[str, str]:
    """Run A (500 steps, serving a live endpoint behind a token, stopped by the last test) and
    run B (2 steps), submitted once."""
    with stack.client() as client:
        stack.submitted["A"] = client.submit(run_body("long", 500, "live.enabled=true", f"live.tokens=[{LIVE_TOKEN}]"))
        stack.submitted["B"] = client.submit(run_body("short", steps=2))
    stack.ids.update(A=stack.submitted["A"]["id"], B=stack.submitted["B"]["id"])
    return stack.ids


def _wait_status(client: ServiceClient, run_id: str, status: str, timeout_s: float = WAIT_S) -> dict[str, Any]:
    return wait_for(lambda: (d := client.status(run_id))["status"] == status and d, f"{run_id} to be {status}",
                    timeout_s=timeout_s)


def _ray_cli(*args: str) -> str:
    out = subprocess.run([sys.executable, "-m", "ray.scripts.scripts", "job", *args], capture_output=True,
                         text=True, timeout=120, env={**os.environ, "RAY_USAGE_STATS_ENABLED": "0"})
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_submit_then_restart_mid_run(stack: Stack, runs: dict[str, str]) -> None:
    from ray.job_submission import JobSubmissionClient

    long, short = stack.submitted["A"], stack.submitted["B"]
    with stack.client() as client:
        assert long["status"] == "pending" and long["id"].startswith("long-") and long["total_steps"] == 500
        assert [r["id"] for r in client.list()] == [short["id"], long["id"]]  # newest first
    ray_url = stack.ray_url
    stack.stop()  # both runs keep executing on the Ray head the service leaves running
    jobs = JobSubmissionClient(ray_url)
    wait_for(lambda: jobs.get_job_status(short["id"]).is_terminal(), "run B to finish while the service is down")
    assert str(jobs.get_job_status(long["id"]).value) == "RUNNING"
    listed = _ray_cli("list", "--address", ray_url)
    assert short["id"] in listed and long["id"] in listed
    stack.start()
    with stack.client() as client:
        b = client.status(short["id"])
        assert b["status"] == "succeeded" and b["message"] == "finished while the service was not running"
        assert b["step"] == 2 and [c["name"] for c in b["checkpoints"]] == ["step_000002"]
        assert b["result"]["steps"] == 2 and not b["result"]["interrupted"]
        assert client.status(long["id"])["status"] == "running"  # reconnected, not restarted


def test_status_logs_and_actor_metrics(stack: Stack, runs: dict[str, str]) -> None:
    run_id = stack.ids["A"]
    with stack.client() as client:
        before = wait_for(lambda: (d := client.status(run_id))["step"] >= 2 and d, "run A to train 2 steps")
        assert before["status"] == "running" and before["ray_submission_id"] == run_id
        assert "throughput/gen_tokens_per_s" in before["metrics"]
        wait_for(lambda: client.status(run_id)["step"] > before["step"], "run A to keep training")
        logs = client.logs(run_id, tail=400)
        assert "[4/5] training 500 steps" in logs and "step 1:" in logs
        assert len(client.logs(run_id, tail=3).splitlines()) == 3
        seen = ""
        for chunk in client.follow_logs(run_id, tail=0):  # only output written from now on
            seen += chunk
            if "step " in seen:
                break
        assert "step " in seen and "[1/5]" not in seen
        endpoints = wait_for(lambda: client.status(run_id)["metrics_endpoints"], "actor metrics endpoints")
    assert len(endpoints) == 6  # replay, reward, rollout, engine, learner, and run A's live gateway
    text = "".join(httpx.get(f"http://{ep}/metrics", timeout=10).text for ep in endpoints)
    assert "turnrl_learner_steps_total{run=" in text and "turnrl_engine_generated_tokens_total" in text
    assert "turnrl_replay_staleness_versions_bucket" in text and "turnrl_reward_trajectories_total" in text
    mirrored = stack.tmp / "state" / "prometheus" / f"{run_id}.json"  # what deploy/prometheus.yml globs
    wait_for(mirrored.exists, "the file_sd mirror of run A", timeout_s=30)
    assert {e["labels"]["component"] for e in json.loads(mirrored.read_text())} == {
        "replay", "reward", "rollout", "engine", "learner", "gateway"}
    assert "[2/5] ray + actors" in _ray_cli("logs", run_id, "--address", stack.ray_url)


def test_dashboard_renders_live_charts_in_chromium(stack: Stack, runs: dict[str, str], tmp_path) -> None:
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        pytest.skip("chromium is not installed (Debian package: chromium); the dashboard test needs it")
    with stack.client() as client:
        url = wait_for(lambda: client.status(runs["A"])["live_url"], "run A's live endpoint")
        # rates count from the training start: traffic sent before it shows in no step's rate
        wait_for(lambda: client.status(runs["A"])["step"] >= 1, "run A to train a step")
    for i in range(3):  # live traffic (three one-request sessions): the live chart must show it
        reply = httpx.post(f"{url}/chat/completions", headers={"Authorization": f"Bearer {LIVE_TOKEN}"}, timeout=120,
                           json={"model": "turnrl-policy", "max_tokens": 8, "messages": [{"role": "user", "content": f"hi {i}"}]})
        assert reply.status_code == 200, reply.text
    browser = Chromium(chromium, tmp_path)
    try:
        browser.navigate(f"{stack.url}/dashboard?run={stack.ids['A']}")
        assert browser.evaluate("!!document.getElementById('login-form')")  # 401: the sign-in page
        browser.evaluate(f"document.getElementById('token').value = {json.dumps(ALICE)};"
                         "document.getElementById('login-form').requestSubmit(); true")
        wait_for(lambda: browser.evaluate("document.readyState === 'complete' && !!document.getElementById('charts')"),
                 "the dashboard after signing in", timeout_s=30)
        # visible panels only: the live-traffic panel shows for runs that serve live traffic
        counts = ("Array.from(document.querySelectorAll('section.panel:not([hidden]) svg.chart'))"
                  ".map(s => +s.dataset.points)")
        first = wait_for(lambda: (c := browser.evaluate(counts)) and min(c) >= 2 and c, "data points in all charts")
        # run A serves a live endpoint, so its rows carry live/* metrics and the live panel shows
        assert len(first) == 6 and not browser.evaluate("document.getElementById('chart-live').closest('section').hidden")
        browser.evaluate("window.__sameDocument = true")  # survives only if the page never reloads
        grown = wait_for(lambda: browser.evaluate(counts)[0] > first[0] and browser.evaluate(counts),
                         "the charts to update without a reload", timeout_s=120)
        assert browser.evaluate("window.__sameDocument === true") and grown[0] > first[0]
        # the traffic above reached the live chart: a step that served requests, then the three
        # sessions open (no feedback came, so they stay open)
        traffic = "view.rows.some(r => r['live/requests_per_s'] > 0) && view.rows.some(r => r['live/sessions_open'] >= 3)"
        wait_for(lambda: browser.evaluate(traffic), "run A's live traffic in the live chart", timeout_s=120)
        assert browser.evaluate("document.querySelectorAll('svg.chart circle.point').length") >= sum(first)
        assert browser.evaluate("document.getElementById('status').textContent") == "running"
        ARTIFACTS.mkdir(exist_ok=True)
        png = browser.screenshot(ARTIFACTS / "dashboard.png")
        assert png.startswith(b"\x89PNG") and len(png) > 20_000
    finally:
        browser.close()


def test_auth_and_validation_on_the_live_service(stack: Stack, runs: dict[str, str]) -> None:
    run_id = stack.ids["A"]
    assert httpx.get(f"{stack.url}/v1/runs/{run_id}").status_code == 401
    with stack.client(BOB) as bob, pytest.raises(ServiceError) as err:
        bob.stop(run_id)
    assert err.value.status == 404  # another owner's run does not exist for bob
    with stack.client(VIEWER) as viewer, pytest.raises(ServiceError) as err:
        viewer.stop(run_id)
    assert err.value.status == 403
    with stack.client() as client, pytest.raises(ServiceError) as err:
        client.submit({"rollout": {"group_size": 0}})
    assert err.value.status == 422 and err.value.detail[0]["loc"] == "rollout.group_size"


def test_live_endpoint_takes_the_real_token_not_the_masked_one(stack: Stack, runs: dict[str, str]) -> None:
    """Admission keeps the run's secret; everything people see shows it masked."""
    with stack.client() as client:
        url = wait_for(lambda: client.status(runs["A"])["live_url"], "run A's live endpoint")
        detail, logs = client.status(runs["A"]), client.logs(runs["A"], tail=400)
    masked = httpx.get(f"{url}/models", headers={"Authorization": "Bearer **********"}, timeout=30)
    real = httpx.get(f"{url}/models", headers={"Authorization": f"Bearer {LIVE_TOKEN}"}, timeout=30)
    assert masked.status_code == 401 and real.status_code == 200, (masked.text, real.text)
    assert real.json()["data"][0]["id"] == "turnrl-policy"
    run_dir = Path(detail["run_dir"])
    assert yaml.safe_load((run_dir / "run.yaml").read_text())["live"]["tokens"] == ["**********"]
    assert json.loads((run_dir / "config.json").read_text())["live"]["tokens"] == ["**********"]
    assert LIVE_TOKEN not in json.dumps(detail) + logs + (run_dir / "run.yaml").read_text()
    assert LIVE_TOKEN not in (run_dir / "config.json").read_text()


def test_cli_lists_and_shows_runs(stack: Stack, runs: dict[str, str]) -> None:
    env = {**os.environ, "TURNRL_TOKEN": ALICE, "TURNRL_URL": stack.url}
    with stack.client() as client:
        _wait_status(client, runs["B"], "succeeded")
        _wait_status(client, runs["A"], "running")

    def cli(*args: str) -> str:
        out = subprocess.run([sys.executable, "-m", "cluster.cli", "runs", *args], cwd=ROOT, env=env,
                             capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        return out.stdout

    listing = cli("list")
    assert f"{stack.ids['B']}\tsucceeded\t2/2" in listing and f"{stack.ids['A']}\trunning" in listing
    assert "checkpoint step_000002" in cli("status", stack.ids["B"])
    assert "done: 2 steps" in cli("logs", stack.ids["B"], "--tail", "50")


def test_graceful_stop_writes_final_checkpoint_then_delete(stack: Stack, runs: dict[str, str]) -> None:
    run_id = stack.ids["A"]
    with stack.client() as client:
        _wait_status(client, runs["B"], "succeeded")  # deleted below, so it must be done
        wait_for(lambda: client.status(run_id)["step"] >= 1, "run A to train a step")
        assert client.stop(run_id)["status"] == "stopping"
        done = wait_for(lambda: (d := client.status(run_id))["status"] in ("stopped", "failed") and d,
                        "run A to stop", timeout_s=180)
        assert done["status"] == "stopped", client.logs(run_id, tail=60)
        assert done["result"]["interrupted"] is True  # the driver's KeyboardInterrupt path ran to the end
        assert done["checkpoints"] and done["checkpoints"][-1]["path"] == done["result"]["checkpoint"]
        # one numbering: the step reported is the step the checkpoint holds
        said = re.search(r"stopped early at step (\d+); checkpoint \S*step_(\d+)", client.logs(run_id, tail=20))
        assert said and int(said[1]) == int(said[2]) == done["result"]["steps"], client.logs(run_id, tail=20)
        with pytest.raises(ServiceError) as err:
            client.stop(run_id)
        assert err.value.status == 409
        run_dir = Path(done["run_dir"])
        assert (run_dir / "prometheus_targets.json.finished").exists()  # out of Prometheus' targets
        wait_for(lambda: not (stack.tmp / "state" / "prometheus" / f"{run_id}.json").exists(), "the mirror removal")
        client.delete(run_id)
        with pytest.raises(ServiceError) as err:
            client.status(run_id)
        assert err.value.status == 404 and not run_dir.exists()
        client.delete(stack.ids["B"], keep_files=True)
        assert [r["id"] for r in client.list()] == []
    assert stack.ids["B"] in os.listdir(stack.tmp / "state" / "runs")


class Chromium:
    """Headless Chromium driven over the DevTools protocol (websocket-client)."""

    def __init__(self, binary: str, tmp: Path) -> None:
        import websocket

        profile = tmp / "profile"
        self.proc = subprocess.Popen(
            [binary, "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking", "--no-first-run",
             "--disable-component-update", "--disable-sync", f"--user-data-dir={profile}", "--remote-debugging-port=0",
             "--window-size=1400,1150", "about:blank"],
            stdout=subprocess.DEVNULL, stderr=(tmp / "chromium.log").open("wb"), start_new_session=True)
        port_file = profile / "DevToolsActivePort"
        wait_for(lambda: port_file.exists() and port_file.read_text().strip(), "Chromium's DevTools port", 60)
        port = port_file.read_text().split()[0]
        page = wait_for(lambda: [t for t in httpx.get(f"http://127.0.0.1:{port}/json/list").json()
                                 if t["type"] == "page"], "a Chromium page", 30)[0]
        # suppress_origin: Chromium refuses DevTools websockets that carry a foreign Origin
        self.ws = websocket.create_connection(page["webSocketDebuggerUrl"], timeout=60, suppress_origin=True)
        self._id = 0

    def send(self, method: str, **params: Any) -> dict[str, Any]:
        self._id += 1
        self.ws.send(json.dumps({"id": self._id, "method": method, "params": params}))
        while True:  # skip events until our reply
            msg = json.loads(self.ws.recv())
            if msg.get("id") == self._id:
                if "error" in msg:
                    raise RuntimeError(f"{method}: {msg['error']}")
                return msg["result"]

    def evaluate(self, expression: str) -> Any:
        result = self.send("Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True)
        if "exceptionDetails" in result:
            raise RuntimeError(f"{expression}: {result['exceptionDetails']}")
        return result["result"].get("value")

    def navigate(self, url: str) -> None:
        self.send("Page.enable")
        self.send("Page.navigate", url=url)
        wait_for(lambda: self.evaluate("document.readyState") == "complete" and self.evaluate("location.href") == url,
                 f"{url} to load", 30)

    def screenshot(self, path: Path) -> bytes:
        data = base64.b64decode(self.send("Page.captureScreenshot", format="png")["data"])
        path.write_bytes(data)
        return data

    def close(self) -> None:
        try:
            self.send("Browser.close")
            self.proc.wait(timeout=15)
        except Exception:
            os.killpg(self.proc.pid, signal.SIGKILL)  # our own session: Chromium and its helpers
            self.proc.wait(timeout=15)
