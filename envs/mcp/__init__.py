"""Tools from MCP servers: connections (``envs.mcp.client``), the tool box an environment routes
calls through (``envs.mcp.tools``) and the MCP task set (``env.type: mcp_tasks``,
``envs.mcp.tasks``)."""

from envs.mcp.client import McpConnection, McpUnavailable
from envs.mcp.tools import McpTools
