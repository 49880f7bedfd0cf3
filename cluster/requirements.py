"""Fail at start, naming what is missing, when the estimator or a reward source needs data
the environment or the configured reward sources cannot supply, and naming what would be
wasted, when a configured reward source is one the estimator does not read.

``learner.estimator`` is used only for rollout groups: with ``train.source: live`` every batch is
live sessions, whose estimator (``learner.live_baseline``) reads every source a trajectory
carries, so neither check on the estimator applies."""

from __future__ import annotations

import warnings

from envs.base import TaskSource

from cluster.config import RunConfig

_SOURCE_NEEDS = {"ig": "gold_answers", "match": "gold_tool_calls"}


def supplied_fields(cfg: RunConfig, source: TaskSource) -> set[str]:
    fields = {"outcome", "env"}
    provides = source.provides()
    if "anchor" in provides:
        fields.add("anchor")
    for name in ("ig", "match", "prm"):
        if getattr(cfg.rewards, name, None) is not None:
            fields.add(name)
    return fields


def check_reward_sources(cfg: RunConfig, source: TaskSource) -> None:
    """Each configured reward source gets what it reads: IG the gold answers, matching the gold
    tool calls; a judge's callable imports. (A PRM reads only the trajectory; its labels are
    needed by ``turnrl prm train``, which checks them itself.)"""
    provides = source.provides()
    for reward, label in _SOURCE_NEEDS.items():
        if getattr(cfg.rewards, reward, None) is not None and label not in provides:
            raise ValueError(
                f"rewards.{reward} needs {label}, which env type {cfg.env.type!r} does not provide; "
                f"remove rewards.{reward} or use an environment with {label}"
            )
        # provides() is per env type; file-backed tasks may still lack the label (a tool-use
        # file without gold_calls), which would otherwise mask every turn of the source.
        if getattr(cfg.rewards, reward, None) is not None and not any(
                getattr(task, label) for task in source.tasks("train")):
            raise ValueError(
                f"rewards.{reward} needs {label}, but no train task of env {cfg.env.type!r} has "
                f"any; add {label} to the task data or remove rewards.{reward}"
            )
    prm = cfg.rewards.prm
    if prm is not None and prm.type == "judge" and prm.backend == "callable":
        from rewards.judge import load_callable

        load_callable(prm.function)  # raises naming the function


def trains_rollouts(cfg: RunConfig) -> bool:
    """Whether any batch holds rollout groups, the only ones ``learner.estimator`` sees."""
    return cfg.train.source != "live"


def unread_sources(cfg: RunConfig) -> list[str]:
    """Configured reward sources the estimator would never read: a set section (ig, match,
    prm) or a source named in ``rewards.weights``, the outcome only when its weight was set
    explicitly (it is always scored), and never one weighted 0 (deliberately unused). None
    when only live sessions are trained (their running baseline reads every source)."""
    from learner.advantages import read_sources

    if not trains_rollouts(cfg):
        return []
    configured = cfg.rewards.trained_weights()
    read = read_sources(cfg.learner.estimator, configured)
    return [s for s, w in configured.items()
            if s not in read and w != 0
            and (s != "outcome" or cfg.rewards.explicitly_weighted("outcome"))]


def check_sources_are_read(cfg: RunConfig) -> None:
    """Every configured source counts: fail (or, with ``rewards.unread=warn``, warn) naming
    the ones the chosen estimator ignores."""
    unread = unread_sources(cfg)
    if not unread:
        return
    names = ", ".join(f"rewards.{s}" if getattr(cfg.rewards, s, None) is not None
                      else f"rewards.weights.{s}" for s in unread)
    message = (
        f"learner.estimator.type={cfg.learner.estimator.type!r} does not read {names}: it would be "
        "scored on every rollout and thrown away. Pick an estimator that reads turn rewards "
        "(igpo, a2tgpo, matchtir, prm, gigpo, hgpo take every configured turn source), remove "
        f"{names}, weight it 0 in rewards.weights, or set rewards.unread=warn to go on anyway"
    )
    if cfg.rewards.unread == "warn":
        warnings.warn(message, stacklevel=2)
    else:
        raise ValueError(message)


def check_requirements(cfg: RunConfig, source: TaskSource) -> None:
    from learner.advantages import required_fields

    provides = source.provides()
    check_reward_sources(cfg, source)
    check_sources_are_read(cfg)
    if cfg.learner.loss.type == "trajectory_balance" and cfg.rollout.history_turns is not None:
        raise ValueError(
            "learner.loss.type='trajectory_balance' sums log-probs over whole episodes, but "
            f"rollout.history_turns={cfg.rollout.history_turns} trains each turn in its own row; "
            "unset rollout.history_turns or use the ppo loss"
        )
    missing = required_fields(cfg.learner.estimator) - supplied_fields(cfg, source)
    if missing and trains_rollouts(cfg):
        raise ValueError(
            f"learner.estimator.type={cfg.learner.estimator.type!r} needs {sorted(missing)}, which this run "
            f"does not supply (env {cfg.env.type!r} provides {sorted(provides)}; reward sources configured: "
            f"{sorted(supplied_fields(cfg, source) - {'anchor'})}). Enable the reward source or pick another estimator."
        )
