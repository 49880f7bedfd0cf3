"""BFCL v4 as an environment (envs/bfcl): tasks and splits from the bfcl-eval wheel, episodes
that execute BFCL's API classes in a worker process, and success equal to bfcl_eval's own
checkers on the same outputs, ground truth and perturbed alike. No model: actions are written
in the Hermes format the policy would write."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import uuid
from typing import Any

import pytest
from pydantic import ValidationError

from envs.bfcl.data import in_heldout
from envs.bfcl.official import _ast_checker_module
from envs.bfcl.source import BfclTaskSource
from envs.config import BfclConfig
from envs.registry import make_task_source
from envs.toolcalls import ToolCall, format_call

SINGLE = ["simple_python", "multiple", "parallel", "parallel_multiple"]


@pytest.fixture(scope="module")
def source():
    src = BfclTaskSource(BfclConfig(categories=[*SINGLE, "multi_turn_base"], tool_timeout_s=1.0))
    yield src
    src.close()


def _tasks(source, category: str, n: int) -> list:
    every = source.tasks("train") + source.tasks("heldout")
    return sorted((t for t in every if t.metadata["category"] == category),
                  key=lambda t: int(t.task_id.rsplit("_", 1)[1]))[:n]


def test_splits_are_a_hash_of_the_task_id(source) -> None:
    train = {t.task_id for t in source.tasks("train")}
    held = {t.task_id for t in source.tasks("heldout")}
    assert not train & held and len(train | held) == 400 + 200 * 4  # every task, once
    assert all(in_heldout(t, 0, 0.5) for t in held) and not any(in_heldout(t, 0, 0.5) for t in train)
    # A category's split does not depend on which other categories are loaded
    alone = BfclTaskSource(BfclConfig(categories=["parallel"], max_tasks_per_category=5))
    assert {t.task_id for t in alone.tasks("heldout")} <= held and len(alone.tasks("train")) == 5
    other_seed = BfclTaskSource(BfclConfig(categories=["parallel"], split_seed=1))
    assert {t.task_id for t in other_seed.tasks("heldout")} != {
        t.task_id for t in source.tasks("heldout") if t.metadata["category"] == "parallel"}


def test_functions_are_openai_tools_and_gold_calls_come_from_the_answers(source) -> None:
    simple = _tasks(source, "simple_python", 1)[0]
    tool = simple.tools[0]["function"]
    assert tool["name"] == "calculate_triangle_area" and tool["parameters"]["type"] == "object"
    assert tool["description"].endswith("Note that the provided function is in Python 3 syntax.")
    # {"base": [10], "height": [5], "unit": ["units", ""]}: unit may be left out, so it is
    assert simple.gold_tool_calls == [ToolCall(name="calculate_triangle_area",
                                               arguments={"base": 10, "height": 5})]
    multi = _tasks(source, "multi_turn_base", 1)[0]
    assert multi.messages[0]["role"] == "user" and len(multi.tools) == 32  # TwitterAPI + file system
    # "sort('final_report.pdf')" is positional: it takes sort's first parameter's name
    assert ToolCall(name="sort", arguments={"file_name": "final_report.pdf"}) in multi.gold_tool_calls
    assert len(multi.gold_tool_calls) == 3 + 2 + 1 + 4


def test_config_names_a_bad_category_and_the_registry_builds_bfcl() -> None:
    with pytest.raises(ValidationError, match="categories"):
        BfclConfig(categories=["simple_java"])
    src = make_task_source({"type": "bfcl", "categories": ["multiple"], "max_tasks_per_category": 2})
    assert isinstance(src, BfclTaskSource) and len(src.tasks("heldout")) == 2


def _perturbed(calls: list[ToolCall]) -> dict[str, list[ToolCall]]:
    """The gold calls and the perturbations item 2 names: a wrong argument, a missing call,
    an extra call, and the order reversed."""
    def wrong(call: ToolCall) -> ToolCall:
        if not call.arguments:
            return ToolCall(name=call.name, arguments={"unexpected": 1})
        key, value = next(iter(call.arguments.items()))
        bad = (not value if isinstance(value, bool) else value + 7 if isinstance(value, (int, float))
               else f"{value}_wrong" if isinstance(value, str) else "wrong")
        return ToolCall(name=call.name, arguments={**call.arguments, key: bad})
    return {"gold": calls, "wrong_argument": [wrong(calls[0]), *calls[1:]],
            "missing_call": calls[:-1], "extra_call": [*calls, calls[0]],
            "wrong_order": calls[::-1]}


def _play(source, task, actions: list[str]):
    env = source.make_env()
    try:
        async def go():
            await env.reset(task)
            return [await env.step(a) for a in actions]
        return asyncio.run(go())
    finally:
        env.close()


def _text(calls: list[ToolCall]) -> str:
    return "\n".join(format_call(c) for c in calls)


@pytest.mark.parametrize("category", SINGLE)
def test_single_turn_success_is_bfcl_ast_checkers_verdict(source, category) -> None:
    from bfcl_eval.constants.enums import Language

    checker = _ast_checker_module()
    verdicts = {}
    for task in _tasks(source, category, 5):
        for kind, calls in _perturbed(task.gold_tool_calls).items():
            step, = _play(source, task, [_text(calls)])
            ours = source.success(task, step.answer)
            official = checker.ast_checker(
                task.metadata["functions"], [{c.name: c.arguments} for c in calls],
                task.metadata["possible_answer"], Language.PYTHON, category, "turnrl")["valid"]
            assert ours == official == step.info["correct"], (task.task_id, kind)
            verdicts[(task.task_id, kind)] = ours
    assert all(v for (_, kind), v in verdicts.items() if kind == "gold")
    assert not any(v for (_, kind), v in verdicts.items() if kind in ("wrong_argument", "missing_call"))


def _official_multi_turn(task, turns: list[list[ToolCall]]) -> bool:
    """bfcl_eval's multi_turn_checker called directly, on the calls decoded the way BFCL's FC
    handlers decode them (``name(k=repr(v),...)``), one step per turn."""
    from bfcl_eval.eval_checker.multi_turn_eval.multi_turn_checker import multi_turn_checker

    decoded = [[[f"{c.name}({','.join(f'{k}={v!r}' for k, v in c.arguments.items())})"
                 for c in calls]] if calls else [] for calls in turns]
    entry = {"id": task.task_id, "initial_config": task.metadata["initial_config"],
             "involved_classes": task.metadata["involved_classes"]}
    name = f"official{uuid.uuid4().hex}"
    return multi_turn_checker(decoded, task.metadata["ground_truth"], entry, "multi_turn_base",
                              name)["valid"]


def _turn_calls(task) -> list[list[ToolCall]]:
    gold, out = iter(task.gold_tool_calls), []
    for turn in task.metadata["ground_truth"]:
        out.append([next(gold) for _ in turn])
    return out


def test_multi_turn_success_is_bfcl_state_and_response_checkers_verdict(source) -> None:
    verdicts = {}
    for task in _tasks(source, "multi_turn_base", 4):
        gold = _turn_calls(task)
        longest = max(range(len(gold)), key=lambda i: len(gold[i]))
        for kind, calls in _perturbed(gold[longest]).items():
            turns = [*gold[:longest], calls, *gold[longest + 1:]]
            actions = [a for t in turns for a in ([_text(t)] if t else []) + ["Done."]]
            steps = _play(source, task, actions)
            assert steps[-1].done and steps[-1].answer is not None
            ours = source.success(task, steps[-1].answer)
            assert ours == _official_multi_turn(task, turns) == steps[-1].info["correct"], \
                (task.task_id, kind)
            verdicts[(task.task_id, kind)] = ours
    assert all(v for (_, kind), v in verdicts.items() if kind == "gold")
    assert not all(verdicts.values())  # the perturbations fail somewhere
    # An episode cut short (no output) fails, as BFCL fails a force-terminated entry
    assert source.success(task, None) is False


def test_multi_turn_episode_executes_bfcl_apis_with_fresh_state(source) -> None:
    task = _tasks(source, "multi_turn_base", 1)[0]
    cd = format_call(ToolCall(name="cd", arguments={"folder": "document"}))
    first, = _play(source, task, [cd])
    assert json.loads(first.observation.messages[0]["content"]) == {
        "current_working_directory": "document"}
    again, = _play(source, task, [cd])  # a new episode starts from the task's initial state
    assert again.observation.messages == first.observation.messages
    bad = _play(source, task, ['<tool_call>{"name": "cd", "arguments": </tool_call>',
                               format_call(ToolCall(name="rm_everything", arguments={}))])
    assert bad[0].invalid_action and not bad[0].done and "JSON" in bad[0].observation.anchor
    assert bad[1].invalid_action and "unknown function 'rm_everything'" in bad[1].observation.anchor
    end, nxt = _play(source, task, [cd, "I moved there."])[-2:]
    assert nxt.observation.messages == task.metadata["turns"][1] and not nxt.done


def _math_task(source) -> Any:
    every = source.tasks("train") + source.tasks("heldout")
    return next(t for t in every if t.task_id == "multi_turn_base_15")  # file system + MathAPI


def test_a_hanging_or_crashed_call_fails_one_step_and_the_episode_goes_on(source) -> None:
    task = _math_task(source)
    env = source.make_env()
    env.start(task)
    try:
        env.act(format_call(ToolCall(name="mkdir", arguments={"dir_name": "kept"})))
        # 7 ** 10**8 runs for seconds: past tool_timeout_s (1 s) the process is killed
        hang = env.act(format_call(ToolCall(name="power", arguments={"base": 7, "exponent": 10**8})))
        assert hang.invalid_action and not hang.done and "timed out after 1 s" in hang.observation.anchor
        ls = env.act(format_call(ToolCall(name="ls", arguments={})))
        # a fresh process replayed the episode's executed calls: the folder made before is there
        assert not ls.invalid_action and "kept" in ls.observation.anchor
        starts = env.proc.starts
        os.kill(env.proc._proc.pid, signal.SIGKILL)  # dies between steps
        env.proc._proc.wait()
        after = env.act(format_call(ToolCall(name="ls", arguments={})))
        assert "kept" in after.observation.anchor and env.proc.starts == starts + 1
    finally:
        env.close()


def test_a_process_that_dies_in_a_request_answers_an_error_and_restarts(source) -> None:
    from envs.bfcl.env import checker_entry
    from envs.bfcl.process import WorkerProcess

    proc = WorkerProcess(timeout_s=5.0, memory_mb=1024)
    entry = checker_entry(_math_task(source))
    try:
        # BFCL's executor evaluates what it is given; this string ends the process mid-request
        died = proc.request({"op": "exec", "entry": entry, "calls": ["__import__('os')._exit(3)"]})
        assert died == {"ok": False, "error": "the BFCL worker process died (exit 3)"}
        ok = proc.request({"op": "exec", "entry": entry, "calls": ["pwd()"]})
        assert ok["ok"] and proc.starts == 2
    finally:
        proc.close()


def test_gold_calls_feed_matchtir_on_the_decision_turn(source) -> None:
    from rewards.combine import match_result
    from rewards.config import MatchConfig
    from rollout.trajectory import Trajectory, Turn

    task = _tasks(source, "parallel", 1)[0]
    step, = _play(source, task, [_text(task.gold_tool_calls)])
    turn = Turn(action_ids=[1], action_logprobs=[0.0], policy_version=0,
                tool_calls=step.tool_calls, text="")
    traj = Trajectory(trajectory_id="t", task_id=task.task_id, group_id="g", prompt_ids=[1],
                      turns=[turn], answer=step.answer, finish_reason="answer",
                      gold_tool_calls=task.gold_tool_calls)
    # No gold answer (BFCL's success is the checker's), so the answer turn's calls are matched:
    # each is its gold call exactly, similarity (1 + 1 + |params|) / (2 + |params|) = 1
    assert match_result(traj, MatchConfig()).values == {0: 1.0}


def test_demonstrations_replay_to_a_bfcl_success(source) -> None:
    for task in [*_tasks(source, "parallel_multiple", 2), *_tasks(source, "multi_turn_base", 2)]:
        demo = source.demonstration(task)
        assert demo[0]["role"] == "assistant" and "<tool_call>" in demo[0]["content"]


def test_a_real_rollout_plays_a_bfcl_task_with_the_tiny_policy(source, tiny_policy) -> None:
    """run_episode, the HF engine in this process and the session's tiny policy: the task's
    functions reach the prompt through the chat template as tools, the action is parsed and
    the episode ends with BFCL's verdict on its output, the same one success() gives."""
    from rollout import chat
    from rollout.config import HFEngineConfig
    from rollout.engines import local_client
    from rollout.engines.base import SamplingParams
    from rollout.episode import run_episode

    engine = local_client(HFEngineConfig(), tiny_policy[0], seed=0)
    task = _tasks(source, "simple_python", 1)[0]
    prompt = engine.tokenizer.decode(chat.prompt_ids(engine.tokenizer, task.messages, task.tools))
    assert "calculate_triangle_area" in prompt
    traj = asyncio.run(run_episode(engine, source.make_env(), task, SamplingParams(max_new_tokens=24),
                                   group_id="g", max_context_tokens=2048))
    assert traj.error is None and traj.finish_reason == "answer" and len(traj.turns) == 1
    verdict = source.verdict(task, traj.answer)
    assert json.loads(traj.answer)["calls"] == [{c.name: c.arguments} for c in traj.turns[0].tool_calls]
    assert source.success(task, traj.answer) == verdict["valid"]
