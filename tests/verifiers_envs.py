"""verifiers environments the tests load through ``verifiers.load_environment`` (``env.id:
tests.verifiers_envs``, ``args: {kind: ...}``), written against verifiers' public classes as a
verifiers user writes them: a single-turn Q&A (with and without an eval dataset), a multi-turn
guessing game, and environments that crash, hang, rewrite their history or score in groups."""

from __future__ import annotations

import asyncio

import verifiers as vf
from datasets import Dataset

CLEANED: list[str] = []
"""Trajectory ids whose rollout cleanup ran (a cancelled rollout's too)."""


def _qa(n: int, offset: int = 0, answers: bool = True) -> Dataset:
    return Dataset.from_list([{"question": f"What is {i} + {i}?", **({"answer": str(2 * i)} if answers else {})}
                              for i in range(offset, offset + n)])


class Guess(vf.MultiTurnEnv):
    """Guess a number from 1 to 9 inside <answer>: the environment says higher or lower, and
    ends the rollout on a hit."""

    async def env_response(self, messages, state, **kwargs):
        guess = (self.parser.parse_answer(messages) or "").strip()
        if guess == state["answer"]:
            state["final_env_response"] = [vf.UserMessage(content="Correct!")]
            return []
        hint = "higher" if guess.isdigit() and int(guess) < int(state["answer"]) else "lower"
        return [vf.UserMessage(content=f"{guess or 'No guess'}: {hint}.")]

    @vf.cleanup
    async def note(self, state) -> None:
        CLEANED.append(state["trajectory_id"])


class Crash(Guess):
    async def env_response(self, messages, state, **kwargs):
        raise RuntimeError("boom: the environment broke")


class Hang(Guess):
    async def env_response(self, messages, state, **kwargs):
        await asyncio.sleep(3600)


class Rewrite(Guess):
    async def get_prompt_messages(self, state):
        if not state["trajectory"]:
            return state["prompt"]
        return [state["prompt"][-1], vf.UserMessage(content="Start again.")]  # drops the history


def load_environment(kind: str = "single", n: int = 20, eval_n: int = 5) -> vf.Environment:
    parser = vf.XMLParser(["answer"])

    def correct(completion, answer) -> float:
        return float((parser.parse_answer(completion) or "").strip() == answer)

    def hit(state) -> float:
        return float(state.get("final_env_response") is not None)

    def spread(completions) -> list[float]:  # a group reward function: scores the rollouts together
        return [0.0 for _ in completions]

    system = "Answer inside <answer></answer>."
    if kind in ("single", "split", "no_answers", "group"):
        funcs = [correct, parser.get_format_reward_func()] + ([spread] if kind == "group" else [])
        rubric = vf.Rubric(funcs=funcs, weights=[1.0, 0.0] + [0.0] * (kind == "group"), parser=parser)
        extra = {"eval_dataset": _qa(eval_n, offset=1000)} if kind == "single" else {}
        if kind == "no_answers":
            rubric = vf.Rubric(funcs=[parser.get_format_reward_func()], parser=parser)
        return vf.SingleTurnEnv(dataset=_qa(n, answers=kind != "no_answers"), system_prompt=system, parser=parser,
                                rubric=rubric, **extra)
    games = {"guess": Guess, "crash": Crash, "hang": Hang, "rewrite": Rewrite}
    secrets = Dataset.from_list([{"question": f"Round {i}: I picked a number from 1 to 9. Guess it.", "answer": str(1 + i % 9)}
                                 for i in range(n)])
    return games[kind](dataset=secrets, system_prompt=system, parser=parser, max_turns=4,
                       rubric=vf.Rubric(funcs=[hit], parser=parser))
