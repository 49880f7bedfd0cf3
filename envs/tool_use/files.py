"""Tool-use tasks from files in the MatchTIR / FTRL (ToolHop-style) layout, one JSON per line::

    {"id": "q1",
     "question": "..."                 (or "messages": [{"role": "user", "content": ...}, ...]),
     "tools": {"name": {JSON schema}}  (or a list of schemas, bare or {"type": "function", ...}),
     "functions": ["def name(...): ..."]  (or {"name": "source"}),
     "gold_calls": [{"name": ..., "arguments": {...}}]  ("parameters" also read),
     "answer": "..."                   (or "golden_answers": [...])}

Problems fail at load time naming the file, line and field: a broken task file should stop a
run before it starts, not fail episodes one by one.
"""

from __future__ import annotations

import ast
import json
from typing import Any

from envs.base import Task
from envs.records import read_records
from envs.tool_use.generator import SYSTEM_PROMPT
from envs.toolcalls import ToolCall
from envs.tools import tool_name


def _wrap_tools(where: str, tools: Any) -> list[dict[str, Any]]:
    if isinstance(tools, dict):
        tools = list(tools.values())
    if not isinstance(tools, list) or not tools:
        raise ValueError(f"{where}: field 'tools' must be a non-empty list or object of schemas")
    out = []
    for i, tool in enumerate(tools):
        spec = tool.get("function", tool) if isinstance(tool, dict) else None
        if not isinstance(spec, dict) or not isinstance(spec.get("name"), str):
            raise ValueError(f"{where}: field 'tools[{i}]' must be a schema with a string name")
        out.append(tool if "function" in tool else {"type": "function", "function": tool})
    return out


def _sources(where: str, functions: Any) -> dict[str, str]:
    """Map each top-level function a source defines to that source."""
    if isinstance(functions, dict):
        items = list(functions.items())
    elif isinstance(functions, list):
        items = [(str(i), src) for i, src in enumerate(functions)]
    else:
        raise ValueError(f"{where}: field 'functions' must be a list or object of Python sources")
    out: dict[str, str] = {}
    for key, source in items:
        if not isinstance(source, str):
            raise ValueError(f"{where}: field 'functions[{key}]' must be Python source text")
        try:
            tree = ast.parse(source)
        except SyntaxError as exc:
            problem = f"is not valid Python ({exc.msg}, line {exc.lineno})"
            raise ValueError(f"{where}: field 'functions[{key}]' {problem}") from None
        for node in tree.body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                out.setdefault(node.name, source)
        if isinstance(functions, dict):
            out.setdefault(key, source)
    return out


def read_gold_calls(where: str, record: dict[str, Any]) -> list[ToolCall] | None:
    key = next((k for k in ("gold_calls", "gold_tool_calls", "golden_calls") if k in record), None)
    if key is None:
        return None
    calls = []
    for i, call in enumerate(record[key] or []):
        args = call.get("arguments", call.get("parameters", {})) if isinstance(call, dict) else None
        if isinstance(args, str):
            try:
                args = json.loads(args)
            except json.JSONDecodeError:
                args = None
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            raise ValueError(f"{where}: field '{key}[{i}]' needs a string 'name'")
        if not isinstance(args, dict):
            raise ValueError(f"{where}: field '{key}[{i}].arguments' must be a JSON object")
        calls.append(ToolCall(name=call["name"], arguments=args))
    return calls


def _messages(where: str, record: dict[str, Any]) -> list[dict[str, Any]]:
    messages = record.get("messages")
    if messages is not None:
        if not isinstance(messages, list) or not all(
            isinstance(m, dict) and "role" in m for m in messages
        ):
            raise ValueError(f"{where}: field 'messages' must be a list of chat messages")
        return messages
    question = record.get("question")
    if not isinstance(question, str) or not question.strip():
        raise ValueError(f"{where}: field 'question' (or 'messages') is missing")
    return [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": question}]


def _answers(where: str, record: dict[str, Any]) -> list[str]:
    answers = record.get("golden_answers", record.get("answer"))
    if isinstance(answers, (str, int, float)) and not isinstance(answers, bool):
        answers = [str(answers)]
    if not isinstance(answers, list) or not answers:
        raise ValueError(f"{where}: field 'answer' is missing or empty")
    return [str(a) for a in answers]


def load_tool_tasks(path: str, split: str) -> list[Task]:
    """Tasks of one file; every tool named in ``tools`` must have a source in ``functions``."""
    tasks: list[Task] = []
    for where, record in read_records(path):
        tools = _wrap_tools(where, record.get("tools"))
        sources = _sources(where, record.get("functions"))
        missing = sorted({tool_name(t) for t in tools} - set(sources))
        if missing:
            raise ValueError(f"{where}: field 'functions' defines no function for tools {missing}")
        tasks.append(
            Task(
                task_id=f"{split}-{record.get('id', len(tasks))}",
                messages=_messages(where, record),
                tools=tools,
                gold_answers=_answers(where, record),
                gold_tool_calls=read_gold_calls(where, record),
                metadata={"functions": {tool_name(t): sources[tool_name(t)] for t in tools}},
            )
        )
    if len({t.task_id for t in tasks}) != len(tasks):
        raise ValueError(f"{path}: field 'id' repeats; task ids must be unique")
    return tasks
