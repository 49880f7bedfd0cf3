"""reasoning-gym task families as an environment: splits, grading by the family's own scorer,
the python tool in the sandbox, and configs refused naming the field."""

from __future__ import annotations

import asyncio

import pytest
from pydantic import ValidationError

from envs.config import ReasoningGymConfig
from envs.registry import make_task_source
from envs.toolcalls import ToolCall, format_answer, format_call
from rewards.config import RewardsConfig
from rewards.inline import score_outcome
from rollout.trajectory import Trajectory, Turn

pytest.importorskip("reasoning_gym")

MIX = {"type": "reasoning_gym", "seed": 3, "num_train_tasks": 30, "num_heldout_tasks": 10,
       "tasks": [{"name": "basic_arithmetic", "weight": 2.0, "config": {"max_terms": 3, "max_digits": 2}},
                 {"name": "chain_sum", "weight": 1.0}]}


def test_splits_follow_the_weights_share_no_question_and_repeat_exactly() -> None:
    source = make_task_source(MIX)
    train, heldout = source.tasks("train"), source.tasks("heldout")
    families = [t.task_id.split(":")[0] for t in train]
    assert (families.count("basic_arithmetic"), families.count("chain_sum")) == (20, 10)
    assert [t.task_id.split(":")[0] for t in heldout].count("basic_arithmetic") == 7  # 6.67 rounds up
    questions = {t.messages[-1]["content"] for t in heldout}
    assert len(heldout) == 10 and not questions & {t.messages[-1]["content"] for t in train}
    again = make_task_source(MIX)
    assert [t.messages for t in again.tasks("train")] == [t.messages for t in train]
    other = make_task_source(MIX | {"seed": 4})
    assert [t.messages for t in other.tasks("heldout")] != [t.messages for t in heldout]
    assert all(t.tools == [] and t.gold_answers and t.messages[0]["role"] == "system" for t in train)
    assert source.scores_outcome and source.provides() == {"gold_answers", "anchor"}


def _play(source, task, actions: list[str]):
    env = source.make_env()
    asyncio.run(env.reset(task))
    return [asyncio.run(env.step(a)) for a in actions]


def test_an_answer_is_graded_by_the_family_scorer() -> None:
    source = make_task_source(MIX)
    task = source.tasks("heldout")[0]
    gold = task.gold_answers[0]
    [right] = _play(source, task, [f"Let me see. {format_answer(gold)}"])
    assert (right.done, right.reward, right.answer, right.info["correct"]) == (True, 1.0, gold, True)
    assert source.success(task, gold) and source.score(task, gold) == 1.0
    [wrong] = _play(source, task, [format_answer(str(int(gold) + 1))])
    assert (wrong.reward, wrong.info["correct"]) == (0.0, False)
    [silent] = _play(source, task, ["I think it is 7"])  # single turn: no answer ends it unanswered
    assert silent.done and silent.answer is None and silent.reward == 0.0
    assert source.episode_metrics(task, gold, [], [])["score"] == 1.0


def test_partial_credit_is_the_reward_and_the_outcome() -> None:
    source = make_task_source({"type": "reasoning_gym", "num_train_tasks": 1, "num_heldout_tasks": 1,
                               "tasks": [{"name": "word_sorting"}]})
    task = source.tasks("heldout")[0]
    gold = task.gold_answers[0]
    near = ", ".join(reversed(gold.split(", ")))  # every word, out of order
    dataset, entry = source.entries[task.task_id]
    expected = dataset.score_answer(near, entry)
    assert 0.0 < expected < 1.0  # word_sorting grades a wrong order of the right words partially
    [step] = _play(source, task, [format_answer(near)])
    assert step.reward == pytest.approx(expected) and not step.info["correct"]
    traj = Trajectory(trajectory_id="t", task_id=task.task_id, group_id="g", prompt_ids=[1],
                      gold_answers=[gold], env_outcome=step.reward,
                      turns=[Turn(action_ids=[2], action_logprobs=[-0.1], policy_version=0, text=format_answer(near))])
    score_outcome(traj, RewardsConfig())
    assert traj.outcome == pytest.approx(expected)  # the family's grade, not EM against the gold (0)


def test_the_python_tool_runs_in_the_sandbox_and_errors_are_observations() -> None:
    source = make_task_source(MIX | {"tools": ["python"]})
    task = source.tasks("train")[0]
    assert [t["function"]["name"] for t in task.tools] == ["python"] and source.cfg.max_turns == 4
    gold = task.gold_answers[0]
    code = "print(sum([2, 3]))"
    ran, failed, unknown, answered = _play(source, task, [
        format_call(ToolCall(name="python", arguments={"code": code})),
        format_call(ToolCall(name="python", arguments={"code": "1/0"})),
        format_call(ToolCall(name="shell", arguments={"cmd": "ls"})),
        format_answer(gold),
    ])
    assert ran.observation.messages[0]["content"] == "5\n" and not ran.invalid_action and not ran.done
    assert failed.invalid_action and "ZeroDivisionError" in failed.observation.messages[0]["content"]
    assert unknown.invalid_action and "available tools: python" in unknown.observation.messages[0]["content"]
    assert answered.done and answered.reward == 1.0


def test_with_the_python_tool_arithmetic_demonstrations_print_the_expression_then_answer() -> None:
    sums = {"type": "reasoning_gym", "seed": 1, "num_train_tasks": 12, "num_heldout_tasks": 4, "tools": ["python"],
            "tasks": [{"name": "chain_sum", "config": {"min_terms": 2, "max_terms": 2, "min_digits": 2, "max_digits": 2}}]}
    source = make_task_source(sums)
    assert source.provides() == {"gold_answers", "gold_tool_calls", "anchor"}
    for task in source.tasks("train")[:4]:
        expression = source.entries[task.task_id][1]["metadata"]["expression"]
        call, printed, answer = source.demonstration(task)
        assert call == {"role": "assistant", "content": format_call(ToolCall(name="python", arguments={
            "code": f"print({expression})"}))}
        assert printed["role"] == "tool" and printed["content"] == f"{task.gold_answers[0]}\n"
        assert answer == {"role": "assistant", "content": format_answer(task.gold_answers[0])}
    # a family with no expression has no gold call and is demonstrated by its answer alone; with
    # it in the mix the source no longer offers gold calls for every question
    mixed = make_task_source(sums | {"tasks": [*sums["tasks"], {"name": "word_sorting"}]})
    words = next(t for t in mixed.tasks("train") if t.task_id.startswith("word_sorting"))
    assert words.gold_tool_calls is None
    assert mixed.demonstration(words) == [{"role": "assistant", "content": format_answer(words.gold_answers[0])}]
    assert mixed.provides() == {"gold_answers", "anchor"}
    # a division the tool prints as 2.0 for the generator's 2 is answered at once, not taught as
    # answering otherwise than the tool said
    ops = make_task_source({**sums, "num_train_tasks": 20, "tasks": [{"name": "basic_arithmetic", "config": {
        "operators": ["+", "/"], "min_terms": 2, "max_terms": 2}}]})
    shapes = {"/" in ops.entries[t.task_id][1]["metadata"]["expression"]: len(ops.demonstration(t))
              for t in ops.tasks("train")}
    assert shapes == {True: 1, False: 3}


@pytest.mark.parametrize("change, message", [
    ({"tasks": [{"name": "basic_arithmetc"}]}, "env.tasks[0].name: unknown reasoning-gym task 'basic_arithmetc'; "
                                              "did you mean basic_arithmetic"),
    ({"tasks": [{"name": "chain_sum", "config": {"max_term": 3}}]}, "env.tasks[0].config: chain_sum takes no ['max_term']"),
    ({"tasks": [{"name": "chain_sum", "config": {"min_terms": 5, "max_terms": 2}}]},
     "env.tasks[0].config: reasoning-gym refused it"),
])
def test_a_bad_family_or_config_is_refused_naming_the_field(change: dict, message: str) -> None:
    with pytest.raises(ValueError) as err:
        make_task_source(MIX | change)
    assert message in str(err.value)


@pytest.mark.parametrize("change, message", [
    ({"tasks": []}, "at least 1 item"),
    ({"tasks": [{"name": "chain_sum", "config": {"seed": 1}}]}, "config sets ['seed']"),
    ({"tasks": [{"name": "chain_sum"}, {"name": "chain_sum"}]}, "names a family twice"),
    ({"tools": ["python"], "max_turns": 1}, "set max_turns >= 2"),
    ({"tools": ["bash"]}, "'python'"),
])
def test_config_validation(change: dict, message: str) -> None:
    with pytest.raises(ValidationError, match=None) as err:
        ReasoningGymConfig.model_validate(MIX | change)
    assert message in str(err.value)
