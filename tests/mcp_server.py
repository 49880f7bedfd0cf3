"""An MCP server written with the mcp SDK's MCPServer, for tests/test_envs_mcp.py.

``python tests/mcp_server.py`` serves stdio; ``python tests/mcp_server.py http PORT`` serves
streamable HTTP on 127.0.0.1:PORT at /mcp. Its tools: arithmetic, a per-process counter (to tell
one server process from another), and tools that fail, hang and kill the process.
"""

from __future__ import annotations

import os
import sys
import time

from mcp.server.mcpserver import MCPServer

server = MCPServer("turnrl-test")
CALLS = {"count": 0}


@server.tool()
def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


@server.tool()
def counter() -> int:
    """How many times this server process was asked (1 on its first call)."""
    CALLS["count"] += 1
    return CALLS["count"]


@server.tool()
def fail(message: str) -> str:
    """Raise an error with this message."""
    raise ValueError(message)


@server.tool()
def hang(seconds: float) -> str:
    """Sleep this long, then answer."""
    time.sleep(seconds)
    return "awake"


@server.tool()
def crash() -> str:
    """Kill this server process."""
    os._exit(3)


if __name__ == "__main__":
    if sys.argv[1:2] == ["http"]:
        server.run("streamable-http", host="127.0.0.1", port=int(sys.argv[2]))
    else:
        server.run()
