"""``turnrl rewards score`` (offline scoring of logged trajectories) and ``turnrl prm train``.

Both load the run's config (``cluster.config.load_config``) so the sources, their settings and
the policy are exactly a training run's. Scoring runs the same ``RewardService`` as training,
in-process, with no replay: every configured source is written per turn into the schema's
JSONL, failures as ``None`` plus a flag in ``reward_errors``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path
from typing import Any

from cluster.config import ConfigError, RunConfig, load_config

_RESCORED_DETAILS = ("ig", "prm")


def _config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("config", help="YAML RunConfig (the same file a training run uses)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config key by dotted path; repeatable")


def build_parser(prog: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=f"turnrl {prog}")
    sub = parser.add_subparsers(dest="action", metavar="ACTION", required=True)
    if prog == "rewards":
        score = sub.add_parser("score", help="score a trajectories JSONL with the configured sources")
        _config_args(score)
        score.add_argument("--input", required=True, help="trajectories JSONL (the schema's)")
        score.add_argument("--output", required=True, help="where the scored JSONL goes")
        score.add_argument("--policy", help="policy folder for IG and decoding (default: the "
                                            "config's policy, e.g. a run's checkpoint)")
        score.add_argument("--policy-version", type=int, default=0,
                           help="weights version recorded on IG values (default 0)")
    else:
        train = sub.add_parser("train", help="train rewards.prm from environment-labelled turns")
        _config_args(train)
        train.add_argument("--output", help="where the PRM goes (default: rewards.prm.path)")
        train.add_argument("--episodes", help="train on this labelled trajectories JSONL "
                                              "(labels per turn) instead of playing the env")
    return parser


def _policy_and_source(cfg: RunConfig) -> tuple[str, Any]:
    from envs.registry import make_task_source
    from learner.bootstrap import ensure_policy

    source = make_task_source(cfg.env)
    path = ensure_policy(cfg.policy, cfg.env, source, show_progress=False,
                         history_turns=cfg.rollout.history_turns, chat_format=cfg.rollout.chat_format)
    return str(path), source


def _groups(trajs: list[Any]) -> list[Any]:
    """Trajectories regrouped by ``group_id`` in order of first appearance."""
    from rollout.trajectory import Group

    by_id: dict[str, list[Any]] = {}
    for traj in trajs:
        by_id.setdefault(traj.group_id, []).append(traj)
    return [Group(group_id=gid, task_id=ts[0].task_id, trajectories=ts) for gid, ts in by_id.items()]


def _reset(traj: Any, sources: list[str]) -> None:
    """Forget earlier scores of the sources about to be rescored (env stays: it is logged)."""
    traj.reward_errors = []
    traj.reward_details = {k: v for k, v in traj.reward_details.items() if k not in _RESCORED_DETAILS}
    for turn in traj.turns:
        for source in sources:
            if source != "env":
                turn.rewards.pop(source, None)
                turn.reward_versions.pop(source, None)


def build_service(cfg: RunConfig, policy_path: str, policy_version: int = 0) -> Any:
    """The training run's ``RewardService`` with in-process scorer and judge, no replay."""
    from rewards.service import LocalJudge, LocalScorer, RewardService

    rc = cfg.rewards
    scorers, judges = [], []
    if rc.ig is not None or (rc.prm is not None and rc.prm.type == "model"):
        from rewards.scorer import ModelScorer

        scorers = [LocalScorer(ModelScorer(rc, policy_path, initial_version=policy_version))]
    if rc.prm is not None and rc.prm.type == "judge":
        from rewards.judge import JudgeWorker

        judges = [LocalJudge(JudgeWorker(rc.prm, policy_path, chat_format=cfg.rollout.chat_format))]
    return RewardService(rc, None, scorers, judges, cfg.rollout.chat_format)


def score(cfg: RunConfig, input_path: str, output_path: str, policy: str | None = None,
          policy_version: int = 0) -> dict[str, Any]:
    """Score ``input_path`` into ``output_path``; returns the service's counters."""
    from cluster.requirements import check_reward_sources
    from rollout.trajectory import read_jsonl, write_jsonl

    trajs = list(read_jsonl(input_path))
    if policy is None:
        policy, source = _policy_and_source(cfg)
        check_reward_sources(cfg, source)
    service = build_service(cfg, policy, policy_version)
    for traj in trajs:
        _reset(traj, cfg.rewards.enabled())

    async def run() -> None:
        await asyncio.gather(*[service.score_group(g) for g in _groups(trajs)])

    asyncio.run(run())
    write_jsonl(output_path, trajs)  # input order, whatever the grouping
    return service.stats()


def train(cfg: RunConfig, output: str | None = None, episodes: str | None = None) -> dict[str, Any]:
    """Build, train, evaluate and save ``rewards.prm``; returns the summary written with it."""
    from rewards.config import PRMConfig
    from rewards.prm import ProcessRewardModel, read_meta, retokenizer
    from rewards.prm_data import labelled_episodes
    from rewards.prm_train import evaluate_prm, train_prm
    from rollout.trajectory import read_jsonl

    prm_cfg = cfg.rewards.prm
    if not isinstance(prm_cfg, PRMConfig):
        raise ConfigError("prm train needs rewards.prm with type: model (and a path to write); "
                          "e.g. --set rewards.prm.type=model --set rewards.prm.path=runs/prm")
    tc = prm_cfg.train
    policy, source = _policy_and_source(cfg)
    init = policy if tc.init_from == "policy" else tc.init_from
    prm = ProcessRewardModel.load(init, prm_cfg.head, prm_cfg.good_token, prm_cfg.bad_token)
    out_dir = output or prm_cfg.path
    previous = read_meta(out_dir) or {}
    prm.version = int(previous.get("version", 0)) + 1
    convert = None
    if episodes:
        from transformers import AutoTokenizer

        data = list(read_jsonl(episodes))
        convert = retokenizer(AutoTokenizer.from_pretrained(policy), prm.tokenizer)
    else:
        data = labelled_episodes(source, source.tasks("train")[: tc.num_tasks], prm.tokenizer,
                                 bad_step_rate=tc.bad_step_rate, seed=tc.seed,
                                 chat_format=cfg.rollout.chat_format)
    summary: dict[str, Any] = {"init_from": init, "episodes": len(data),
                               **train_prm(prm, data, tc, convert=convert)}
    if tc.heldout_tasks:
        held = labelled_episodes(source, source.tasks("heldout")[: tc.heldout_tasks],
                                 prm.tokenizer, bad_step_rate=tc.bad_step_rate, seed=tc.seed + 1,
                                 chat_format=cfg.rollout.chat_format)
        summary["heldout"] = evaluate_prm(prm, held, token_budget=prm_cfg.token_budget)
    prm.save(out_dir, summary)
    return {"path": str(Path(out_dir).resolve()), "version": prm.version, **summary}


def main(argv: list[str]) -> int:
    prog = argv[0] if argv and argv[0] in ("rewards", "prm") else "rewards"
    args = build_parser(prog).parse_args(argv[1:] if argv and argv[0] == prog else argv)
    try:
        cfg = load_config(args.config, args.overrides)
        if prog == "rewards":
            result = score(cfg, args.input, args.output, args.policy, args.policy_version)
        else:
            result = train(cfg, args.output, args.episodes)
    except (ConfigError, ValueError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(result, indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
