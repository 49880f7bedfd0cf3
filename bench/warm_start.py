"""How good is a warm start before RL? Free-running success, and per-turn imitation accuracy.

Builds (or loads from the cache) the run's policy exactly as ``turnrl train`` would, then:

1. plays ``--tasks`` held-out and training tasks ``--samples`` times each at
   ``rollout.temperature`` and prints success, mean turns and how episodes ended;
2. teacher-forces the demonstrations of ``--tasks`` training tasks: at each turn it gives the
   policy the demonstration's own context (windowed as ``rollout.history_turns`` says) and
   counts how often its greedy action is exactly the demonstrated one, per turn index.

A policy can write well-formed calls and still fail every task; (2) says at which turn of the
plan it stops following. Numbers of the household study in docs/results/learning_bench.md (the bench's
household warm start; the earlier, whole-house row: ``env.max_turns=10``, no
``env.other_rooms``, ``rollout.history_turns=2``, ``policy.sft.steps=400``):

    python bench/warm_start.py --tasks 25 --samples 4 --set env.type=household \\
        --set env.goal_types=[place] --set env.other_rooms=0 --set env.max_turns=8 \\
        --set env.visible_items=true --set rollout.history_turns=1 --set policy.sft.batch_size=8 \\
        --set policy.sft.steps=900 --set policy.sft.context_loss_weight=0.3 \\
        --set rollout.temperature=0.7
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def free_running(engine: Any, source: Any, cfg: Any, split: str, tasks: int, samples: int) -> str:
    """One line: success, mean turns and end kinds of ``tasks x samples`` episodes."""
    from rollout.episode import run_episode, sampling_params

    params = sampling_params(cfg.rollout)
    chosen = source.tasks(split)[:tasks]

    async def play() -> list[Any]:
        return await asyncio.gather(*[
            run_episode(engine, source.make_env(), task, params, group_id=f"{split}{i}",
                        max_context_tokens=cfg.rollout.max_context_tokens,
                        history_turns=cfg.rollout.history_turns)
            for i, task in enumerate(chosen) for _ in range(samples)])

    t0 = time.perf_counter()
    trajs = asyncio.run(play())
    wins = [source.success(chosen[i // samples], tr.answer) for i, tr in enumerate(trajs)]
    ends = collections.Counter(tr.finish_reason for tr in trajs)
    invalid = sum(any(t.invalid_action for t in tr.turns) for tr in trajs)
    return (f"{split}: success {sum(wins)}/{len(trajs)}, mean turns "
            f"{sum(len(tr.turns) for tr in trajs) / len(trajs):.1f}, ended {dict(ends)}, "
            f"episodes with an invalid action {invalid}/{len(trajs)} "
            f"({time.perf_counter() - t0:.0f} s)")


def imitation(engine: Any, source: Any, cfg: Any, tasks: int) -> str:
    """One line: per turn index, greedy actions equal to the demonstration's / turns tried."""
    from learner.sft import demo_trajectory
    from rollout.engines.base import SamplingParams

    greedy = SamplingParams(temperature=0.0, max_new_tokens=cfg.rollout.max_new_tokens)
    cases = []
    for task in source.tasks("train")[:tasks]:
        traj = demo_trajectory(engine.tokenizer, task, source.demonstration(task),
                               cfg.rollout.history_turns)
        cases += [(t, turn.action_ids, traj.context_ids(turn.context_start, t))
                  for t, turn in enumerate(traj.turns)]

    async def generate() -> list[Any]:
        return await asyncio.gather(*[engine.generate(ctx, greedy) for _, _, ctx in cases])

    hits, tried = collections.Counter(), collections.Counter()
    for (t, gold, _), comp in zip(cases, asyncio.run(generate())):
        tried[t] += 1
        hits[t] += comp.token_ids == gold
    return "imitation (greedy = demonstrated action), by turn: " + ", ".join(
        f"{t}: {hits[t]}/{tried[t]}" for t in sorted(tried))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("config", nargs="?", help="run config YAML (default: built-in defaults)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="K=V")
    parser.add_argument("--tasks", type=int, default=25, help="tasks per split")
    parser.add_argument("--samples", type=int, default=4, help="episodes per task")
    args = parser.parse_args(argv)

    import torch

    from cluster.config import load_config
    from envs.registry import make_task_source
    from learner.bootstrap import ensure_policy
    from rollout.engines import local_client

    cfg = load_config(args.config, args.overrides)
    source = make_task_source(cfg.env)
    t0 = time.perf_counter()
    policy = ensure_policy(cfg.policy, cfg.env, source, history_turns=cfg.rollout.history_turns)
    print(f"policy {policy} ready in {time.perf_counter() - t0:.0f} s")
    torch.set_num_threads(cfg.rollout.torch_threads)  # as a rollout worker; SFT used every core
    engine = local_client(cfg.rollout.engine, str(policy), seed=cfg.train.seed)
    for split in ("heldout", "train"):
        print(free_running(engine, source, cfg, split, args.tasks, args.samples), flush=True)
    print(imitation(engine, source, cfg, args.tasks))


if __name__ == "__main__":
    main()
