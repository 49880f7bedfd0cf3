"""Rewards that read tool calls read them in the run's chat format: the rule-based format judge
(directly and through the callable backend, which passes ``chat_format``) and the PRM's
training data (demonstrations rewritten into the format, wrong steps parsed and broken in it).
Pure: no model, no Ray."""

from __future__ import annotations

import random

import pytest

from envs.formats import FORMATS, DEFAULT_FORMAT, ToolCall, demo_text, get_format
from envs.toolcalls import format_call, parse_action
from rewards.config import JudgeConfig
from rewards.judge import format_judge, judge_prompt, load_callable
from rewards.prm_data import cut_json, malformed, perturbed_actions

SEARCH = ToolCall(name="search", arguments={"query": "Vedor"})
CFG = JudgeConfig(backend="callable", function="rewards.judge:format_judge")


def _prompt(step: str, followed: str | None = None) -> str:
    return judge_prompt(CFG, "Question: where is Vedor?", step, 0, followed)


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_format_judge_reads_the_runs_format(name: str) -> None:
    call = format_call(SEARCH, name)
    assert format_judge(_prompt(call), name).endswith("Score: 10")
    # What followed the step (a hindsight judge's prompt) is not part of the step.
    assert format_judge(_prompt(call, "Vedor is a town."), name).endswith("Score: 10")
    assert format_judge(_prompt("<answer>Vedor</answer>"), name).endswith("Score: 10")
    assert format_judge(_prompt(cut_json(call)), name).endswith("Score: 0")
    assert format_judge(_prompt("I will look that up."), name).endswith("Score: 0")


@pytest.mark.parametrize("name", sorted(set(FORMATS) - {"hermes", "qwen3"}))
def test_a_hermes_call_is_no_call_in_another_format(name: str) -> None:
    hermes = format_call(SEARCH, "hermes")
    assert format_judge(_prompt(hermes), "hermes").endswith("Score: 10")
    assert format_judge(_prompt(hermes), name).endswith("Score: 0")


def test_callable_backend_passes_the_chat_format() -> None:
    mistral = _prompt(format_call(SEARCH, "mistral"))
    assert load_callable("rewards.judge:format_judge", "mistral")([mistral])[0].endswith("Score: 10")
    assert load_callable("rewards.judge:format_judge")([mistral])[0].endswith("Score: 0")  # read as Hermes
    # A function without the parameter is called with the prompt alone.
    assert load_callable("builtins:len", "mistral")(["abc"]) == ["3"]


def test_cut_json_drops_the_two_closing_braces() -> None:
    hermes = format_call(SEARCH, "hermes")
    assert cut_json(hermes) == hermes.replace("}}</tool_call>", "</tool_call>")  # the old Hermes cut
    assert cut_json('[TOOL_CALLS][{"name": "s", "arguments": {}}]') == '[TOOL_CALLS][{"name": "s", "arguments": {]'
    assert cut_json("no braces") == "no braces"


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_malformed_steps_in_each_format(name: str) -> None:
    call = format_call(SEARCH, name)
    broken = {malformed(call, random.Random(s), name) for s in range(20)}
    assert broken == {format_call(ToolCall(name="search_v2", arguments=SEARCH.arguments), name),
                      format_call(ToolCall(name="search", arguments={}), name), cut_json(call)}
    cut = parse_action(cut_json(call), name)
    assert cut.calls == [] and len(cut.errors) == 1  # the environment sees a malformed call
    assert malformed("<answer>c</answer>", random.Random(0), name) == "<answer>c"


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_demonstrations_become_the_format(name: str) -> None:
    demo = format_call(SEARCH, DEFAULT_FORMAT)
    text = demo_text(demo, name)
    assert text == get_format(name).render(None, [SEARCH])
    assert parse_action(text, name).calls == [SEARCH]
    assert demo_text("<answer>Vedor</answer>", name) == "<answer>Vedor</answer>"
    # Wrong steps are drawn from (and parsed in) the same format.
    gold = [text, "<answer>Vedor</answer>"]
    out = perturbed_actions(gold, [], 3, 1.0, random.Random(1), name)
    assert out[1:] == gold and parse_action(out[0], name).calls != [SEARCH]


def test_judge_decodes_a_turn_keeping_the_formats_markers() -> None:
    """A turn recorded without its text is decoded for the judge with ``[TOOL_CALLS]`` kept
    (a special token: a plain decode drops it, and the call with it)."""
    from chat_format_fixtures import family_tokenizer
    from rewards.judge import episode_prompts
    from rollout.trajectory import Trajectory, Turn

    tok = family_tokenizer("mistral")
    ids = tok(format_call(SEARCH, "mistral"), add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    traj = Trajectory(trajectory_id="t", task_id="t", group_id="g", prompt_ids=tok("Where?")["input_ids"],
                      turns=[Turn(action_ids=ids, action_logprobs=[0.0] * len(ids), policy_version=0)])
    [prompt] = episode_prompts(traj, tok, CFG, chat_format="mistral")
    assert format_call(SEARCH, "mistral") in prompt
    assert format_judge(prompt, "mistral").endswith("Score: 10")
