"""The tool-use environment: sandbox, AST matching, built-in tasks, FTRL files, episodes."""

from __future__ import annotations

import asyncio
import json
from collections import Counter
from functools import cache
from pathlib import Path

import pytest
from pydantic import ValidationError

from envs.base import StepResult, Task
from envs.config import ToolUseConfig
from envs.registry import make_task_source
from envs.tool_use.matching import ast_match, match_trace, parameter_score, values_match
from envs.tool_use.sandbox import Limits, run_tool, run_tool_async
from envs.tool_use.source import ToolUseTaskSource, numeric_match
from envs.toolcalls import ToolCall, format_call

FIXTURES = Path(__file__).parent / "fixtures" / "tool_use"
LIMITS = Limits(timeout_s=1.0, memory_mb=128)


@cache
def source(**kw) -> ToolUseTaskSource:
    return ToolUseTaskSource(ToolUseConfig(num_train_tasks=200, num_heldout_tasks=40, **kw))


def call(name: str, **arguments) -> str:
    return format_call(ToolCall(name=name, arguments=arguments))


def episode(src: ToolUseTaskSource, task: Task, actions: list[str]) -> list[StepResult]:
    async def go() -> list[StepResult]:
        env = src.make_env()
        await env.reset(task)
        return [await env.step(a) for a in actions]

    return asyncio.run(go())


BAD_TOOLS = {
    "boom": "def boom():\n    raise ValueError('the tool broke')\n",
    "hang": "def hang():\n    while True:\n        pass\n",
    "hog": "def hog():\n    return len(bytearray(2 * 1024 ** 3))\n",
    "fetch": "import urllib.request\ndef fetch():\n    return urllib.request.urlopen('http://10.0.0.1').read()\n",
}  # fmt: skip


def bad_task() -> Task:
    schema = {"type": "object", "properties": {}}
    return Task(
        task_id="bad",
        messages=[{"role": "user", "content": "break things"}],
        tools=[
            {"type": "function", "function": {"name": n, "parameters": schema}} for n in BAD_TOOLS
        ],
        gold_answers=["x"],
        metadata={"functions": BAD_TOOLS},
    )


@pytest.mark.parametrize(
    "name,needle",
    [
        ("boom", "ValueError: the tool broke"),
        ("hang", "timed out after 1 s"),
        ("hog", "memory limit"),
        ("fetch", "network access is disabled"),
    ],
)
def test_failing_tools_become_invalid_observations(name, needle):
    src = ToolUseTaskSource(ToolUseConfig(num_train_tasks=1, num_heldout_tasks=0,
                                          tool_timeout_s=1.0, tool_memory_mb=128))  # fmt: skip
    (result,) = episode(src, bad_task(), [call(name)])
    assert result.invalid_action and not result.done
    (message,) = result.observation.messages
    assert message["role"] == "tool" and needle in message["content"]


def test_sandbox_sync_and_async_agree_and_capture_prints():
    source_text = "def double(x):\n    print('noise')\n    return x * 2\n"
    assert run_tool([source_text], "double", {"x": 21}, LIMITS).text() == "42"
    outcome = asyncio.run(run_tool_async([source_text], "double", {"x": 1.5}, LIMITS))
    assert outcome.ok and outcome.result == 3.0
    assert "unexpected keyword" in run_tool([source_text], "double", {"y": 1}, LIMITS).error


def test_values_and_calls_match_like_bfcl():
    assert values_match(2, 2.0) and values_match(0.1 + 0.2, 0.3)  # int/float interchange, tol
    assert values_match("New York", "new_york") and not values_match("NYC", "New York")
    assert not values_match(True, 1) and not values_match(1, True)
    assert values_match([1, {"a": "X"}], [1.0, {"a": "x"}]) and not values_match([1, 2], [2, 1])
    gold = ToolCall(name="f", arguments={"a": 1, "b": "x"})
    assert ast_match(ToolCall(name="f", arguments={"a": 1.0, "b": "X"}), gold)
    assert not ast_match(ToolCall(name="f", arguments={"a": 1}), gold)  # missing b
    assert not ast_match(ToolCall(name="f", arguments={"a": 1, "b": "x", "c": 0}), gold)
    assert not ast_match(ToolCall(name="g", arguments={"a": 1, "b": "x"}), gold)
    # keys {a, b, c}: only a matches -> 1/3
    assert parameter_score(ToolCall(name="f", arguments={"a": 1, "c": 0}), gold) == pytest.approx(
        1 / 3
    )


def test_match_trace_counts_each_gold_call_once():
    g1, g2 = ToolCall(name="f", arguments={"a": 1}), ToolCall(name="g", arguments={})
    pred = [g1, g1, ToolCall(name="h", arguments={})]
    # one of the two f calls matches g1, g2 unmatched: precision 1/3, recall 1/2, f1 = 0.4
    score = match_trace(pred, [g1, g2])
    assert score == pytest.approx({"matched": 1, "precision": 1 / 3, "recall": 0.5, "f1": 0.4})
    assert match_trace([], [])["f1"] == 1.0


def test_generated_tasks_are_deterministic_disjoint_and_2_to_4_deep():
    a, b = source(), ToolUseTaskSource(ToolUseConfig(num_train_tasks=200, num_heldout_tasks=40))
    assert [t.model_dump() for t in a.tasks("train")] == [t.model_dump() for t in b.tasks("train")]
    questions = lambda split: {t.messages[-1]["content"] for t in a.tasks(split)}  # noqa: E731
    assert not questions("train") & questions("heldout")
    assert (
        len(questions("train")) == 200
        and a.tasks("heldout")[0].task_id == "tool_use-s0-heldout-00000"
    )
    assert set(Counter(len(t.gold_tool_calls) for t in a.tasks("train"))) == {2, 3, 4}
    only_two = source(max_calls=2)
    assert {len(t.gold_tool_calls) for t in only_two.tasks("train")} == {2}


def test_demonstrations_replay_to_success_with_labels():
    src = source()
    by_depth = {len(t.gold_tool_calls): t for t in src.tasks("train")}
    for task in by_depth.values():
        demo = src.demonstration(task)
        actions = [m["content"] for m in demo if m["role"] == "assistant"]
        results = episode(src, task, actions)
        assert results[-1].done and results[-1].reward == 1.0 and results[-1].info["correct"]
        assert [r.info["label"] for r in results] == [1] * len(results)
        outputs = [m["content"] for m in demo if m["role"] == "tool"]
        assert outputs == task.metadata["gold_outputs"]


def test_bad_calls_run_nothing_and_several_calls_run_in_order():
    src = source()
    task = src.tasks("train")[0]
    actions = [
        '<tool_call>{"name": "add", "arguments": {"a": 1, </tool_call>',
        call("launch_rocket"),
        call("add", a="one", b=2),
        call("add", a=1),
        call("add", a=1, b=2) + call("multiply", a=3, b=4) + call("divide", a=1, b=0),
    ]
    *bad, several = episode(src, task, actions)
    needles = ["not valid JSON", "unknown tool", "type number", "missing required"]
    for result, needle in zip(bad, needles):
        assert result.invalid_action and needle in result.observation.messages[0]["content"]
    contents = [m["content"] for m in several.observation.messages]
    assert contents == ["3", "12", "Error: ZeroDivisionError: cannot divide by zero"]
    assert several.invalid_action and not several.done


def test_turn_limit_and_numeric_success():
    src = source(max_turns=5, max_calls=4)
    task = src.tasks("train")[0]
    results = episode(src, task, ["thinking"] * 5)
    assert [r.done for r in results] == [False] * 4 + [True] and results[-1].answer is None
    assert numeric_match("3.2400", ["3.24"]) and numeric_match(" 1,000 ", ["1000.0"])
    assert not numeric_match("3.25", ["3.24"]) and numeric_match("Hello!", ["hello"])


def test_ftrl_layout_files_load_and_replay(tmp_path):
    cfg = ToolUseConfig(train_path=str(FIXTURES / "train.jsonl"),
                        heldout_path=str(FIXTURES / "heldout.jsonl"))  # fmt: skip
    src = make_task_source(cfg)
    wall, shout = src.tasks("train")
    assert wall.task_id == "train-wall-1" and shout.gold_tool_calls[0].arguments == {
        "text": "hello"
    }
    assert [m["content"] for m in src.demonstration(wall) if m["role"] == "tool"] == ["12", "1.2"]
    assert src.demonstration(shout)[-1]["content"] == "<answer>HELLO!</answer>"
    assert src.demonstration(src.tasks("heldout")[0])[-2]["content"] == "1.0"


@pytest.mark.parametrize(
    "change,needle",
    [
        ({"functions": ["def rectangle_area(:"]}, "field 'functions[0]' is not valid Python"),
        ({"functions": ["def other():\n    pass\n"]}, "defines no function for tools"),
        ({"tools": 3}, "field 'tools'"),
        ({"answer": None}, "field 'answer'"),
        ({"question": None}, "field 'question'"),
        ({"gold_calls": [{"name": "shout", "parameters": "{oops"}]}, "gold_calls[0].arguments"),
    ],
)
def test_bad_ftrl_records_fail_naming_line_and_field(tmp_path, change, needle):
    lines = (FIXTURES / "train.jsonl").read_text().splitlines()
    record = {**json.loads(lines[0]), **change}
    path = tmp_path / "train.jsonl"
    path.write_text(lines[1] + "\n" + json.dumps(record) + "\n")
    with pytest.raises(
        ValueError, match=rf"train.jsonl:2: .*{needle.replace('[', '.').replace(']', '.')}"
    ):
        ToolUseTaskSource(ToolUseConfig(train_path=str(path), heldout_path=str(path)))


def test_config_validation():
    with pytest.raises(ValidationError, match="both"):
        ToolUseConfig(train_path="a.jsonl")
    with pytest.raises(ValidationError, match="max_turns"):
        ToolUseConfig(max_turns=3)
    with pytest.raises(ValidationError, match="min_calls"):
        ToolUseConfig(min_calls=4, max_calls=3)


def test_sandbox_blocks_every_socket_entry_point_and_returns_json_typed_results():
    probe = (
        "def probe():\n"
        "    import socket\n"
        "    out = []\n"
        "    for fn in (socket.socket, lambda: socket.create_connection(('10.0.0.1', 80), 1),\n"
        "               lambda: socket.getaddrinfo('example.com', 80), socket.socketpair):\n"
        "        try:\n"
        "            fn()\n"
        "            out.append('open')\n"
        "        except PermissionError:\n"
        "            out.append('blocked')\n"
        "    return out\n"
    )
    assert run_tool([probe], "probe", {}, LIMITS).result == ["blocked"] * 4
    # JSON-typed results pass as they are; other values arrive as their str, as json's default=str
    odd = "def odd():\n    return {1: (1, 2.5, None, True), 's': {3}, 'n': float('nan')}\n"
    assert run_tool([odd], "odd", {}, LIMITS).result == {"1": [1, 2.5, None, True], "s": "{3}", "n": "nan"}
    # a tool that writes its own "reply" to the real stdout gets an error, not a forged result
    forge = "import os\ndef forge():\n    os.write(1, b'__import__(\"os\")')\n    return 1\n"
    assert not run_tool([forge], "forge", {}, LIMITS).ok
