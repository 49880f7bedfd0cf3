"""The parent's side of a BFCL worker process (``envs.bfcl.worker``): start, ask, time out, kill.

One request at a time (a lock serialises callers from threads). A request that outlives its
timeout kills the process, and one that finds the process dead (crashed, out of memory) gets an
error reply naming the exit status and the last line it wrote to stderr; neither raises. The
next request starts a fresh process: ``ensure_started`` tells the caller so, since a fresh
process holds no episode state (the environment then replays the calls it had executed).
"""

from __future__ import annotations

import json
import select
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import IO, Any

ROOT = Path(__file__).resolve().parents[2]


class WorkerProcess:
    """A lazily started BFCL worker with a per-request timeout and an address-space cap."""

    def __init__(self, timeout_s: float, memory_mb: int) -> None:
        self.timeout_s = timeout_s
        self.memory_mb = memory_mb
        self.starts = 0
        """Processes started so far (a restart after a kill counts)."""
        self._proc: subprocess.Popen[bytes] | None = None
        self._stderr: IO[bytes] | None = None
        self._lock = threading.Lock()

    def alive(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def ensure_started(self) -> bool:
        """Start the process unless it runs; True when this call started a fresh one."""
        if self.alive():
            return False
        self.close()
        boot = (f"import sys; sys.path.insert(0, {str(ROOT)!r}); "
                f"from envs.bfcl.worker import main; main({int(self.memory_mb)})")
        self._stderr = tempfile.TemporaryFile()
        self._proc = subprocess.Popen([sys.executable, "-I", "-c", boot], stdin=subprocess.PIPE,
                                      stdout=subprocess.PIPE, stderr=self._stderr)
        self.starts += 1
        return True

    def request(self, payload: dict[str, Any], timeout_s: float | None = None) -> dict[str, Any]:
        """Send one request; its reply, or ``{"ok": False, "error": ...}`` when the process
        timed out (then killed) or died."""
        with self._lock:
            self.ensure_started()
            assert self._proc is not None and self._proc.stdin and self._proc.stdout
            try:
                self._proc.stdin.write(json.dumps(payload).encode() + b"\n")
                self._proc.stdin.flush()
            except (BrokenPipeError, OSError):
                return self._died()
            limit = self.timeout_s if timeout_s is None else timeout_s
            deadline = time.monotonic() + limit
            while True:
                left = deadline - time.monotonic()
                ready, _, _ = select.select([self._proc.stdout], [], [], max(0.0, left))
                if ready:
                    break
                if left <= 0:
                    self.close()
                    return {"ok": False, "error": f"timed out after {limit:g} s (killed)"}
            line = self._proc.stdout.readline()
            if not line:
                return self._died()
            return json.loads(line)

    def _died(self) -> dict[str, Any]:
        assert self._proc is not None
        code = self._proc.wait()
        tail = ""
        if self._stderr is not None:
            self._stderr.seek(0)
            lines = self._stderr.read().decode("utf-8", "replace").strip().splitlines()
            tail = lines[-1] if lines else ""
        self.close()
        return {"ok": False, "error": f"the BFCL worker process died (exit {code}) {tail}".strip()}

    def close(self) -> None:
        """Kill the process (if any) and reap it."""
        proc, self._proc = self._proc, None
        if proc is not None:
            if proc.poll() is None:
                proc.kill()
            proc.wait()
            for pipe in (proc.stdin, proc.stdout):
                if pipe is not None:
                    pipe.close()
        if self._stderr is not None:
            self._stderr.close()
            self._stderr = None
