"""The MCP tools an environment offers: which server serves each tool, and one call path.

A task source holds one ``McpTools`` per process (a rollout actor, an environment actor, the
driver checking the config), so a stateless server runs once per actor and serves every episode
there. Each episode gets an ``McpSession`` from ``episode()``: calls to a stateless server go to
the shared connection; a ``stateful`` server is started for the episode and stopped with it.
"""

from __future__ import annotations

from typing import Any

from envs.base import Task
from envs.config import McpServerConfig
from envs.mcp.client import McpConnection, McpUnavailable, openai_tool
from envs.tool_use.sandbox import ToolOutcome
from envs.tools import tool_name


class McpTools:
    """The servers of one environment config, their tools listed once at start."""

    def __init__(self, servers: list[McpServerConfig]) -> None:
        self.servers = servers
        self.shared = {s.name: McpConnection(s) for s in servers}
        self.server_of: dict[str, McpServerConfig] = {}
        """Tool name -> the server that serves it."""
        self.definitions: list[dict[str, Any]] = []
        """Every tool as an OpenAI function definition, in server order."""
        for server in servers:
            for tool in self.shared[server.name].start():
                if tool.name in self.server_of:
                    other = self.server_of[tool.name].name
                    raise McpUnavailable(f"mcp servers {other!r} and {server.name!r} both offer a tool "
                                         f"{tool.name!r}: keep one with the other's `tools` list")
                self.server_of[tool.name] = server
                self.definitions.append(openai_tool(tool))
            if server.stateful:  # listed once here; every episode starts its own
                self.shared.pop(server.name).close()

    @property
    def names(self) -> set[str]:
        return set(self.server_of)

    def episode(self) -> McpSession:
        """The calls of one episode (its own processes for stateful servers, started lazily)."""
        return McpSession(self)

    def close(self) -> None:
        for conn in self.shared.values():
            conn.close()


def offer_mcp_tools(splits: dict[str, list[Task]], servers: list[McpServerConfig]) -> McpTools | None:
    """Start ``servers`` (None when there are none) and add their tools to every task's, in
    place. Raises ValueError when a task's own tool has the name of a server's."""
    if not servers:
        return None
    mcp = McpTools(servers)
    for tasks in splits.values():
        for task in tasks:
            clash = sorted(mcp.names & {tool_name(t) for t in task.tools})
            if clash:
                mcp.close()
                raise ValueError(f"task {task.task_id} has tools {clash} of its own, and MCP servers offer tools "
                                 "of those names: leave them out with the servers' `tools` lists")
            task.tools = [*task.tools, *mcp.definitions]
    return mcp


class McpSession:
    """One episode's route to the tools; ``close`` stops the servers it started."""

    def __init__(self, tools: McpTools) -> None:
        self.tools = tools
        self.own: dict[str, McpConnection] = {}

    def _connection(self, name: str) -> McpConnection:
        server = self.tools.server_of[name]
        if not server.stateful:
            return self.tools.shared[server.name]
        if server.name not in self.own:
            self.own[server.name] = McpConnection(server)
        return self.own[server.name]

    async def call(self, name: str, arguments: dict[str, Any]) -> ToolOutcome:
        return await self._connection(name).call(name, arguments)

    def call_sync(self, name: str, arguments: dict[str, Any]) -> ToolOutcome:
        return self._connection(name).call_sync(name, arguments)

    def close(self) -> None:
        for conn in self.own.values():
            conn.close()
        self.own = {}
