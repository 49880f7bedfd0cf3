"""Client feedback on a recorded session: rewards land on the right turns across segments, and
bad feedback names its field and changes nothing."""

from __future__ import annotations

import pytest

from envs.toolcalls import ToolCall
from gateway.errors import GatewayError, InvalidRequest, UnknownSession
from gateway.feedback import apply_feedback
from gateway.sessions import SessionRecorder
from gateway.toolcalls import split_action
from gateway_fixtures import Sampled, tiny_tokenizer


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return tiny_tokenizer(tmp_path_factory.mktemp("tok"))


def _request(rec: SessionRecorder, tok, messages: list[dict], answer: str) -> dict:
    p = rec.prepare("s", messages, [])
    ids = tok(answer, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    reply = split_action(answer, "c", 0)
    rec.record(p, [Sampled(ids, [-0.5] * len(ids), "stop", [(0, 1)])], [reply])
    return reply.template_message()


@pytest.fixture
def recorder(tok) -> SessionRecorder:
    """Session "s": turns 0 and 1 stitched in segment 0, then a rewritten history puts turn 2
    in segment 1."""
    rec = SessionRecorder(tok)
    q1 = [{"role": "user", "content": "What is the capital of France?"}]
    a1 = _request(rec, tok, q1, "Let me search.")
    q2 = q1 + [a1, {"role": "user", "content": "Thanks!"}]
    _request(rec, tok, q2, "Paris")
    _request(rec, tok, [{"role": "user", "content": "The weather in Paris?"}], "sunny")
    assert [len(s.trajectory.turns) for s in rec.segments("s")] == [2, 1]
    return rec


def _state(rec: SessionRecorder) -> list[str]:
    return [s.trajectory.model_dump_json() for s in rec.segments("s")]


def test_feedback_sets_outcome_turn_rewards_and_gold_on_every_segment(recorder) -> None:
    apply_feedback(recorder, "s", {
        "outcome": 1.0, "turn_rewards": {"0": 0.25, "2": -0.5}, "gold_answers": ["Paris"],
        "gold_tool_calls": [{"name": "search", "arguments": '{"query": "capital of France"}'}],
    })
    first, second = (s.trajectory for s in recorder.segments("s"))
    assert (first.outcome, second.outcome) == (1.0, 1.0)
    # Turn 0 and 1 are segment 0's; turn 2 is segment 1's only turn.
    assert [t.rewards for t in first.turns] == [{"env": 0.25}, {"outcome": 1.0}]
    assert [t.rewards for t in second.turns] == [{"env": -0.5, "outcome": 1.0}]
    assert first.gold_answers == second.gold_answers == ["Paris"]
    assert second.gold_tool_calls == [ToolCall(name="search", arguments={"query": "capital of France"})]
    # Sent again, feedback replaces the earlier one (list form: null = no reward for that turn).
    apply_feedback(recorder, "s", {"outcome": 0.0, "turn_rewards": [None, 0.5]})
    assert [t.rewards for t in first.turns] == [{}, {"env": 0.5, "outcome": 0.0}]
    assert second.turns[0].rewards == {"outcome": 0.0} and second.gold_answers is None


@pytest.mark.parametrize("body, param, message", [
    ({"outcome": 1.0, "turn_rewards": {"7": 1.0}}, "turn_rewards.7",
     "turn index out of range: the session has 3 turns (0..2)"),
    ({"outcome": 1.0, "turn_rewards": [0.1, 0.2, 0.3, 0.4]}, "turn_rewards.3",
     "turn index out of range: the session has 3 turns (0..2)"),
    ({"outcome": 1.0, "turn_rewards": {"-1": 1.0}}, "turn_rewards.-1", "turn index out of range"),
    ({"outcome": "good"}, "outcome", "valid number"),
    ({"turn_rewards": [1.0]}, "outcome", "required"),
    ({"outcome": float("nan")}, "outcome", "finite"),
    ({"outcome": 1.0, "gold_answers": "Paris"}, "gold_answers", "valid list"),
    ({"outcome": 1.0, "gold_tool_calls": [{"name": "search", "arguments": "{"}]}, "gold_tool_calls.0.arguments",
     "not valid JSON"),
    ({"outcome": 1.0, "gold_tool_calls": [{"arguments": {}}]}, "gold_tool_calls.0.name", "required"),
    ({"outcome": 1.0, "reward": 1.0}, "reward", "unknown"),
])
def test_bad_feedback_names_the_field_and_leaves_the_session_unchanged(recorder, body, param, message) -> None:
    apply_feedback(recorder, "s", {"outcome": 0.5, "turn_rewards": {"1": 0.25}})
    before = _state(recorder)
    with pytest.raises(InvalidRequest) as info:
        apply_feedback(recorder, "s", body)
    assert info.value.param == param and message in info.value.message and info.value.status == 400
    assert _state(recorder) == before


def test_feedback_for_an_unknown_session_is_a_404(recorder) -> None:
    with pytest.raises(UnknownSession) as info:
        apply_feedback(recorder, "nobody", {"outcome": 1.0})
    err: GatewayError = info.value
    assert (err.status, err.param, err.body()["error"]["param"]) == (404, "session_id", "session_id")
