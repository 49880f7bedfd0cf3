"""``turnrl``: the command line. Heavy imports happen inside the subcommand that needs them,
so ``turnrl --help`` answers at once."""

from __future__ import annotations

import argparse
import sys

EPILOG = "Config overrides: --set learner.lr=3e-5 --set rollout.group_size=4 (values parsed as YAML)."


def _add_config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("config", nargs="?", help="YAML RunConfig (e.g. configs/demo.yaml); defaults if omitted")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config key by dotted path; repeatable")


def _cmd_train(args: argparse.Namespace) -> int:
    from cluster.config import ConfigError, load_config

    try:
        cfg = load_config(args.config, args.overrides)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.print_config:
        print(cfg.model_dump_json(indent=2, by_alias=True))
        return 0
    import signal

    from cluster.driver import NothingToResumeError, train

    def _graceful(signum, frame):  # `ray job stop` and service stops send SIGTERM
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, _graceful)
    from storage.places import PlaceError

    try:
        result = train(cfg, resume=args.resume)
    except (NothingToResumeError, PlaceError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if result.interrupted:
        print(f"stopped early at step {result.steps}; checkpoint {result.checkpoint}")
        return 130
    print(f"done: {result.steps} steps in {result.timings.get('total_s', 0):.0f}s; run dir {result.run_dir}")
    return 0


# Subcommands implemented elsewhere: name -> (module with main(argv) -> int, help line).
DELEGATED = {
    "eval": ("cluster.eval_cli", "held-out success of a checkpoint: eval CONFIG --checkpoint PATH"),
    "advantages": ("learner.advantages.tool", "compute advantages for a JSONL of turns (docs/advantages.md)"),
    "rewards": ("cluster.rewards_cli", "score logged trajectories offline: rewards score CONFIG --input --output"),
    "prm": ("cluster.rewards_cli", "process reward models: prm train CONFIG"),
    "serve": ("services.cli", "start the REST API and dashboard"),
    "runs": ("services.cli", "talk to a running service: runs submit|list|status|logs|stop"),
    "models": ("cluster.models_cli", "packaged pretrained models, LoRA merges: models list|convert NAME|path NAME|merge CKPT OUT"),
}


def _delegate(name: str, rest: list[str]) -> int:
    import importlib

    module = importlib.import_module(DELEGATED[name][0])
    return module.main([name, *rest]) if module.__name__ != "learner.advantages.tool" else module.main(rest)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="turnrl", description="Multi-turn agent RL on Ray.", epilog=EPILOG)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    train = sub.add_parser("train", help="run a training job", epilog=EPILOG,
                           description="Train a policy: rollout actors, reward actor and a DeepSpeed learner on Ray.")
    _add_config_args(train)
    train.add_argument("--print-config", action="store_true", help="print the resolved config and exit")
    train.add_argument("--resume", action="store_true",
                       help="continue the run in output_dir/name from its last checkpoint (after a crash)")
    for name, (_, help_line) in DELEGATED.items():
        sub.add_parser(name, help=help_line, add_help=False)
    return parser


def main(argv: list[str] | None = None) -> int:
    from rollout.cores import apply_thread_policy

    apply_thread_policy()  # before any subcommand imports torch (SFT, evaluation, scoring run here)
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in DELEGATED:
        return _delegate(argv[0], argv[1:])
    args = build_parser().parse_args(argv)
    if args.command == "train":
        return _cmd_train(args)
    build_parser().print_help()
    return 0


if __name__ == "__main__":
    sys.exit(main())
