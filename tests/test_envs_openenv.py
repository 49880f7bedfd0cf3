"""OpenEnv environments: an environment written with openenv-core (examples/envs/guess_server.py,
made breakable by tests/openenv_server.py),
served by uvicorn in a process the source starts, driven over openenv-core's WebSocket client:
reset seeds as tasks, steps as turns, its rewards as the outcome; bad actions as observations; a
server that hangs or dies fails one episode and is started again for the next."""

from __future__ import annotations

import asyncio
import sys
import time
from pathlib import Path

import pytest

from envs.registry import make_task_source
from envs.toolcalls import ToolCall, format_call

pytest.importorskip("openenv.core.generic_client")
pytestmark = pytest.mark.slow  # starts uvicorn servers (~20 s)

SERVER = str(Path(__file__).with_name("openenv_server.py"))
CONFIG = {"type": "openenv", "num_train_tasks": 6, "num_heldout_tasks": 3, "max_turns": 6, "step_timeout_s": 3,
          "server": {"name": "guess", "command": sys.executable, "args": [SERVER, "{port}"]}}


def guess(n: int) -> str:
    return format_call(ToolCall(name="step", arguments={"guess": n}))


def secret(seed: int) -> int:
    import random

    return random.Random(seed).randint(1, 20)


@pytest.fixture(scope="module")
def source():
    src = make_task_source(CONFIG)
    yield src
    src.server.stop()


def _episode(source, task, actions: list[str]):
    async def play():
        env = source.make_env()
        try:
            opening = await env.reset(task)
            return opening, [await env.step(a) for a in actions]
        finally:
            env.close()
            await asyncio.sleep(0.1)  # let the client's close run

    return asyncio.run(play())


def test_seeds_are_tasks_and_the_action_schema_is_the_tool(source) -> None:
    train, heldout = source.tasks("train"), source.tasks("heldout")
    assert [t.metadata["seed"] for t in train] == list(range(6)) and [t.metadata["seed"] for t in heldout] == [6, 7, 8]
    [tool] = train[0].tools
    assert tool["function"]["name"] == "step"
    assert tool["function"]["parameters"] == {"type": "object", "required": ["guess"], "properties": {
        "guess": {"description": "Your guess, an integer from 1 to 20", "title": "Guess", "type": "integer"}}}
    assert source.scores_outcome and source.provides() == {"anchor"}


def test_an_episode_plays_to_the_environments_done_with_its_rewards(source) -> None:
    task = source.tasks("train")[2]
    answer = secret(2)
    low = 1 if answer > 1 else 2
    opening, (wrong, right) = _episode(source, task, [guess(low), guess(answer)] if low != answer else [guess(3), guess(answer)])
    assert opening.messages == [{"role": "user", "content": "I picked a number from 1 to 20. Guess it."}]
    assert wrong.observation.messages[0]["content"] in ("higher", "lower") and wrong.reward == 0.0 and not wrong.done
    assert wrong.observation.messages[0]["role"] == "tool" and wrong.tool_calls[0].arguments == {"guess": low}
    assert (right.reward, right.done, right.info["env_done"], right.observation.messages) == (1.0, True, True, [])


def test_bad_actions_are_observations(source) -> None:
    task = source.tasks("train")[0]
    _, (prose, typed, two) = _episode(source, task, [
        "I think it is 7.", format_call(ToolCall(name="step", arguments={"guess": "seven"})), guess(1) + guess(2)])
    assert prose.invalid_action and "Act with exactly one call of the step tool" in prose.observation.messages[0]["content"]
    assert typed.invalid_action and 'argument "guess" must be of type integer' in typed.observation.messages[0]["content"]
    assert two.invalid_action and "(calls made: step, step)" in two.observation.messages[0]["content"]
    assert not two.done and prose.reward == typed.reward == 0.0


def test_a_hung_or_dead_server_fails_one_episode_and_is_started_again(source) -> None:
    task = source.tasks("train")[1]
    start = time.monotonic()
    with pytest.raises(TimeoutError, match="openenv server 'guess' did not answer step within 3 s"):
        _episode(source, task, [guess(0)])  # the server hangs in this step
    assert time.monotonic() - start < 20
    starts = source.server.starts
    with pytest.raises(Exception):
        _episode(source, task, [guess(-1)])  # the server's process dies in this step
    time.sleep(0.5)
    answer = secret(1)
    _, [right] = _episode(source, task, [guess(answer)])  # a new server process serves the next episode
    assert right.reward == 1.0 and source.server.starts == starts + 1


def test_text_actions_and_a_server_that_cannot_start(tmp_path: Path) -> None:
    with pytest.raises(Exception, match=r"openenv server 'broken' exited with code 3 at start: boom"):
        make_task_source(CONFIG | {"server": {"name": "broken", "command": sys.executable,
                                               "args": ["-c", "print('boom'); raise SystemExit(3)"]}})
    text = make_task_source(CONFIG | {"action": "text", "text_field": "guess"})
    try:
        assert text.tasks("train")[0].tools == [] and text.server.proc is None  # started by the first episode
        _, [step] = _episode(text, text.tasks("train")[0], [str(secret(0))])
        assert step.reward == 1.0 and step.done
    finally:
        text.server.stop()


def test_a_reward_the_environment_cannot_give_is_refused_naming_why(source) -> None:
    from cluster.config import build_config
    from cluster.requirements import check_requirements

    cfg = build_config({"env": CONFIG, "rewards": {"ig": {}}, "learner": {"estimator": {"type": "igpo"}}})
    with pytest.raises(ValueError, match="rewards.ig needs gold_answers, which env type 'openenv' does not provide"):
        check_requirements(cfg, source)
    check_requirements(build_config({"env": CONFIG, "learner": {"estimator": {"type": "gigpo"}}}), source)  # anchors: given
