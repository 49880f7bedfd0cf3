"""Tools from MCP servers: real servers over stdio and streamable HTTP (one written with the mcp
SDK in tests/mcp_server.py, and the published mcp-server-time), their tools offered to the policy,
calls answered as observations, failures, hangs and crashes as observations, the MCP task set
graded on answers and traces, and bad configs refused naming the field."""

from __future__ import annotations

import asyncio
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterator

import httpx
import pytest
import yaml
from pydantic import ValidationError

from envs.config import McpServerConfig, McpTasksConfig
from envs.mcp import McpTools
from envs.registry import make_task_source
from envs.toolcalls import ToolCall, format_answer, format_call

pytest.importorskip("mcp")
pytestmark = pytest.mark.slow  # starts ~10 MCP server processes (~45 s)

SERVER = str(Path(__file__).with_name("mcp_server.py"))
TEST = {"name": "test", "command": sys.executable, "args": [SERVER], "call_timeout_s": 2}
TIME = {"name": "time", "command": sys.executable, "args": ["-m", "mcp_server_time", "--local-timezone", "UTC"]}
PARIS_TOKYO = {"source_timezone": "Europe/Paris", "time": "14:30", "target_timezone": "Asia/Tokyo"}


def call(name: str, **arguments) -> str:
    return format_call(ToolCall(name=name, arguments=arguments))


@pytest.fixture(scope="module")
def tools() -> Iterator[McpTools]:
    box = McpTools([McpServerConfig(**TEST), McpServerConfig(**TIME)])
    yield box
    box.close()


def test_servers_tools_become_openai_definitions(tools: McpTools) -> None:
    by_name = {d["function"]["name"]: d["function"] for d in tools.definitions}
    assert set(by_name) == {"add", "counter", "fail", "hang", "crash", "get_current_time", "convert_time"}
    assert by_name["add"]["description"] == "Add two integers."
    assert by_name["add"]["parameters"]["properties"] == {"a": {"title": "A", "type": "integer"},
                                                         "b": {"title": "B", "type": "integer"}}
    assert by_name["add"]["parameters"]["required"] == ["a", "b"]
    assert set(by_name["convert_time"]["parameters"]["required"]) == set(PARIS_TOKYO)
    assert tools.server_of["convert_time"].name == "time"


def test_results_errors_timeouts_and_a_crash_are_observations(tools: McpTools) -> None:
    session = tools.episode()
    assert session.call_sync("add", {"a": 2, "b": 3}).text() == "5"
    converted = session.call_sync("convert_time", PARIS_TOKYO)
    assert converted.ok and '"datetime": "' in converted.text() and "T22:30:00+09:00" in converted.text()
    failed = session.call_sync("fail", {"message": "no such row"})
    assert not failed.ok and failed.text().startswith("Error: ")
    bad = session.call_sync("add", {"a": "x"})
    assert not bad.ok and "validation error" in bad.text()
    start = time.monotonic()
    hung = asyncio.run(session.call("hang", {"seconds": 30}))
    assert not hung.ok and hung.error == "tool 'hang' timed out after 2 s" and time.monotonic() - start < 10
    assert session.call_sync("add", {"a": 1, "b": 1}).text() == "2"  # the server still serves after a timeout
    first = int(session.call_sync("counter", {}).text())
    crashed = session.call_sync("crash", {})
    assert not crashed.ok and "it is restarted for the next call" in crashed.error
    assert session.call_sync("counter", {}).text() == "1" and first >= 1  # a new process
    assert tools.shared["test"].starts == 2


def test_streamable_http_server() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, SERVER, "http", str(port)], stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                httpx.get(f"http://127.0.0.1:{port}/mcp", timeout=1)
                break
            except httpx.TransportError:
                time.sleep(0.2)
        box = McpTools([McpServerConfig(name="remote", url=f"http://127.0.0.1:{port}/mcp")])
        try:
            session = box.episode()
            assert session.call_sync("add", {"a": 20, "b": 22}).text() == "42"
            assert [session.call_sync("counter", {}).text() for _ in range(2)] == ["1", "2"]
        finally:
            box.close()
    finally:
        proc.kill()
        proc.wait()


def _task_file(tmp_path: Path, name: str, records: list[dict]) -> str:
    path = tmp_path / name
    path.write_text(yaml.safe_dump(records))
    return str(path)


def _tasks_config(tmp_path: Path, servers: list[dict], records: list[dict]) -> dict:
    return {"type": "mcp_tasks", "mcp": servers, "max_turns": 4,
            "train_path": _task_file(tmp_path, "train.yaml", records),
            "heldout_path": _task_file(tmp_path, "heldout.yaml", records[:1])}


TASKS = [
    {"id": "tokyo", "prompt": "It is 14:30 in Paris. What time is it in Tokyo (HH:MM)?", "answers": ["22:30"],
     "gold_calls": [{"name": "convert_time", "arguments": PARIS_TOKYO}]},
    {"id": "sum", "prompt": "Add 19 and 23 with the tool.", "gold_calls": [{"name": "add", "arguments": {"a": 19, "b": 23}}]},
]


def _play(env, task, actions: list[str]):
    asyncio.run(env.reset(task))
    try:
        return [asyncio.run(env.step(a)) for a in actions]
    finally:
        env.close()


def test_the_mcp_task_set_grades_answers_and_traces(tmp_path: Path) -> None:
    source = make_task_source(_tasks_config(tmp_path, [TEST, TIME], TASKS))
    tokyo, total = source.tasks("train")
    assert source.scores_outcome and tokyo.metadata["checks"] == ["answer", "calls"] and total.metadata["checks"] == ["calls"]
    assert {t["function"]["name"] for t in tokyo.tools} >= {"convert_time", "add"}
    assert source.provides() == {"anchor", "gold_tool_calls"}  # the sum task has no answers
    converted, answered = _play(source.make_env(), tokyo, [call("convert_time", **PARIS_TOKYO), format_answer("22:30")])
    assert "T22:30:00+09:00" in converted.observation.messages[0]["content"] and converted.info["matched_gold"] == [0]
    assert answered.reward == 1.0 and answered.info["correct"]
    [guessed] = _play(source.make_env(), tokyo, [format_answer("22:30")])  # right answer, no call made
    assert guessed.reward == 0.0
    added, done = _play(source.make_env(), total, [call("add", a=23, b=19), format_answer("42")])
    assert added.observation.messages[0]["content"] == "42" and done.reward == 0.0  # not the gold call's arguments
    demo = source.demonstration(tokyo)
    assert [m["role"] for m in demo] == ["assistant", "tool", "assistant"] and demo[-1]["content"] == format_answer("22:30")


def test_a_stateful_server_runs_per_episode_a_shared_one_per_actor(tmp_path: Path) -> None:
    shared = make_task_source(_tasks_config(tmp_path, [TEST], TASKS[1:]))
    own = make_task_source(_tasks_config(tmp_path, [TEST | {"stateful": True}], TASKS[1:]))
    task = shared.tasks("train")[0]
    counts = {}
    for name, source in (("shared", shared), ("stateful", own)):
        counts[name] = [_play(source.make_env(), task, [call("counter")])[0].observation.messages[0]["content"]
                        for _ in range(2)]
    assert counts == {"shared": ["1", "2"], "stateful": ["1", "1"]}
    shared.mcp.close()
    own.mcp.close()


def test_other_environments_take_mcp_tools(tmp_path: Path) -> None:
    pytest.importorskip("reasoning_gym")
    source = make_task_source({"type": "reasoning_gym", "num_train_tasks": 2, "num_heldout_tasks": 1,
                               "tasks": [{"name": "basic_arithmetic"}], "mcp": [TEST | {"tools": ["add"]}]})
    task = source.tasks("train")[0]
    assert [t["function"]["name"] for t in task.tools] == ["add"] and source.cfg.max_turns == 4
    added, unknown = _play(source.make_env(), task, [call("add", a=2, b=2), call("counter")])
    assert added.observation.messages[0]["content"] == "4" and not added.invalid_action
    assert unknown.invalid_action and "available tools: add" in unknown.observation.messages[0]["content"]
    source.mcp.close()


@pytest.mark.parametrize("record, message", [
    ({"prompt": "x", "answer": "y"}, "unknown fields ['answer']"),
    ({"prompt": "x"}, "no field answers or gold_calls"),
    ({"prompt": "x", "answers": ["1"], "check": ["calls"]}, "check ['calls'] needs field gold_calls"),
    ({"answers": ["1"]}, "field 'prompt' (or 'messages') is missing"),
])
def test_a_bad_task_record_is_refused_naming_file_record_and_field(tmp_path: Path, record: dict, message: str) -> None:
    with pytest.raises(ValueError) as err:
        make_task_source(_tasks_config(tmp_path, [TEST | {"tools": ["add"]}], [record]))
    assert "train.yaml record 0" in str(err.value) and message in str(err.value)


@pytest.mark.parametrize("server, message", [
    ({"name": "x", "command": "python", "url": "http://h/mcp"}, "set command (a process the run starts) or url"),
    ({"name": "x", "url": "http://h/mcp", "args": ["-v"]}, "apply to a command"),
    ({"name": "bad name", "command": "python"}, "String should match pattern"),
])
def test_a_bad_server_config_is_refused(server: dict, message: str) -> None:
    with pytest.raises(ValidationError) as err:
        McpServerConfig.model_validate(server)
    assert message in str(err.value)
    with pytest.raises(ValidationError, match="names a server twice"):
        McpTasksConfig.model_validate({"mcp": [TEST, TEST], "train_path": "a", "heldout_path": "b"})


def test_a_server_that_cannot_start_fails_at_start_naming_it(tmp_path: Path) -> None:
    with pytest.raises(Exception, match="mcp server 'broken' did not start"):
        make_task_source(_tasks_config(tmp_path, [{"name": "broken", "command": sys.executable, "args": ["-c", "raise SystemExit(2)"]}],
                                       TASKS[1:]))
    with pytest.raises(Exception, match=r"mcp server 'test' has no tools \['sub'\]"):
        make_task_source(_tasks_config(tmp_path, [TEST | {"tools": ["add", "sub"]}], TASKS[1:]))


def test_search_qa_takes_mcp_tools_beside_its_search() -> None:
    source = make_task_source({"type": "search_qa", "num_entities": 40, "num_train_tasks": 4, "num_heldout_tasks": 2,
                               "mcp": [TEST | {"tools": ["add"]}]})
    task = source.tasks("train")[0]
    assert [t["function"]["name"] for t in task.tools] == ["search", "add"]
    assert source.provides() == make_task_source({"type": "search_qa", "num_entities": 40}).provides()
    search = call("search", query=task.gold_tool_calls[0].arguments["query"])
    added, searched, mixed, answered = _play(source.make_env(), task, [
        call("add", a=2, b=3), search, call("add", a=1, b=1) + search, format_answer(task.gold_answers[0])])
    assert added.observation.messages == [{"role": "tool", "name": "add", "content": "5"}]
    assert (added.reward, added.info["label"], added.invalid_action, added.done) == (0.0, 0, False, False)
    assert searched.observation.messages[0]["name"] == "search" and searched.info["label"] == 1  # the environment's own step
    assert mixed.invalid_action and "in separate messages" in mixed.observation.messages[0]["content"]
    assert answered.done and answered.reward == 1.0
    source.mcp.close()
