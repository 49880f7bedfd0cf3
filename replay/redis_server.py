"""Start and stop a local redis-server: the ``url: embedded`` replay backend, tests and bench.

A server is one child process listening on 127.0.0.1 only, configured by a ``redis.conf`` written
into its data directory (mode 0600, so a test password never shows in ``ps``), and stopped by
its PID: SIGTERM first, which lets redis-server flush its append-only file, SIGKILL if it hangs.

Embedded mode keeps the server's data in ``<run_dir>/redis`` and its address in
``<run_dir>/redis/server.json``. Every process of a run that opens the embedded store (driver,
learner, rollout actors, a restarted learner) finds the live server through that file instead
of starting a second one; only the process that started it stops it. A server left behind by a
crashed driver is reused on resume, and one that died is restarted on the same data, so its
append-only file is replayed.

While a run lives, its starter also watches the server (``RedisServer.watch``): one killed or
crashed mid-run is started again on the same port and data directory, so the append-only file
is replayed and the run's clients, which re-send their commands for ``replay.retry_s``
(replay/redis_store.py), carry on. This is the embedded stand-in for what a StatefulSet or
systemd does for a production server.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator, Literal
from urllib.parse import urlsplit

import redis

_log = logging.getLogger(__name__)
APT_PACKAGE = "redis-server"
FsyncPolicy = Literal["always", "everysec", "no"]


def find_redis_server(binary: str = "redis-server") -> str:
    """Absolute path of the redis-server executable, or an error saying how to install it."""
    path = binary if os.sep in binary else shutil.which(binary)
    if path is None and binary == "redis-server" and os.access("/usr/bin/redis-server", os.X_OK):
        path = "/usr/bin/redis-server"  # PATH may be trimmed inside Ray workers
    if not path or not os.access(path, os.X_OK):
        raise RuntimeError(
            f"replay.url is 'embedded' but the redis-server executable {binary!r} was not found: "
            f"install the apt package {APT_PACKAGE} (`apt-get install {APT_PACKAGE}`), set "
            "replay.server_binary to its path, or point replay.url at a running Redis"
        )
    return path


def free_port() -> int:
    """A loopback port free right now (the caller retries if another process takes it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class RedisServer:
    """One redis-server child process bound to 127.0.0.1."""

    def __init__(
        self,
        data_dir: str | Path,
        port: int | None = None,
        *,
        appendonly: bool = False,
        appendfsync: FsyncPolicy = "always",
        password: str | None = None,
        binary: str = "redis-server",
    ) -> None:
        self.data_dir = Path(data_dir).resolve()
        self.port = port
        self.appendonly = appendonly
        self.appendfsync = appendfsync
        self.password = password
        self.binary = binary
        self._proc: subprocess.Popen[bytes] | None = None
        self._watcher: threading.Thread | None = None
        self._stopping = threading.Event()
        self.restarts = 0
        """Times ``watch`` found the server dead and started it again."""

    @property
    def url(self) -> str:
        auth = f":{self.password}@" if self.password else ""
        return f"redis://{auth}127.0.0.1:{self.port}/0"

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc else None

    def _write_conf(self) -> Path:
        lines = [
            "bind 127.0.0.1",
            f"port {self.port}",
            f'dir "{self.data_dir}"',
            'logfile "redis.log"',
            'save ""',  # no RDB snapshots: durability, when wanted, is the append-only file's job
            f"appendonly {'yes' if self.appendonly else 'no'}",
            f"appendfsync {self.appendfsync}",
            "daemonize no",
        ]
        if self.password:
            lines.append(f'requirepass "{self.password}"')
        conf = self.data_dir / "redis.conf"
        conf.touch(mode=0o600)
        conf.write_text("\n".join(lines) + "\n")
        return conf

    def start(self, timeout_s: float = 15.0) -> "RedisServer":
        """Start and wait until it answers PING (after replaying its append-only file)."""
        self.data_dir.mkdir(parents=True, exist_ok=True)
        binary = find_redis_server(self.binary)
        fixed_port = self.port is not None
        for attempt in range(3):
            if not fixed_port:
                self.port = free_port()
            self._proc = subprocess.Popen(
                [binary, str(self._write_conf())],
                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                start_new_session=True,  # a Ctrl-C meant for the driver must not kill the store
            )
            try:
                self._wait_ready(timeout_s)
                return self
            except RuntimeError:
                if fixed_port or attempt == 2 or self._proc.poll() is None:
                    self.stop()
                    raise
        raise AssertionError("unreachable")

    def _wait_ready(self, timeout_s: float) -> None:
        client = redis.Redis(host="127.0.0.1", port=self.port, password=self.password,
                             socket_connect_timeout=0.5, socket_timeout=2.0)
        deadline = time.monotonic() + timeout_s
        try:
            while time.monotonic() < deadline:
                if self._proc is None or self._proc.poll() is not None:
                    raise RuntimeError(f"redis-server exited at start-up: {self.log_tail()}")
                try:
                    client.ping()
                    return
                except redis.exceptions.ConnectionError:  # includes LOADING (BusyLoadingError)
                    time.sleep(0.02)
        finally:
            client.close()
        raise RuntimeError(f"redis-server did not answer on port {self.port} in {timeout_s}s: "
                           f"{self.log_tail()}")

    def log_tail(self, n: int = 5) -> str:
        log = self.data_dir / "redis.log"
        return " | ".join(log.read_text().splitlines()[-n:]) if log.exists() else "(no log)"

    def watch(self, restart: Callable[["RedisServer"], object] | None = None,
              poll_s: float = 0.1) -> None:
        """From now until ``stop``, start the server again whenever its process exits (same
        port and data, so its append-only file is replayed); ``restart(server)`` does the
        starting when given (to hold a lock or record the new PID around ``start``)."""
        if self._watcher is None:
            self._stopping.clear()
            self._watcher = threading.Thread(target=self._watch, args=(restart or RedisServer.start, poll_s),
                                             name="redis-server-watch", daemon=True)
            self._watcher.start()

    def _watch(self, restart: Callable[["RedisServer"], object], poll_s: float) -> None:
        while not self._stopping.wait(poll_s):
            proc = self._proc
            if proc is None or proc.poll() is None:
                continue
            exited = proc.returncode
            self.restarts += 1
            try:
                restart(self)
            except RuntimeError as exc:  # e.g. another process took the port: clients will fail
                _log.error("redis-server (port %s) exited with %s and could not be restarted: %s",
                           self.port, exited, exc)
                return
            _log.warning("redis-server (port %s) exited with %s: restarted from %s (restart %d)",
                         self.port, exited, self.data_dir, self.restarts)

    def stop(self, timeout_s: float = 10.0) -> None:
        """SIGTERM (a clean shutdown flushes the append-only file), then SIGKILL if needed."""
        self._stopping.set()
        if self._watcher is not None and self._watcher is not threading.current_thread():
            self._watcher.join()
        self._watcher = None
        proc, self._proc = self._proc, None
        if proc is None or proc.poll() is not None:
            return
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()

    def kill(self) -> None:
        """SIGKILL, as a crash would: nothing is flushed beyond what appendfsync guarantees."""
        proc, self._proc = self._proc, None
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait()

    def __enter__(self) -> "RedisServer":
        return self.start() if self._proc is None else self

    def __exit__(self, *exc: object) -> None:
        self.stop()


# -- embedded mode -------------------------------------------------------------------------
@contextmanager
def _locked(path: Path) -> Iterator[None]:
    """Serialise start-up between processes of one run that open the store at the same time."""
    with path.open("a") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value  # redis-py versions differ


def _live_url(data_dir: Path) -> str | None:
    """The URL in server.json if that server is alive and really serves ``data_dir``."""
    try:
        info = json.loads((data_dir / "server.json").read_text())
        os.kill(int(info["pid"]), 0)
    except (OSError, ValueError, KeyError):
        return None
    client = redis.Redis.from_url(info["url"], socket_connect_timeout=0.5, socket_timeout=2.0)
    try:
        # The PID may have been reused by another process: check the server's data directory.
        served = {_text(k): _text(v) for k, v in client.config_get("dir").items()}.get("dir")
        return str(info["url"]) if served == str(data_dir) else None
    except redis.exceptions.RedisError:
        return None
    finally:
        client.close()


def ensure_embedded(
    run_dir: str | Path, *, appendonly: bool, appendfsync: FsyncPolicy, binary: str
) -> tuple[str, RedisServer | None]:
    """URL of the run's embedded server, and the server object if this call started it."""
    data_dir = (Path(run_dir) / "redis").resolve()
    data_dir.mkdir(parents=True, exist_ok=True)
    with _locked(data_dir / "start.lock"):
        url = _live_url(data_dir)
        if url is not None:
            return url, None
        kwargs: dict[str, Any] = {"appendonly": appendonly, "appendfsync": appendfsync, "binary": binary}
        try:
            server = RedisServer(data_dir, _last_port(data_dir), **kwargs).start()
        except RuntimeError:  # that port is taken now: any free one
            server = RedisServer(data_dir, **kwargs).start()
        _record(server)
        server.watch(_restart_embedded)
        return server.url, server


def stop_embedded(run_dir: str | Path, timeout_s: float = 10.0) -> bool:
    """Shut the run's live embedded server down cleanly (SHUTDOWN flushes its append-only
    file) and wait until it has gone; returns whether one was running. A replay host that Ray
    started again calls it: the dead host started and watched that server, and left running
    it would have no watcher and outlive the run; the new host starts it again on its port."""
    data_dir = (Path(run_dir) / "redis").resolve()
    with _locked(data_dir / "start.lock"):
        url = _live_url(data_dir)
        if url is None:
            return False
        pid = int(json.loads((data_dir / "server.json").read_text())["pid"])
        client = redis.Redis.from_url(url, socket_connect_timeout=2.0, socket_timeout=timeout_s)
        try:
            client.shutdown()
        except redis.exceptions.ConnectionError:
            pass  # it closed the connection as it exited
        finally:
            client.close()
        deadline = time.monotonic() + timeout_s
        while _running(pid):
            if time.monotonic() > deadline:
                os.kill(pid, signal.SIGKILL)
                break
            time.sleep(0.02)
    return True


def _running(pid: int) -> bool:
    """Whether ``pid`` is a live process (a zombie left for its new parent to reap is not)."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _record(server: RedisServer) -> None:
    """``server.json``: where the run's other processes find the live server."""
    tmp = server.data_dir / "server.json.tmp"
    tmp.write_text(json.dumps({"pid": server.pid, "url": server.url}))
    tmp.replace(server.data_dir / "server.json")


def _restart_embedded(server: RedisServer) -> None:
    # Under the start-up lock: a process that opened the store meanwhile may have restarted it
    # (on the same port, see ensure_embedded), and two servers must never share one data dir.
    with _locked(server.data_dir / "start.lock"):
        if _live_url(server.data_dir) is not None:
            raise RuntimeError("another process restarted it; it watches it now")
        server.start()
        _record(server)


def _last_port(data_dir: Path) -> int | None:
    """The port a dead server of this data directory listened on: restarting on it keeps
    the URL every client of the run already holds."""
    try:
        return int(urlsplit(json.loads((data_dir / "server.json").read_text())["url"]).port)
    except (OSError, ValueError, KeyError, TypeError):
        return None
