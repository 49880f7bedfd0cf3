"""Generative judge: score parsing, one retry, missing + flagged with the raw text kept, and the
reward service's bounded judge queue (a slow judge never holds a group past its timeout).

Backends are real: the tiny policy from conftest (an LLM that never writes "Score: N", so a
garbage-emitting judge), the built-in rule-based ``format_judge``, and a small judge defined
here that follows the format only once reminded.
"""

from __future__ import annotations

import asyncio
import re
import threading
import time

import pytest

from rewards.config import JudgeConfig, RewardsConfig
from rewards.judge import (HFJudge, JudgeWorker, episode_prompts, format_judge, judge_turns,
                           parse_score)
from rewards.service import LocalJudge, RewardService
from rollout.trajectory import Group, Trajectory, Turn

CALLABLE = {"backend": "callable", "function": "rewards.judge:format_judge"}


def judge_cfg(**kw) -> JudgeConfig:
    return JudgeConfig(**{**CALLABLE, **kw})


def test_parse_score() -> None:
    # 7 on 0..10 -> 0.7; the last "Score:" wins; case and "=" accepted.
    assert parse_score("Reasoning... Score: 7", 0, 10) == pytest.approx(0.7)
    assert parse_score("score: 2\nSCORE = 4.5", 0, 10) == pytest.approx(0.45)
    assert parse_score("Score: 3", 1, 5) == pytest.approx(0.5)  # (3 - 1) / (5 - 1)
    assert parse_score("no number here", 0, 10) is None
    assert parse_score("Score: 11", 0, 10) is None  # out of range is unparseable
    assert parse_score("I give it 7/10", 0, 10) is None  # only the asked-for format counts


class RemindedJudge:
    """Answers in prose first and with a score only when the prompt carries the reminder."""

    def __init__(self) -> None:
        self.calls: list[list[str]] = []

    def __call__(self, prompts: list[str]) -> list[str]:
        self.calls.append(prompts)
        return ["Score: 8" if "previous reply" in p else "Looks fine to me." for p in prompts]


def test_retry_once_then_parse() -> None:
    judge = RemindedJudge()
    [j] = judge_turns(judge, ["grade this"], judge_cfg())
    assert j.score == pytest.approx(0.8) and j.error is None
    assert j.raw == ["Looks fine to me.", "Score: 8"]  # both replies kept
    assert len(judge.calls) == 2 and "previous reply" in judge.calls[1][0]


def test_retry_exhausted_is_missing_with_raw_kept() -> None:
    [j] = judge_turns(lambda ps: ["meh"] * len(ps), ["p"], judge_cfg())
    assert j.score is None and j.raw == ["meh", "meh"]
    assert j.error == "unparseable after 2 attempts"
    [k] = judge_turns(lambda ps: ["meh"] * len(ps), ["p"], judge_cfg(retries=0))
    assert k.raw == ["meh"]  # retries=0: a single attempt


def test_backend_exception_is_missing_not_zero() -> None:
    def broken(prompts: list[str]) -> list[str]:
        raise ConnectionError("judge endpoint down")

    [j] = judge_turns(broken, ["p"], judge_cfg())
    assert j.score is None and "ConnectionError: judge endpoint down" in j.error


@pytest.fixture(scope="module")
def episode(tiny_policy) -> tuple[str, Trajectory]:
    """A real search-QA episode with one malformed step, played through the environment."""
    from transformers import AutoTokenizer

    from rewards.prm_data import gold_actions, play_labelled

    path, source = tiny_policy
    task = source.tasks("train")[1]
    gold = gold_actions(source, task)
    actions = ['<tool_call>{"name": "search", "arguments": {"query": "x"}', *gold]
    traj = asyncio.run(play_labelled(source, task, AutoTokenizer.from_pretrained(path), actions))
    return path, traj


def test_format_judge_through_worker(episode) -> None:
    path, traj = episode
    worker = JudgeWorker(judge_cfg(), path)
    [judgements] = worker.judge([traj])
    # Unclosed call -> 0; the gold searches and the answer are well formed -> 10 -> 1.0.
    assert [j.score for j in judgements] == [0.0] + [1.0] * (len(traj.turns) - 1)
    assert all(j.raw[0].endswith(("Score: 0", "Score: 10")) for j in judgements)
    prompt = episode_prompts(traj, worker.tokenizer, judge_cfg())[1]
    assert "### Step 2 to grade" in prompt and traj.turns[1].text in prompt
    assert format_judge(prompt).endswith("Score: 10")


@pytest.mark.slow
def test_tiny_llm_judge_emits_garbage_missing_and_flagged(episode) -> None:
    path, traj = episode
    cfg = JudgeConfig(backend="hf", path=path, max_new_tokens=12, max_context_chars=300)
    worker = JudgeWorker(cfg, path, HFJudge(path, cfg.max_new_tokens))
    [judgements] = worker.judge([traj])
    for j in judgements:
        assert j.score is None and j.error == "unparseable after 2 attempts"
        assert len(j.raw) == 2  # first reply and the retry, both kept
    service = RewardService(RewardsConfig(prm=cfg), None, judges=[LocalJudge(worker)])
    group = Group(group_id="g", task_id=traj.task_id, trajectories=[traj.model_copy(deep=True)])
    scored = asyncio.run(service.score_group(group)).trajectories[0]
    assert all(t.rewards["prm"] is None for t in scored.turns)  # missing, never zero
    [flag] = scored.reward_errors
    assert flag["source"] == "prm" and flag["turns"] == list(range(len(scored.turns)))
    assert len(scored.reward_details["prm"]["judgements"][0]["raw"]) == 2
    assert service.stats()["missing"] == {"prm": len(scored.turns)}


class GatedJudge:
    """A judge that blocks until released: stands in for a slow remote LLM."""

    def __init__(self) -> None:
        self.release = threading.Event()

    def __call__(self, prompts: list[str]) -> list[str]:
        self.release.wait(timeout=30)
        return ["Score: 5"] * len(prompts)


def _traj(tid: str, n_turns: int) -> Trajectory:
    turns = [Turn(action_ids=[1, 2], action_logprobs=[0.0, 0.0], policy_version=0,
                  text="<answer>x</answer>" if t == n_turns - 1 else "hi") for t in range(n_turns)]
    return Trajectory(trajectory_id=tid, task_id="t", group_id="g", prompt_ids=[5, 6],
                      turns=turns, gold_answers=["x"], finish_reason="answer", answer="x")


def test_slow_judge_bounded_queue_and_timeout(episode) -> None:
    path, _ = episode
    gate = GatedJudge()
    cfg = judge_cfg(queue_size=3, timeout_s=0.5, batch_size=8)
    service = RewardService(RewardsConfig(prm=cfg), None,
                            judges=[LocalJudge(JudgeWorker(cfg, path, gate))])

    async def run() -> tuple[Group, Group, dict, float]:
        first = Group(group_id="a", task_id="t", trajectories=[_traj("a", 2)])
        slow = asyncio.create_task(service.score_group(first))
        await asyncio.sleep(0.1)
        depth = service.stats()  # 2 turns being judged, held by the gate
        t0 = time.perf_counter()
        # 2 + 2 turns would exceed queue_size=3: this group skips the judge at once.
        full = await service.score_group(Group(group_id="b", task_id="t", trajectories=[_traj("b", 2)]))
        waited = time.perf_counter() - t0
        timed_out = await slow
        gate.release.set()
        return timed_out, full, depth, waited

    timed_out, full, depth, waited = asyncio.run(run())
    assert depth["judge_inflight_turns"] == 2 and depth["judge_queue_turns"] == 0
    assert waited < 0.4  # did not wait for the judge (or for the timeout)
    assert full.trajectories[0].reward_errors[0]["error"] == "judge_queue_full"
    assert timed_out.trajectories[0].reward_errors[0]["error"] == "judge_timeout"
    assert timed_out.trajectories[0].turns[-1].rewards == {"outcome": 1.0, "prm": None}
    stats = service.stats()
    assert stats["judge_queue_full"] == 1 and stats["judge_timeout"] == 1


class StepJudge:
    """Scores the k-th step of an episode k out of 10 (reads "### Step k to grade")."""

    def __call__(self, prompts: list[str]) -> list[str]:
        return ["Score: " + re.search(r"### Step (\d+) to grade", p).group(1) for p in prompts]


def test_stamped_trajectories_train_with_the_prm_through_the_learner(episode) -> None:
    """From the reward service's scores to the learner's advantages, with nothing hand-built in
    between: the service scores a PRM (a judge) and the outcome; the learner's advantage
    assembly weighs them with the run's rewards config."""
    import numpy as np

    from learner.advantages.assemble import batch_advantages
    from learner.advantages.config import PRMEstimatorConfig

    path, _ = episode
    cfg = judge_cfg()
    rewards = RewardsConfig(prm=cfg, weights={"prm": 0.5})
    service = RewardService(rewards, None,
                            judges=[LocalJudge(JudgeWorker(cfg, path, StepJudge()))])
    trajs = [_traj("a", 2), _traj("b", 2), _traj("c", 1)]
    for t in trajs[1:]:  # wrong answers: outcome 0
        t.answer, t.turns[-1].text = "y", "<answer>y</answer>"
    scored = asyncio.run(service.score_group(Group(group_id="g", task_id="t", trajectories=trajs)))
    trajs = scored.trajectories
    assert [[turn.rewards["prm"] for turn in t.turns] for t in trajs] == [[0.1, 0.2], [0.1, 0.2], [0.1]]
    assert [t.outcome for t in trajs] == [1.0, 0.0, 0.0]
    assert rewards.trained_weights() == {"outcome": 1.0, "prm": 0.5}
    res, mask = batch_advantages(trajs, PRMEstimatorConfig(), rewards.trained_weights(), rewards.on_missing)
    # PRM pool [.1 .2 .1 .2 .1]: mean .14, population std sqrt(.0024) = .0489898, + eps 1e-6
    # -> z -.816480 (.1) and 1.224720 (.2). Outcome pool [1 0 0]: mean 1/3, std sqrt(2/9) =
    # .471405 -> z 1.414211, -.707105. r = .5 z_prm (+ z_out on a final turn); A_t = r_t + A_{t+1}:
    #   a: r = [-.408240, .612360 + 1.414211] -> A = [1.618331, 2.026571]
    #   b: r = [-.408240, .612360 - .707105] -> A = [-.502985, -.094745]
    #   c: r = [-.408240 - .707105]           -> A = [-1.115345]
    np.testing.assert_allclose(res.advantages, [1.618331, 2.026571, -0.502985, -0.094745, -1.115345],
                               atol=2e-6)
    assert mask.all()
    # Built without the run's rewards the estimator weighs the PRM 1: the config is what was read.
    unweighted, _ = batch_advantages(trajs, PRMEstimatorConfig(), None, rewards.on_missing)
    assert unweighted.advantages[0] == pytest.approx(-0.816480 + 1.224720 + 1.414211, abs=2e-6)
