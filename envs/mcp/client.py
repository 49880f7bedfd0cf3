"""A connection to one MCP server, usable from any thread or event loop.

The ``mcp`` SDK's client is anyio-based: a session must be entered and left by one task, in the
loop that made it. Environments call tools from a rollout actor's event loop, and demonstrations
replay episodes synchronously (``act``), so each connection owns a small thread with a loop of
its own, where one task holds the session open; calls cross over with
``run_coroutine_threadsafe``.

Nothing here raises on what a server does: a tool error, a timeout, a server that died or never
started each come back as ``ToolOutcome(ok=False)`` with text for the model. A server that died
is started again on the next call (the call that saw it die is not retried: it may have acted).
"""

from __future__ import annotations

import asyncio
import json
import threading
from concurrent.futures import Future
from typing import Any

from envs.config import McpServerConfig
from envs.tool_use.sandbox import ToolOutcome
from envs.tools import function_tool

CONNECT_TIMEOUT_S = 60.0
"""Start-up and ``list_tools`` of a server (a ``uvx``/``npx`` server may install itself first)."""


class McpUnavailable(RuntimeError):
    """The server could not be started or reached (raised at start, where a run fails early)."""


def _sdk() -> Any:
    try:
        import mcp
    except ImportError as exc:
        raise McpUnavailable("MCP servers need the mcp package: pip install 'mcp>=2.3'") from exc
    return mcp


def _target(cfg: McpServerConfig) -> Any:
    mcp = _sdk()
    if cfg.url is not None:
        return cfg.url
    if cfg.command is None:
        raise McpUnavailable(f"mcp server {cfg.name!r} names no command or url")
    return mcp.StdioServerParameters(command=cfg.command, args=cfg.args, env=cfg.process_env(), cwd=cfg.cwd)


def openai_tool(tool: Any) -> dict[str, Any]:
    """An MCP tool listing as an OpenAI function definition (what the chat template shows)."""
    return function_tool(tool.name, tool.description, tool.input_schema)


def outcome_of(result: Any) -> ToolOutcome:
    """A ``CallToolResult`` as the observation the model reads: its text blocks joined (other
    blocks named), or its structured content as JSON when it has no text; ``is_error`` fails it."""
    parts = []
    for block in result.content:
        text = getattr(block, "text", None)
        if text is not None:
            parts.append(text)
        elif getattr(block, "resource", None) is not None and getattr(block.resource, "text", None) is not None:
            parts.append(block.resource.text)
        else:
            parts.append(f"[{getattr(block, 'type', 'content')} omitted]")
    text = "\n".join(parts)
    if not text and result.structured_content is not None:
        text = json.dumps(result.structured_content)
    return ToolOutcome(False, error=text or "the tool failed") if result.is_error else ToolOutcome(True, result=text)


class McpConnection:
    """One server: started on first use, restarted after it dies, closed with ``close``."""

    def __init__(self, cfg: McpServerConfig) -> None:
        self.cfg = cfg
        self.tools: list[Any] = []
        """The server's tools (``list_tools``), filtered by ``cfg.tools``; set by ``start``."""
        self.starts = 0
        """Times the server was started (or connected to): 1 + restarts."""
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name=f"mcp-{cfg.name}", daemon=True)
        self._thread.start()
        self._client: Any = None
        self._stop: asyncio.Event | None = None
        self._holder: asyncio.Task[None] | None = None
        self._lock = threading.Lock()

    def start(self) -> list[Any]:
        """Connect (starting the server) if not connected; its tools. Raises McpUnavailable."""
        with self._lock:
            if self._client is None:
                self._submit(self._open()).result(CONNECT_TIMEOUT_S + 5)
            return self.tools

    async def _open(self) -> None:
        ready: asyncio.Future[None] = self._loop.create_future()
        self._stop = asyncio.Event()
        self._holder = self._loop.create_task(self._hold(ready, self._stop))
        try:
            await asyncio.wait_for(ready, CONNECT_TIMEOUT_S)
        except TimeoutError:
            self._stop.set()
            raise McpUnavailable(f"mcp server {self.cfg.name!r}: no answer to list_tools in {CONNECT_TIMEOUT_S:g} s") from None

    async def _hold(self, ready: asyncio.Future[None], stop: asyncio.Event) -> None:
        """The task that owns the session: enters it, lists the tools, waits for ``stop``."""
        mcp = _sdk()
        try:
            async with mcp.Client(_target(self.cfg), read_timeout_seconds=self.cfg.call_timeout_s) as client:
                listing = await client.list_tools()
                wanted = self.cfg.tools
                self.tools = [t for t in listing.tools if wanted is None or t.name in wanted]
                missing = sorted(set(wanted or []) - {t.name for t in listing.tools})
                if missing:
                    raise McpUnavailable(f"mcp server {self.cfg.name!r} has no tools {missing}; it has "
                                         f"{sorted(t.name for t in listing.tools)}")
                self._client, self.starts = client, self.starts + 1
                ready.set_result(None)
                await stop.wait()
        except BaseException as exc:  # noqa: BLE001 - reported to the caller waiting on ``ready``
            while isinstance(exc, BaseExceptionGroup) and len(exc.exceptions) == 1:
                exc = exc.exceptions[0]  # anyio's task groups wrap what went wrong inside them
            if not ready.done():
                ready.set_exception(exc if isinstance(exc, McpUnavailable) else McpUnavailable(
                    f"mcp server {self.cfg.name!r} did not start: {type(exc).__name__}: {exc}"))
        finally:
            if stop is self._stop:
                self._client = None

    def _submit(self, coro: Any) -> Future[Any]:
        return asyncio.run_coroutine_threadsafe(coro, self._loop)

    async def call(self, name: str, arguments: dict[str, Any]) -> ToolOutcome:
        """Call a tool from any event loop; never raises on the server's behaviour."""
        return await asyncio.wrap_future(self._submit(self._call(name, arguments)))

    def call_sync(self, name: str, arguments: dict[str, Any]) -> ToolOutcome:
        """``call`` for synchronous callers (demonstrations, tests)."""
        return self._submit(self._call(name, arguments)).result()

    async def _call(self, name: str, arguments: dict[str, Any]) -> ToolOutcome:
        if self._client is None:
            try:
                await self._open()  # first use, or the server died: start it (again)
            except McpUnavailable as exc:
                return ToolOutcome(False, error=str(exc))
        client, stop = self._client, self._stop
        try:
            result = await asyncio.wait_for(client.call_tool(name, arguments), self.cfg.call_timeout_s + 5)
        except (TimeoutError, asyncio.TimeoutError):
            return ToolOutcome(False, error=f"tool {name!r} timed out after {self.cfg.call_timeout_s:g} s")
        except Exception as exc:  # noqa: BLE001 - the SDK raises MCPError for timeouts and lost servers
            message = str(exc)
            if "timed out" in message:
                return ToolOutcome(False, error=f"tool {name!r} timed out after {self.cfg.call_timeout_s:g} s")
            if stop is not None:
                stop.set()  # drop the session: the next call starts the server again
            self._client = None
            return ToolOutcome(False, error=f"mcp server {self.cfg.name!r} failed during {name!r} "
                                            f"({type(exc).__name__}: {message}); it is restarted for the next call")
        return outcome_of(result)

    def close(self) -> None:
        """Stop the server (or drop the HTTP session), then the connection's thread."""
        if not self._thread.is_alive():
            return
        try:
            self._submit(self._shutdown()).result(15)
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=10)

    async def _shutdown(self) -> None:
        if self._stop is not None:
            self._stop.set()
        if self._holder is not None:
            await asyncio.wait([self._holder], timeout=10)  # leaves the session: the SDK stops the process
