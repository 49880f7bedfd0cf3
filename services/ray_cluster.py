"""The local Ray head the service starts when no ``ray.address`` is configured.

``ray start --head --block`` runs in its own session, so it outlives the service: runs keep
executing across a service restart, and the next service reuses the head it finds recorded in
``<state_dir>/local_ray.json``. Stopping it sends SIGTERM to that one recorded process (after
checking it is still our ``ray start``), which shuts down exactly the processes it started;
``ray stop`` would kill every Ray process on the machine.
"""

from __future__ import annotations

import json
import logging
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from services.config import LocalRayConfig

log = logging.getLogger(__name__)

STATE_FILE = "local_ray.json"
# Ray reads these from the environment of the processes it starts (raylet, workers, jobs).
RAY_ENV = {"RAY_USAGE_STATS_ENABLED": "0", "RAY_AUTH_MODE": "disabled",
           # SIGTERM to `ray start --block` then tears down at once instead of draining first
           "RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S": "0"}


_PORT_RANGE = (20_000, 32_767)
"""Where the head's fixed ports are drawn: below the kernel's ephemeral range (32768 up on
Linux) and above Ray's worker ports (10002-19999), so neither an outgoing connection nor a Ray
worker started in the meantime can take a port between its choice and its bind."""


def free_port() -> int:
    """A port free right now on every interface, from ``_PORT_RANGE``."""
    rng = random.Random()
    for _ in range(200):
        port = rng.randint(*_PORT_RANGE)
        with socket.socket() as s:
            try:
                s.bind(("", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port in {_PORT_RANGE[0]}-{_PORT_RANGE[1]}")


def _listening(port: int) -> bool:
    """Something accepts TCP connections on ``port`` at the address Ray binds its head's
    servers to (the node IP it detects), or on loopback."""
    from ray.util import get_node_ip_address

    for host in dict.fromkeys((get_node_ip_address(), "127.0.0.1")):
        try:
            with socket.create_connection((host, port), timeout=1):
                return True
        except OSError:
            continue
    return False


def job_server_up(url: str, timeout_s: float = 2.0) -> bool:
    try:
        return httpx.get(f"{url}/api/version", timeout=timeout_s).status_code == 200
    except httpx.HTTPError:
        return False


def _is_our_ray_start(pid: int) -> bool:
    """The recorded pid may have been reused by an unrelated process since."""
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    return b"start" in cmdline and b"--head" in cmdline and any(b"ray" in part for part in cmdline)


class LocalRayHead:
    def __init__(self, cfg: LocalRayConfig, state_dir: Path, hidden_env: frozenset[str] = frozenset()) -> None:
        self.cfg = cfg
        self.state_dir = state_dir
        self.state_path = state_dir / STATE_FILE
        self.hidden_env = hidden_env

    def child_env(self, environ: dict[str, str]) -> dict[str, str]:
        """The head's environment, which every run (Ray job) inherits: the service's, less the
        variables holding API tokens (``hidden_env``), plus ``RAY_ENV``."""
        return {**{k: v for k, v in environ.items() if k not in self.hidden_env}, **RAY_ENV}

    def _state(self) -> dict[str, Any] | None:
        try:
            return json.loads(self.state_path.read_text())
        except (OSError, ValueError):
            return None

    def running(self) -> dict[str, Any] | None:
        """The recorded head, if its process and job server are alive."""
        state = self._state()
        if state and _is_our_ray_start(state["pid"]) and job_server_up(state["dashboard_url"]):
            return state
        return None

    def ensure(self) -> str:
        """Dashboard URL of a live local head, starting one if needed."""
        state = self.running()
        if state:
            log.info("reusing the local Ray head (pid %s) at %s", state["pid"], state["dashboard_url"])
            return state["dashboard_url"]
        return self.start()["dashboard_url"]

    def start(self, attempts: int = 3) -> dict[str, Any]:
        """Start a head; a head whose port was taken while it started is retried on new ports."""
        for attempt in range(1, attempts + 1):
            try:
                return self._start_once()
            except RuntimeError:
                if attempt == attempts:
                    raise
                log.warning("the local Ray head exited while starting; retrying on new ports")
        raise AssertionError("unreachable")

    def _start_once(self) -> dict[str, Any]:
        self.state_dir.mkdir(parents=True, exist_ok=True)
        temp_dir = self.cfg.temp_dir or tempfile.mkdtemp(prefix="turnrl-ray-")
        dash_port = self.cfg.dashboard_port or free_port()
        gcs_port, client_port = free_port(), free_port()
        cmd = [sys.executable, "-m", "ray.scripts.scripts", "start", "--head", "--block",
               f"--port={gcs_port}", f"--dashboard-port={dash_port}", "--dashboard-host=127.0.0.1",
               "--include-dashboard=true", f"--temp-dir={temp_dir}", "--disable-usage-stats",
               # fixed defaults (10001, 52365) would collide with any other Ray on the machine
               f"--ray-client-server-port={client_port}", f"--dashboard-agent-listen-port={free_port()}"]
        if self.cfg.num_cpus:
            cmd.append(f"--num-cpus={self.cfg.num_cpus}")
        logf = (self.state_dir / "local_ray.log").open("ab")
        proc = subprocess.Popen(cmd, env=self.child_env(dict(os.environ)), stdout=logf, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)
        logf.close()
        url = f"http://127.0.0.1:{dash_port}"
        deadline = time.monotonic() + self.cfg.startup_timeout_s
        # Up means every head process is: `ray start --block` takes the whole head down when one
        # of them (the client server, the last to bind) fails to start.
        while not (job_server_up(url) and _listening(client_port)):
            if proc.poll() is not None or time.monotonic() > deadline:
                if proc.poll() is None:
                    proc.terminate()
                if self.cfg.temp_dir is None:
                    shutil.rmtree(temp_dir, ignore_errors=True)
                raise RuntimeError(f"the local Ray head did not start (see {self.state_dir / 'local_ray.log'})")
            time.sleep(0.5)
        state = {"pid": proc.pid, "dashboard_url": url, "gcs_address": f"127.0.0.1:{gcs_port}",
                 "temp_dir": temp_dir, "temp_dir_owned": self.cfg.temp_dir is None, "started_at": time.time()}
        tmp = self.state_path.with_suffix(".tmp")
        tmp.write_text(json.dumps(state, indent=2))
        tmp.replace(self.state_path)
        log.info("started a local Ray head (pid %s); job server at %s", proc.pid, url)
        return state

    def stop(self, timeout_s: float = 60.0) -> bool:
        """SIGTERM the recorded ``ray start --block``; True if it was running and has exited."""
        state = self._state()
        if not state or not _is_our_ray_start(state["pid"]):
            self.state_path.unlink(missing_ok=True)
            return False
        os.kill(state["pid"], signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        while _is_our_ray_start(state["pid"]) and time.monotonic() < deadline:
            _reap(state["pid"])
            time.sleep(0.2)
        stopped = not _is_our_ray_start(state["pid"])
        if stopped and state.get("temp_dir_owned"):
            shutil.rmtree(state["temp_dir"], ignore_errors=True)  # session dirs and logs we created
        self.state_path.unlink(missing_ok=True)
        return stopped


def _reap(pid: int) -> None:
    """When our own process started the head, collect its exit status (no zombie left)."""
    try:
        os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        pass
