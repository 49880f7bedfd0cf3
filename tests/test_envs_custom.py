"""env.type custom: your TaskSource by import path (examples/envs/sums.py), and what is refused."""

from __future__ import annotations

import pytest

from envs.registry import make_task_source
from envs.toolcalls import ToolCall, format_answer, format_call


def test_the_example_source_builds_and_plays(monkeypatch) -> None:
    monkeypatch.syspath_prepend(str(__import__("pathlib").Path(__file__).resolve().parents[1]))
    source = make_task_source({"type": "custom", "source": "examples.envs.sums:SumSource",
                               "args": {"num_train": 5, "num_heldout": 2, "seed": 1}})
    assert (len(source.tasks("train")), len(source.tasks("heldout"))) == (5, 2)
    task = source.tasks("heldout")[0]
    env = source.make_env()
    env.start(task)
    call = task.gold_tool_calls[0]
    added = env.act(format_call(call))
    assert added.observation.messages[0]["content"] == task.gold_answers[0] and not added.invalid_action
    wrong = env.act(format_call(ToolCall(name="add", arguments={"a": "x", "b": 1})))
    assert wrong.invalid_action and 'argument "a" must be of type integer' in wrong.observation.messages[0]["content"]
    done = env.act(format_answer(task.gold_answers[0]))
    assert done.done and done.reward == 1.0


@pytest.mark.parametrize("source, args, message", [
    ("no_such_module:Thing", {}, "env.source 'no_such_module:Thing' cannot be imported"),
    ("envs.base:normalize_answer", {}, "env.args do not fit env.source 'envs.base:normalize_answer'"),
    ("envs.base:normalize_answer", {"text": "x"}, "returned a str, not an envs.base.TaskSource"),
])
def test_a_source_that_cannot_build_is_refused_naming_the_field(source: str, args: dict, message: str) -> None:
    with pytest.raises(ValueError, match=None) as err:
        make_task_source({"type": "custom", "source": source, "args": args})
    assert message in str(err.value)


def test_the_source_must_be_an_import_path() -> None:
    with pytest.raises(ValueError, match="String should match pattern"):
        make_task_source({"type": "custom", "source": "/tmp/evil.py"})
