"""A verifiers environment (docs/envs.md, "verifiers"), written as one would for verifiers itself:
a ``ToolEnv`` whose ``add`` tool adds two numbers, a dataset of questions and answers, and a
rubric that checks the ``<answer>``. ``env: {type: verifiers, id: examples.envs.vf_sums}``."""

import random

import verifiers as vf
from datasets import Dataset


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: The first number.
        b: The second number.
    """
    return a + b


def load_environment(num_examples: int = 200, seed: int = 0) -> vf.Environment:
    rng = random.Random(seed)
    pairs = [(rng.randint(10, 999), rng.randint(10, 999)) for _ in range(num_examples)]
    dataset = Dataset.from_list([{"question": f"What is {a} + {b}?", "answer": str(a + b)} for a, b in pairs])
    parser = vf.XMLParser(["answer"])

    def correct(completion, answer) -> float:
        return float((parser.parse_answer(completion) or "").strip() == answer)

    rubric = vf.Rubric(funcs=[correct, parser.get_format_reward_func()], weights=[1.0, 0.0], parser=parser)
    return vf.ToolEnv(dataset=dataset, tools=[add], max_turns=3, parser=parser, rubric=rubric,
                      system_prompt="Call add, then give the sum inside <answer></answer>.")
