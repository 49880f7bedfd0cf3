"""Token path, HF engine and episodes on a real tiny model (no mocks)."""

from __future__ import annotations

import asyncio

import pytest
import torch

from envs.base import Environment, Observation, StepResult
from rollout import chat
from rollout.engines import local_client
from rollout.engines.base import SamplingParams
from rollout.config import HFEngineConfig
from rollout.episode import run_episode


@pytest.fixture(scope="module")
def engine(tiny_policy):
    """The HF engine in this process, behind the client interface episodes use."""
    return local_client(HFEngineConfig(), tiny_policy[0], seed=0)


def test_appended_tokens_equal_template_render(engine, tiny_policy) -> None:
    """prompt + action + observation ids == the chat template's own rendering, token for token."""
    tok, source = engine.tokenizer, tiny_policy[1]
    task = source.tasks("train")[0]
    demo = source.demonstration(task)
    ids = chat.prompt_ids(tok, task.messages, task.tools)
    ids += chat.action_ids(tok, demo[0]["content"])
    ids += chat.observation_ids(tok, [demo[1]], action_ended=True)
    full = tok.apply_chat_template(task.messages + demo[:2], tools=task.tools,
                                   add_generation_prompt=True, tokenize=False)
    assert ids == tok(full, add_special_tokens=False)["input_ids"]


def test_behaviour_logprobs_match_a_plain_forward(engine) -> None:
    """Batched, left-padded, KV-cached sampling records log pi(token) of a full forward pass."""
    prompts = [[5, 6, 7, 8, 9, 10], [11, 12, 13]]
    params = SamplingParams(temperature=1.0, max_new_tokens=12)

    async def go():
        return await asyncio.gather(*[engine.generate(p, params) for p in prompts])

    outs = asyncio.run(go())
    for prompt, comp in zip(prompts, outs):
        seq = torch.tensor([prompt + comp.token_ids])
        with torch.no_grad():
            logp = torch.log_softmax(engine.engine.model(input_ids=seq).logits[0, :-1].float(), -1)
        ref = logp[len(prompt) - 1 :].gather(-1, seq[0, len(prompt):, None]).squeeze(-1)
        torch.testing.assert_close(torch.tensor(comp.logprobs), ref, atol=2e-4, rtol=1e-4)
        assert comp.version == 0 and len(comp.token_ids) == len(comp.logprobs) <= 12


def test_greedy_is_deterministic_and_an_idle_engine_loads_weights_at_once(engine) -> None:
    from rollout.engines.transport import InMemoryWeights

    params = SamplingParams(temperature=0.0, max_new_tokens=6)
    a = asyncio.run(engine.generate([5, 6, 7], params))
    b = asyncio.run(engine.generate([5, 6, 7], params))
    assert a.token_ids == b.token_ids
    state = {k: v.clone() for k, v in engine.engine.model.state_dict().items()}
    assert asyncio.run(engine.update_weights(3, InMemoryWeights(state))) == 3
    c = asyncio.run(engine.generate([5, 6, 7], params))
    assert c.version == 3 and c.version_spans == [(0, 3)] and c.token_ids == a.token_ids


class _Exploding(Environment):
    max_turns = 3

    async def reset(self, task):
        return Observation(messages=[], anchor="start")

    async def step(self, action: str) -> StepResult:
        raise RuntimeError("simulator crashed")


def test_env_crash_fails_one_episode_not_the_run(engine, tiny_policy) -> None:
    task = tiny_policy[1].tasks("train")[0]
    traj = asyncio.run(run_episode(engine, _Exploding(), task, SamplingParams(max_new_tokens=4),
                                   group_id="g", max_context_tokens=1024))
    assert traj.finish_reason == "error" and "simulator crashed" in traj.error


def test_malformed_tool_call_is_an_observation(engine, tiny_policy) -> None:
    source = tiny_policy[1]
    env = source.make_env()
    task = source.tasks("train")[0]

    async def go():
        await env.reset(task)
        return await env.step('<tool_call>{"name": "search", "arguments": </tool_call>')

    step = asyncio.run(go())
    assert step.invalid_action and not step.done
    assert "JSON" in step.observation.messages[0]["content"]


def test_episode_records_exact_tokens(engine, tiny_policy) -> None:
    source = tiny_policy[1]
    task = source.tasks("heldout")[0]
    traj = asyncio.run(run_episode(engine, source.make_env(), task,
                                   SamplingParams(temperature=1.0, max_new_tokens=32),
                                   group_id="g", max_context_tokens=1024))
    assert traj.error is None and traj.turns
    assert traj.prompt_ids == chat.prompt_ids(engine.tokenizer, task.messages, task.tools)
    for turn in traj.turns[:-1]:
        assert turn.observation_ids  # every non-final turn is followed by an observation

    async def replay() -> list[str]:
        """The same (deterministic) environment fed the recorded actions: the anchor of turn 0
        is the reset's observation, that of turn t the observation after turn t - 1."""
        env = source.make_env()
        anchors = [(await env.reset(task)).anchor]
        for turn in traj.turns[:-1]:
            anchors.append((await env.step(turn.text)).observation.anchor)
        env.close()
        return anchors

    anchors = asyncio.run(replay())
    assert anchors[0] and [t.anchor_observation for t in traj.turns] == anchors
    for turn in traj.turns:  # the recorded text is exactly the sampled tokens, decoded
        assert engine.tokenizer.decode(turn.action_ids, skip_special_tokens=True) == turn.text
    assert len(traj.token_ids()) == len(traj.loss_mask()) == len(traj.behaviour_logprobs())


class _Recording:
    """The real engine, with every context it was asked to continue written down."""

    def __init__(self, engine) -> None:
        self.inner, self.contexts = engine, []

    @property
    def tokenizer(self):
        return self.inner.tokenizer

    async def generate(self, prompt_ids, params, request_id=None, session_id=None):
        self.contexts.append(list(prompt_ids))
        return await self.inner.generate(prompt_ids, params, request_id)


def test_history_window_bounds_what_the_engine_sees(engine) -> None:
    from envs.registry import make_task_source

    # household turns run to max_turns whatever the (search-QA) policy writes: invalid actions
    # are observations, so the episode is long enough for the window to drop turns
    source = make_task_source({"type": "household", "num_train_tasks": 2, "num_heldout_tasks": 1,
                               "max_turns": 5})
    task, rec = source.tasks("train")[0], _Recording(engine)
    traj = asyncio.run(run_episode(rec, source.make_env(), task,
                                   SamplingParams(temperature=1.0, max_new_tokens=16),
                                   group_id="g", max_context_tokens=4096, history_turns=1))
    assert traj.error is None and len(traj.turns) == 5 and traj.finish_reason == "max_turns"
    assert [t.context_start for t in traj.turns] == [0, 0, 1, 2, 3]
    prompt = chat.prompt_ids(engine.tokenizer, task.messages, task.tools)
    for t, seen in enumerate(rec.contexts):
        last = traj.turns[t - 1] if t else None
        # the opening prompt, then at most the one turn before (its action and observation)
        assert seen == prompt + ([] if last is None else last.action_ids + last.observation_ids)
        assert seen == traj.context_ids(traj.turns[t].context_start, t)
    # the learner trains each turn on the context it was sampled from
    rows = [traj.row(s) for s in traj.segments()]
    assert len(rows) == 4
    for t, turn in enumerate(traj.turns):
        ids, owner = next(r for r in rows if t in r[1])
        at = owner.index(t)
        assert ids[:at] == rec.contexts[t] and ids[at: at + len(turn.action_ids)] == turn.action_ids


class _Qwen3Template(_Recording):
    """The real engine, its tokenizer carrying Qwen3's published chat template (same tokens)."""

    def __init__(self, engine) -> None:
        import copy
        from pathlib import Path

        super().__init__(engine)
        self._tok = copy.deepcopy(engine.tokenizer)
        self._tok.chat_template = (Path(__file__).parent / "data/chat_templates/qwen3.jinja").read_text()

    @property
    def tokenizer(self):
        return self._tok


def test_an_episode_under_qwen3s_template_appends_deltas_to_the_sampled_tokens(engine) -> None:
    """Qwen3's template renders an assistant turn one way when it is last (an empty <think>
    block) and another once messages follow: not append-only, which the episode once refused.
    Each turn is now sampled from the kept ids plus the template's delta for the tool results."""
    from envs.registry import make_task_source

    source = make_task_source({"type": "household", "num_train_tasks": 2, "num_heldout_tasks": 1, "max_turns": 5})
    task, rec = source.tasks("train")[0], _Qwen3Template(engine)
    traj = asyncio.run(run_episode(rec, source.make_env(), task, SamplingParams(temperature=1.0, max_new_tokens=12),
                                   group_id="g", max_context_tokens=4096, chat_format="qwen3"))
    assert traj.error is None and len(traj.turns) == 5
    tok = rec.tokenizer
    assert traj.prompt_ids == chat.prompt_ids(tok, task.messages, task.tools, "qwen3")
    for t, seen in enumerate(rec.contexts):
        assert seen == traj.context_ids(0, t)  # the prompt, then every action and observation as kept
    for turn in traj.turns[:-1]:  # tool results or (no action found) a user message: Qwen3's user turn
        ended = turn.action_ids[-1] == tok.eos_token_id  # else the eos is supplied outside the loss
        obs = tok.decode(turn.observation_ids)
        assert obs.startswith(("" if ended else "<|im_end|>") + "\n<|im_start|>user\n")
        assert obs.endswith("<|im_end|>\n<|im_start|>assistant\n")
