"""The OpenEnv server an environment actor talks to: a local process it starts, or a URL.

A local server starts on first use on a free loopback port (``{port}`` in its command or
arguments) and counts as up once ``GET /health`` answers. One runs per process that holds the
task source (a rollout or environment actor), serving every episode there, each over its own
WebSocket session. If it died, the next episode starts it again; the episode that saw it die
fails with that cause.
"""

from __future__ import annotations

import socket
import subprocess
import tempfile
import threading
import time
from pathlib import Path

import httpx

from envs.config import OpenEnvServerConfig


class ServerUnavailable(RuntimeError):
    """The server did not start or cannot be reached (the episode that needed it fails)."""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class OpenEnvServer:
    """One environment server, started lazily and again after it dies."""

    def __init__(self, cfg: OpenEnvServerConfig) -> None:
        self.cfg = cfg
        self.proc: subprocess.Popen[bytes] | None = None
        self.url = cfg.url.rstrip("/") if cfg.url else ""
        self.starts = 0
        """Times the local server was started: 1 + restarts."""
        self._log = Path(tempfile.mkdtemp(prefix="openenv-")) / "server.log"
        self._lock = threading.Lock()

    def base_url(self) -> str:
        """The server's URL, starting it first when it is local and not running (blocking)."""
        if self.cfg.url is not None:
            return self.url
        with self._lock:
            if self.proc is None or self.proc.poll() is not None:
                self._start()
            return self.url

    def _start(self) -> None:
        if self.cfg.command is None:
            raise ServerUnavailable(f"openenv server {self.cfg.name!r} names no command or url")
        port = str(_free_port())
        argv = [part.replace("{port}", port) for part in (self.cfg.command, *self.cfg.args)]
        with self._log.open("ab") as log:
            self.proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, cwd=self.cfg.cwd,
                                         env=self.cfg.process_env(), start_new_session=True)
        self.url, self.starts = f"http://127.0.0.1:{port}", self.starts + 1
        deadline = time.monotonic() + self.cfg.start_timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise ServerUnavailable(f"openenv server {self.cfg.name!r} exited with code {self.proc.returncode} "
                                        f"at start: {self._tail()}")
            if self.healthy():
                return
            time.sleep(0.2)
        self.stop()
        raise ServerUnavailable(f"openenv server {self.cfg.name!r} did not answer GET /health within "
                                f"{self.cfg.start_timeout_s:g} s: {self._tail()}")

    def healthy(self) -> bool:
        """Whether the server answers ``GET /health`` within 2 s (blocking)."""
        try:
            return httpx.get(f"{self.url}/health", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    def _tail(self) -> str:
        lines = self._log.read_text(errors="replace").strip().splitlines() if self._log.exists() else []
        return " | ".join(lines[-3:]) or "(no output)"

    def action_schema(self) -> dict:
        """The action's JSON schema (``GET /schema``), less OpenEnv's own ``metadata`` field."""
        try:
            schema = httpx.get(f"{self.base_url()}/schema", timeout=30).raise_for_status().json()["action"]
        except (httpx.HTTPError, KeyError, ValueError) as exc:
            raise ServerUnavailable(f"openenv server {self.cfg.name!r}: no action schema at GET /schema ({exc})") from exc
        props = {k: v for k, v in schema.get("properties", {}).items() if k != "metadata"}
        return {"type": "object", "properties": props, "required": [r for r in schema.get("required", []) if r in props]}

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)
