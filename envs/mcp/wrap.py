"""MCP tools beside an environment's own action vocabulary (``env.mcp`` on search_qa, household,
bfcl): the environment is wrapped, not changed.

A message whose tool calls all name MCP tools is answered here: the calls run on their servers
(``envs.mcp.tools``), their results are the observation, the turn earns no reward and, where
the environment labels steps for the PRM, label 0 (an MCP call is no progress by the
environment's own measure). Any other message (an answer, the environment's own calls, plain
text) goes to the environment unchanged. A message mixing both kinds of call is an observation
asking to send them apart: the environment's step cannot take half a message. Turns spent on
MCP calls count against the episode's ``max_turns`` (the rollout loop's bound), not against the
environment's own turn counter.
"""

from __future__ import annotations

from typing import Any

from envs.base import Environment, Observation, StepResult, Task, TaskSource, tool_step
from envs.mcp.tools import McpSession, McpTools, offer_mcp_tools
from envs.toolcalls import parse_action
from envs.tools import tool_message


class McpToolsEnv(Environment):
    """An environment with MCP servers' tools beside its own."""

    def __init__(self, inner: Environment, mcp: McpTools) -> None:
        self.inner, self.mcp = inner, mcp
        self.session: McpSession | None = None

    @property  # type: ignore[override]
    def max_turns(self) -> int:
        return self.inner.max_turns

    @property  # type: ignore[override]
    def chat_format(self) -> str:
        return self.inner.chat_format

    @chat_format.setter
    def chat_format(self, value: str) -> None:
        self.inner.chat_format = value

    async def reset(self, task: Task) -> Observation:
        self.session = self.mcp.episode()
        return await self.inner.reset(task)

    async def step(self, action: str) -> StepResult:
        parsed = parse_action(action, self.chat_format)
        ours = [c for c in parsed.calls if c.name in self.mcp.names]
        if not ours or parsed.answer is not None:
            return await self.inner.step(action)
        assert self.session is not None, "step() before reset()"
        if len(ours) < len(parsed.calls):
            theirs = sorted({c.name for c in parsed.calls} - self.mcp.names)
            text = (f"Error: call the MCP tools ({', '.join(sorted({c.name for c in ours}))}) and the environment's own "
                    f"({', '.join(theirs)}) in separate messages")
            return tool_step([tool_message(None, text)], False, True, parsed.calls, {"label": 0})
        outcomes = [await self.session.call(c.name, c.arguments) for c in ours]
        messages = [tool_message(c.name, o.text()) for c, o in zip(ours, outcomes)]
        messages += [tool_message(None, f"Error: {e}") for e in parsed.errors]
        invalid = bool(parsed.errors) or not all(o.ok for o in outcomes)
        return tool_step(messages, False, invalid, parsed.calls, {"label": 0, "mcp": True})

    def close(self) -> None:
        if self.session is not None:
            self.session.close()
            self.session = None
        self.inner.close()


class McpToolsSource(TaskSource):
    """A task source whose episodes also offer MCP servers' tools (every task lists them)."""

    def __init__(self, inner: TaskSource, servers: list[Any]) -> None:
        self.inner = inner
        self.mcp = offer_mcp_tools({split: inner.tasks(split) for split in ("train", "heldout")}, servers)
        self.scores_outcome, self.success_at = inner.scores_outcome, inner.success_at

    def tasks(self, split: str) -> list[Task]:
        return self.inner.tasks(split)

    def make_env(self) -> Environment:
        assert self.mcp is not None
        return McpToolsEnv(self.inner.make_env(), self.mcp)

    def demonstration(self, task: Task) -> list[dict[str, Any]]:
        return self.inner.demonstration(task)

    def corpus_text(self) -> list[str]:
        return self.inner.corpus_text()

    def provides(self) -> set[str]:
        return self.inner.provides()

    def success(self, task: Task, answer: str | None) -> bool:
        return self.inner.success(task, answer)

    def episode_metrics(self, task: Task, answer: str | None, calls: list[Any], labels: list[float]) -> dict[str, float]:
        return self.inner.episode_metrics(task, answer, calls, labels)

