"""Running a task's Python tool source in a separate, limited process.

Each call starts ``python -I -S`` (no site packages, no user paths; ~11 ms a call here, as
the runner imports only built-in modules) that sets its own limits before it reads the tool
source: an address-space cap (``RLIMIT_AS``) and a CPU-time cap
(``RLIMIT_CPU``), plus socket creation replaced by a function that raises. The parent enforces
the wall-clock limit and kills the child past it. Limits are set in the child, not through
``preexec_fn``, because ``preexec_fn`` is unsafe in the threaded processes Ray actors are.

The network block is a guard against tools that reach out by accident (an HTTP helper left in a
dataset's tool source), not a security boundary against hostile code.

Every failure (exception, timeout, out of memory, crash) comes back as ``ToolOutcome(ok=False)``
with text for the model; nothing here raises on tool behaviour.
"""

from __future__ import annotations

import ast
import asyncio
import json
import subprocess
import sys
from dataclasses import dataclass
from typing import Any

RUNNER = r"""
import io, resource, sys, _socket
# Only built-in modules here: importing json (re, compiled patterns) or socket would double the
# ~11 ms a call costs. The request is a Python literal written by the parent (trusted), the
# reply one the parent reads back with ast.literal_eval (never eval: the tool wrote it).
request = eval(sys.stdin.read(), {"__builtins__": {}})
mem = request["memory_bytes"]
resource.setrlimit(resource.RLIMIT_AS, (mem, mem))
cpu = request["cpu_seconds"]
resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
def _no_network(*args, **kwargs):
    raise PermissionError("network access is disabled for tools")
class _NoSocket(_socket.socket):  # a class, so modules that subclass socket still import
    __slots__ = ()  # socket.socket adds __weakref__ itself
    def __init__(self, *args, **kwargs):
        _no_network()
# Patched before anything imports `socket`, which copies these names from _socket.
_socket.socket = _socket.SocketType = _NoSocket
for attr in ("getaddrinfo", "socketpair", "fromfd", "gethostbyname", "gethostbyname_ex"):
    if hasattr(_socket, attr):
        setattr(_socket, attr, _no_network)
def plain(value):  # what JSON can carry; anything else as its str (json's default=str)
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return value if value == value and value not in (float("inf"), float("-inf")) else str(value)
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    if isinstance(value, dict):
        return {str(k): plain(v) for k, v in value.items()}
    return str(value)
real_stdout = sys.stdout
sys.stdout = io.StringIO()  # a tool's prints must not corrupt the reply
try:
    namespace = {"__name__": "tool_source"}
    for source in request["sources"]:
        exec(compile(source, "<tool source>", "exec"), namespace)
    function = namespace.get(request["name"])
    if not callable(function):
        raise NameError("the tool source defines no function " + repr(request["name"]))
    reply = {"ok": True, "result": plain(function(**request["arguments"]))}
except BaseException as exc:
    reply = {"ok": False, "error": type(exc).__name__ + ": " + str(exc)}
real_stdout.write(repr(reply))
"""


@dataclass(frozen=True)
class Limits:
    """Per-call limits for a tool process."""

    timeout_s: float = 5.0
    """Wall-clock seconds before the process is killed."""
    memory_mb: int = 256
    """Address-space cap of the process."""


@dataclass(frozen=True)
class ToolOutcome:
    """What a tool call produced: its result, or the error text the model sees."""

    ok: bool
    result: Any = None
    error: str = ""

    def text(self) -> str:
        """The tool message content: the result (strings as-is, else JSON) or the error."""
        if not self.ok:
            return f"Error: {self.error}"
        return self.result if isinstance(self.result, str) else json.dumps(self.result)


def _request(sources: list[str], name: str, arguments: dict[str, Any], limits: Limits) -> bytes:
    # A Python literal (repr of JSON-typed data), so the child needs no json import.
    return repr(
        {
            "sources": sources,
            "name": name,
            "arguments": arguments,
            "memory_bytes": limits.memory_mb * 1024 * 1024,
            "cpu_seconds": max(1, int(limits.timeout_s + 1)),
        }
    ).encode()


def _outcome(returncode: int | None, stdout: bytes, stderr: bytes, limits: Limits) -> ToolOutcome:
    memory_hint = f" (the tool exceeded its {limits.memory_mb} MiB memory limit)"
    try:
        reply = ast.literal_eval(stdout.decode("utf-8", "replace"))
        if not isinstance(reply, dict):
            raise ValueError("not a reply")
    except (ValueError, SyntaxError, MemoryError, RecursionError):
        tail = (stderr.decode("utf-8", "replace").strip().splitlines() or [""])[-1]
        hint = memory_hint if "MemoryError" in tail else ""
        return ToolOutcome(False, error=f"tool process died (exit {returncode}){hint} {tail}")
    if reply.get("ok"):
        return ToolOutcome(True, result=reply.get("result"))
    error = str(reply.get("error", "unknown error"))
    if error.startswith("MemoryError"):
        error = error.rstrip(": ") + memory_hint
    return ToolOutcome(False, error=error)


def _command() -> list[str]:
    return [sys.executable, "-I", "-S", "-c", RUNNER]


def run_tool(
    sources: list[str], name: str, arguments: dict[str, Any], limits: Limits
) -> ToolOutcome:
    """Run ``name(**arguments)`` from ``sources`` in a limited child process (blocking)."""
    try:
        proc = subprocess.run(
            _command(),
            input=_request(sources, name, arguments, limits),
            capture_output=True,
            timeout=limits.timeout_s,
        )
    except subprocess.TimeoutExpired:  # run() has killed and reaped the child
        return ToolOutcome(False, error=f"tool {name!r} timed out after {limits.timeout_s:g} s")
    return _outcome(proc.returncode, proc.stdout, proc.stderr, limits)


async def run_tool_async(
    sources: list[str], name: str, arguments: dict[str, Any], limits: Limits
) -> ToolOutcome:
    """:func:`run_tool` without blocking the event loop of the rollout actor."""
    proc = await asyncio.create_subprocess_exec(
        *_command(),
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    try:
        stdout, stderr = await asyncio.wait_for(
            proc.communicate(_request(sources, name, arguments, limits)), limits.timeout_s
        )
    except TimeoutError:
        proc.kill()
        await proc.wait()
        return ToolOutcome(False, error=f"tool {name!r} timed out after {limits.timeout_s:g} s")
    return _outcome(proc.returncode, stdout, stderr, limits)
