"""TurnRL's training loop in one process, top to bottom: the parts a Ray run wires together
(``cluster/actors.py``, ``cluster/driver.py``), called directly and in turn.

Each step: admission grants ``B`` groups; ``G`` episodes per group run on the engine (turns of
all episodes share its batches); the reward service scores every group and puts it into
replay; the learner claims the ``B`` groups, computes turn advantages, takes its PPO step and
acknowledges the batch; the new weights go into the engine, which samples the next step's
episodes with them. A real run overlaps generation and training (``train.async``), runs the
parts as Ray actors, and pushes weights through a transport; the steps are these.

    .venv/bin/python examples/reference_loop.py configs/demo.yaml --steps 5   # make demo's cached warm start
    .venv/bin/python examples/reference_loop.py configs/demo.yaml --steps 3 --set rollout.group_size=4
"""

# ruff: noqa: E402 (the thread policy goes first, before torch loads)
from __future__ import annotations

import argparse
import asyncio
import random
import sys
import tempfile
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere
from rollout.cores import apply_thread_policy

apply_thread_policy()  # before torch loads OpenMP, as every TurnRL process does
from cluster.config import RunConfig, load_config
from cluster.live import local_reward_service
from envs.registry import make_task_source
from learner.bootstrap import ensure_policy
from learner.ports import LocalLearnerPorts
from learner.worker import LearnerWorker
from replay.memory import InProcessReplayStore
from rollout.engines import local_client
from rollout.engines.transport import InMemoryWeights
from rollout.episode import run_episode, sampling_params
from rollout.trajectory import Group


async def rollout_group(cfg: RunConfig, engine, source, task, group_id: str) -> Group:
    """``group_size`` episodes of one task, concurrently; success is the environment's verdict."""
    trajs = await asyncio.gather(*[
        run_episode(engine, source.make_env(), task, sampling_params(cfg.rollout), group_id=group_id,
                    max_context_tokens=cfg.rollout.max_context_tokens, history_turns=cfg.rollout.history_turns)
        for _ in range(cfg.rollout.group_size)])
    for traj in trajs:
        traj.success = traj.error is None and source.success(task, traj.answer)
    return Group(group_id=group_id, task_id=task.task_id, trajectories=list(trajs))


async def train(cfg: RunConfig, steps: int, run_dir: str) -> SimpleNamespace:
    # The world and the policy: tasks from the environment; a tiny Llama warm-started by SFT
    # on the environment's demonstrations (cached), or cfg.policy.path's Hugging Face folder.
    source = make_task_source(cfg.env)
    policy = str(ensure_policy(cfg.policy, cfg.env, source, history_turns=cfg.rollout.history_turns,
                               chat_format=cfg.rollout.chat_format))
    engine = local_client(cfg.rollout.engine, policy, seed=cfg.train.seed)  # HF or vLLM, in-process
    replay = InProcessReplayStore(cfg.replay, batch_groups=cfg.learner.batch_groups)
    rewards = local_reward_service(replay, cfg.rewards, chat_format=cfg.rollout.chat_format)  # a RewardService that puts into replay
    ports = LocalLearnerPorts(replay)  # the learner claims/acks here; published weights land here
    learner = LearnerWorker(cfg.learner, policy, run_dir, ports, group_size=cfg.rollout.group_size,
                            temperature=cfg.rollout.temperature, rewards=cfg.rewards)
    rng, tasks, history = random.Random(cfg.train.seed), source.tasks("train"), []
    for step in range(steps):
        # 1. Admission: a group may start only while it cannot end up more than replay.eta
        #    versions behind the learner (replay/admission.py).
        granted = replay.reserve(cfg.learner.batch_groups)
        # 2. Rollout: token-exact trajectories, every action token with its behaviour log-prob
        #    and the weights version that sampled it (rollout/trajectory.py).
        groups = await asyncio.gather(*[
            rollout_group(cfg, engine, source, rng.choice(tasks), f"step{step}-g{i}") for i in range(granted)])
        # 3. Rewards: every source into its own slot of each turn, then put into replay, which
        #    refuses what is stale, duplicate or over capacity.
        results = [await rewards.submit(group) for group in groups]
        # 4. Learn: claim B groups, advantages (learner/advantages/), PPO-clip with truncated
        #    importance sampling (learner/losses/), one optimizer step, publish, acknowledge.
        metrics = learner.train_step()
        # 5. Weights: the published version into the engine, loaded between decoding steps.
        version, state = ports.published
        serving = await engine.update_weights(version, InMemoryWeights(state))
        history.append(metrics | {"serving": serving, "accepted": sum(r.accepted for r in results)})
        print(f"step {metrics['step']}: loss {metrics['loss/loss']:.4f}  "
              f"success {sum(t.success for g in groups for t in g.trajectories) / max(1, len(groups) * cfg.rollout.group_size):.2f}  "
              f"version {version} serving {serving}", flush=True)
    await rewards.close()
    return SimpleNamespace(history=history, engine=engine, learner=learner, replay=replay, policy=policy)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("config", nargs="?", help="a run config YAML (default: RunConfig's defaults)")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config key")
    args = ap.parse_args()
    cfg = load_config(args.config, args.set)
    with tempfile.TemporaryDirectory(prefix="turnrl-reference-") as run_dir:
        asyncio.run(train(cfg, args.steps, run_dir))


if __name__ == "__main__":
    main()
