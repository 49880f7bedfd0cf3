"""verifiers environments (env.type verifiers) played as TurnRL episodes: environments written
in tests/verifiers_envs.py against verifiers' public classes (SingleTurnEnv, a MultiTurnEnv game,
the ToolEnv of examples/envs/vf_sums.py), loaded by verifiers' own load_environment. Scripted
turns check what each adapter maps (splits, gold answers, tools, observations, rubric rewards and
scores); the tiny policy plays them through a real RolloutWorker (token-exact records, the rubric
as the outcome, IG on the turns); an environment that crashes, hangs or rewrites its history fails
only that episode, and configs it cannot serve are refused naming why. No published verifiers
environment installs from PyPI (they come from Prime's Environments Hub): none is tested here."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

pytest.importorskip("verifiers")

from cluster.config import build_config  # noqa: E402
from cluster.requirements import check_requirements  # noqa: E402
from envs.registry import make_task_source  # noqa: E402
from rewards.config import IGConfig, RewardsConfig  # noqa: E402
from rewards.ig_scorer import IGScorer, write_ig_rewards  # noqa: E402
from rewards.inline import score_cheap  # noqa: E402
from rollout import chat  # noqa: E402
from rollout.config import HFEngineConfig, RolloutConfig  # noqa: E402
from rollout.engines import local_client  # noqa: E402
from rollout.engines.base import SamplingParams  # noqa: E402
from rollout.worker import RolloutWorker  # noqa: E402
from tests import verifiers_envs  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
TEST_ENV = "tests.verifiers_envs"


def env_config(kind: str, **extra) -> dict:
    return {"type": "verifiers", "id": TEST_ENV, "args": {"kind": kind}, **extra}


def play(source, task, actions: list[str]):
    """Reset ``task`` and step ``actions`` (stopping when it ends): (opening, steps)."""
    async def run():
        env = source.make_env()
        try:
            opening = await env.reset(task)
            steps = []
            for action in actions:
                steps.append(await env.step(action))
                if steps[-1].done:
                    break
            return opening, steps
        finally:
            env.close()
    return asyncio.run(run())


def test_a_single_turn_environment_its_splits_answers_and_rubric() -> None:
    source = make_task_source(env_config("single"))
    train, heldout = source.tasks("train"), source.tasks("heldout")
    assert [t.task_id for t in train] == [f"train-{i}" for i in range(20)]
    assert [t.task_id for t in heldout] == [f"heldout-{i}" for i in range(5)]  # its eval_dataset
    assert heldout[0].messages == [{"role": "system", "content": "Answer inside <answer></answer>."},
                                   {"role": "user", "content": "What is 1000 + 1000?"}]
    assert train[3].gold_answers == ["6"] and train[3].tools == []
    assert source.scores_outcome and source.success_at == 0.5 and source.max_turns == 1
    assert source.provides() == {"anchor", "gold_answers"}
    opening, [step] = play(source, train[3], ["<answer>6</answer>"])
    assert opening.messages == [] and opening.anchor == "What is 3 + 3?"
    assert step.done and step.reward == 1.0 and step.answer == "6"
    assert step.info["env_metrics"] == {"correct": 1.0, "format_reward_func": 1.0, "num_turns": 1.0}
    _, [wrong] = play(source, train[3], ["It is 7."])
    assert wrong.done and wrong.reward == 0.0 and wrong.answer is None and wrong.info["env_metrics"]["correct"] == 0.0


def test_one_dataset_is_split_by_seed_into_disjoint_train_and_heldout() -> None:
    a = make_task_source(env_config("split", args={"kind": "split", "n": 40}, heldout_fraction=0.25, seed=3))
    b = make_task_source(env_config("split", args={"kind": "split", "n": 40}, heldout_fraction=0.25, seed=3))
    c = make_task_source(env_config("split", args={"kind": "split", "n": 40}, heldout_fraction=0.25, seed=4))
    ids = {s: [t.task_id for t in a.tasks(s)] for s in ("train", "heldout")}
    assert len(ids["train"]) == 30 and len(ids["heldout"]) == 10 and not set(ids["train"]) & set(ids["heldout"])
    assert ids == {s: [t.task_id for t in b.tasks(s)] for s in ("train", "heldout")}
    assert ids["heldout"] != [t.task_id for t in c.tasks("heldout")]
    capped = make_task_source(env_config("split", args={"kind": "split", "n": 40}, num_train_tasks=7, num_heldout_tasks=2))
    assert (len(capped.tasks("train")), len(capped.tasks("heldout"))) == (7, 2)


def test_a_multi_turn_game_shows_the_environments_replies_and_ends_on_its_own() -> None:
    source = make_task_source(env_config("guess"))
    task = source.tasks("train")[0]
    secret = task.gold_answers[0]
    low = str(int(secret) - 1) if secret != "1" else "0"
    opening, steps = play(source, task, [f"<answer>{low}</answer>", "<answer>12</answer>", f"<answer>{secret}</answer>", "x"])
    assert opening.messages == [] and source.max_turns == 4
    assert [s.observation.messages for s in steps[:2]] == [[{"role": "user", "content": f"{low}: higher."}],
                                                            [{"role": "user", "content": "12: lower."}]]
    assert [s.done for s in steps] == [False, False, True] and [s.reward for s in steps] == [0.0, 0.0, 1.0]
    assert steps[-1].info["stop_condition"] == "has_final_env_response" and steps[-1].info["env_metrics"]["hit"] == 1.0
    _, missed = play(source, task, ["<answer>0</answer>"] * 4)
    assert [s.done for s in missed] == [False, False, False, True] and missed[-1].reward == 0.0
    assert missed[-1].info["stop_condition"] == "max_turns_reached"


def test_a_tool_environment_calls_its_tools_and_a_malformed_call_is_an_observation() -> None:
    source = make_task_source({"type": "verifiers", "id": "examples.envs.vf_sums", "args": {"num_examples": 30}})
    task = source.tasks("train")[0]
    assert [t["function"]["name"] for t in task.tools] == ["add"]
    assert task.tools[0]["function"]["parameters"]["required"] == ["a", "b"]
    a, b = (int(x) for x in task.messages[-1]["content"].removeprefix("What is ").rstrip("?").split(" + "))
    _, steps = play(source, task, ['<tool_call>{"name": "add", "arguments": {"a": %d, "b": %d}}</tool_call>' % (a, b),
                                   '<tool_call>{"name": "add", "arguments": {"a": 1,</tool_call>',
                                   f"<answer>{a + b}</answer>"])
    called, broken, answered = steps
    assert called.observation.messages == [{"role": "tool", "content": str(a + b), "tool_call_id": "call_1_0", "name": "add"}]
    assert [c.name for c in called.tool_calls] == ["add"] and not called.invalid_action
    assert broken.invalid_action and broken.tool_calls == []
    assert broken.observation.messages[0]["content"].startswith("Expecting property name")  # ToolEnv's own report
    assert answered.done and answered.reward == 1.0 and answered.info["env_metrics"]["add_calls"] == 2.0


def test_an_environment_that_crashes_hangs_or_rewrites_fails_only_that_episode() -> None:
    crash = make_task_source(env_config("crash"))
    with pytest.raises(RuntimeError, match="failed: RuntimeError: boom: the environment broke"):
        play(crash, crash.tasks("train")[0], ["<answer>1</answer>"])
    hang = make_task_source(env_config("hang", step_timeout_s=0.5))
    with pytest.raises(TimeoutError, match=r"did not answer the turn within 0.5 s \(env.step_timeout_s\)"):
        play(hang, hang.tasks("train")[0], ["<answer>1</answer>"])
    rewrite = make_task_source(env_config("rewrite"))
    with pytest.raises(RuntimeError, match="rebuilt the conversation between turns"):
        play(rewrite, rewrite.tasks("train")[0], ["<answer>0</answer>"])
    guess = make_task_source(env_config("guess"))  # the same kind of episode goes on working
    task = guess.tasks("train")[0]
    _, [step] = play(guess, task, [f"<answer>{task.gold_answers[0]}</answer>"])
    assert step.done and step.reward == 1.0


def test_closing_mid_episode_cancels_the_rollout_and_runs_its_cleanup() -> None:
    source = make_task_source(env_config("guess"))

    async def run() -> None:
        env = source.make_env()
        await env.reset(source.tasks("train")[1])
        await env.step("<answer>9</answer>")
        env.close()
        for _ in range(20):  # the cancelled rollout unwinds on the loop
            await asyncio.sleep(0)
    before = len(verifiers_envs.CLEANED)
    asyncio.run(run())
    assert len(verifiers_envs.CLEANED) == before + 1


@pytest.mark.parametrize("config, message", [
    (env_config("group"), "its rubric has group reward functions"),
    (env_config("single", id="tests.no_such_env"), "env.id 'tests.no_such_env': verifiers could not load it"),
    (env_config("single", args={"kind": "single", "colour": "red"}), "unexpected keyword argument 'colour'"),
])
def test_an_environment_turnrl_cannot_play_is_refused_naming_why(config: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        make_task_source(config)


def test_rewards_follow_what_the_environment_provides() -> None:
    no_answers = make_task_source(env_config("no_answers"))
    assert no_answers.provides() == {"anchor"} and no_answers.tasks("train")[0].gold_answers is None
    cfg = build_config({"env": env_config("no_answers"), "rewards": {"ig": {}}, "learner": {"estimator": {"type": "igpo"}}})
    with pytest.raises(ValueError, match="rewards.ig needs gold_answers, which env type 'verifiers' does not provide"):
        check_requirements(cfg, no_answers)
    single = make_task_source(env_config("single"))
    check_requirements(build_config({"env": env_config("single"), "rewards": {"ig": {}},
                                     "learner": {"estimator": {"type": "igpo"}}}), single)
    with pytest.raises(ValueError, match="a verifiers environment has no demonstrations"):
        single.demonstration(single.tasks("train")[0])


def test_the_tiny_policy_plays_it_token_exactly_with_the_rubric_as_outcome_and_ig(tiny_policy) -> None:
    from transformers import AutoModelForCausalLM

    engine = local_client(HFEngineConfig(), tiny_policy[0], seed=0)
    cfg = build_config({"env": env_config("guess", max_turns=3)}).env
    worker = RolloutWorker(0, RolloutConfig(max_new_tokens=16), cfg, engine, seed=0, ports=None)
    task = worker.source.tasks("train")[0]
    group = asyncio.run(worker.run_group(task, 3, SamplingParams(temperature=1.0, max_new_tokens=16)))
    tok = engine.tokenizer
    for traj in group.trajectories:
        assert traj.error is None, traj.error
        assert traj.prompt_ids == chat.prompt_ids(tok, task.messages, task.tools)
        for turn in traj.turns:
            assert tok.decode(turn.action_ids, skip_special_tokens=True) == turn.text
        if len(traj.turns) == 4:  # every guess missed: the environment's limit ended it, scored
            assert traj.metadata["env_metrics"]["hit"] == 0.0
        score_cheap(traj, RewardsConfig())
        assert traj.env_outcome == sum(t.rewards["env"] for t in traj.turns) == traj.outcome
        assert traj.success == (traj.env_outcome >= 0.5)
    model = AutoModelForCausalLM.from_pretrained(tiny_policy[0])
    scored = IGScorer(model, tok, IGConfig()).score(group.trajectories)
    for traj, result in zip(group.trajectories, scored):
        write_ig_rewards(traj, result)
        assert all(isinstance(t.rewards.get("ig"), float) for t in traj.turns[:-1])
    evaluated = asyncio.run(worker.score_task(task, 2, SamplingParams(temperature=1.0, max_new_tokens=16)))
    assert set(evaluated["metrics"]) >= {"hit", "num_turns", "tool_calls"}
