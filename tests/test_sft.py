"""SFT lays out demonstrations exactly as rollouts of the same actions are trained."""

from __future__ import annotations

import asyncio

import pytest

from envs.registry import make_task_source
from learner.bootstrap import _corpus
from learner.sft import demo_rows
from learner.tiny_policy import train_tokenizer
from rollout import chat
from rollout.engines.base import Completion, SamplingParams
from rollout.episode import run_episode


class _Replay:
    """An engine that answers with a demonstration's actions, in order, and records the
    contexts it was asked to continue: what a policy that had learned the demo would see."""

    def __init__(self, tokenizer, actions: list[list[int]]) -> None:
        self.tokenizer, self.actions, self.contexts = tokenizer, list(actions), []

    async def generate(self, prompt_ids, params, session_id=None):
        self.contexts.append(list(prompt_ids))
        ids = self.actions.pop(0)
        return Completion(request_id=f"replay-{len(self.contexts)}", token_ids=ids, logprobs=[0.0] * len(ids),
                          finish_reason="stop", version_spans=[(0, 0)])


@pytest.fixture(scope="module")
def household(tmp_path_factory):
    source = make_task_source({"type": "household", "num_train_tasks": 20, "num_heldout_tasks": 1,
                               "max_turns": 15})
    tok = train_tokenizer(_corpus(source), 600, tmp_path_factory.mktemp("tok"), False)
    task = max(source.tasks("train"), key=lambda t: len(source.demonstration(t)))
    return source, tok, task


def _replay(source, tok, task, history_turns, chat_format="hermes"):
    demo = source.demonstration(task)
    actions = [chat.action_ids(tok, m["content"], chat_format) for m in demo if m["role"] == "assistant"]
    engine = _Replay(tok, actions)
    traj = asyncio.run(run_episode(engine, source.make_env(), task, SamplingParams(),
                                   group_id="g", max_context_tokens=10**6,
                                   history_turns=history_turns, chat_format=chat_format))
    assert traj.answer == task.gold_answers[0]  # the replayed demonstration reaches the goal
    return demo, engine, traj


def test_whole_episode_demo_is_one_row_with_actions_trained(household) -> None:
    source, tok, task = household
    demo, engine, traj = _replay(source, tok, task, None)
    (ids, mask), = demo_rows(tok, task, demo)
    assert ids == traj.token_ids()
    assert mask == [int(m) for m in traj.loss_mask()]


@pytest.mark.parametrize("chat_format", ["mistral", "llama3_json"])
def test_demo_rows_are_written_in_the_policy_chat_format(household, chat_format) -> None:
    # The demonstrations are Hermes text; a policy in another format is taught its own syntax,
    # token for token what a rollout of the same actions in that format records.
    source, tok, task = household
    demo, engine, traj = _replay(source, tok, task, None, chat_format)
    (ids, mask), = demo_rows(tok, task, demo, chat_format=chat_format)
    assert ids == traj.token_ids() and mask == [int(m) for m in traj.loss_mask()]
    assert "<tool_call>" not in tok.decode(ids) and demo_rows(tok, task, demo)[0][0] != ids


@pytest.mark.parametrize("history_turns", [0, 2])
def test_windowed_demo_rows_are_the_contexts_a_rollout_acts_from(household, history_turns) -> None:
    source, tok, task = household
    demo, engine, traj = _replay(source, tok, task, history_turns)
    n = len(traj.turns)
    assert n >= 4  # long enough for the window to drop turns
    rows = demo_rows(tok, task, demo, history_turns)
    assert [ids for ids, _ in rows] == [traj.row(s)[0] for s in traj.segments()]
    assert len(rows) == n - history_turns
    for t in range(n):
        # the row training turn t holds, before the action, exactly what the engine was given
        ids, mask = rows[max(0, t - history_turns)]
        starts = [i for i in range(1, len(mask)) if mask[i] and not mask[i - 1]]
        at = starts[-1] if t >= history_turns else starts[t]
        assert ids[:at] == engine.contexts[t]
        if t > history_turns:  # the prompt, then turn t-k: earlier turns were dropped
            first = traj.turns[t - history_turns].action_ids if history_turns else []
            prompt = len(traj.prompt_ids)
            assert engine.contexts[t][prompt: prompt + len(first)] == first
            assert len(engine.contexts[t]) < len(traj.context_ids(0, t))
