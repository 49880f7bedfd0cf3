"""Wiring of estimators and losses: one config line selects them, and a run whose environment
or reward sources cannot supply what the estimator reads fails at start, naming the field.

No Ray, no model: ``check_requirements`` is what ``cluster.driver.train`` calls before it
bootstraps a policy or starts an actor, so testing it on real task sources is testing the start.
"""

from __future__ import annotations

import json
import warnings
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from cluster.config import ConfigError, RunConfig, load_config
from cluster.requirements import check_requirements
from envs.base import Environment, Task, TaskSource
from envs.registry import make_task_source
from learner.advantages import TurnBatch, anchor_hash, compute_advantages, required_fields

FIXTURES = Path(__file__).parent / "fixtures" / "tool_use"

# Small task sets: check_requirements reads provides() and the train tasks' labels only.
_ENV_SIZES = {
    "search_qa": ["env.num_entities=40", "env.num_train_tasks=50", "env.num_heldout_tasks=5"],
    "tool_use": ["env.num_train_tasks=20", "env.num_heldout_tasks=5"],
    "household": ["env.num_train_tasks=10", "env.num_heldout_tasks=2"],
}


def _config(env: str, estimator: str, *extra: str) -> RunConfig:
    return load_config(None, [f"env.type={env}", *_ENV_SIZES[env],
                              f"learner.estimator.type={estimator}", *extra])


@lru_cache(maxsize=None)
def _source(env: str) -> TaskSource:
    """One task source per env type (the estimator and rewards do not change the source)."""
    return make_task_source(_config(env, "grpo").env)


class _WithoutAnchors(TaskSource):
    """A user environment that gives no anchor observations (the built-ins all do)."""

    def __init__(self, inner: TaskSource) -> None:
        self.inner = inner

    def tasks(self, split: str) -> list[Task]:
        return self.inner.tasks(split)

    def make_env(self) -> Environment:
        return self.inner.make_env()

    def demonstration(self, task: Task) -> list[dict[str, Any]]:
        return self.inner.demonstration(task)

    def provides(self) -> set[str]:
        return self.inner.provides() - {"anchor"}


# -- one config line selects the estimator and the loss -------------------------------------
def test_one_line_selects_estimator_and_loss() -> None:
    from learner.advantages.config import HGPOConfig, IGPOConfig
    from learner.losses.config import TrajectoryBalanceConfig

    cfg = load_config(None, ["learner.estimator.type=hgpo", "learner.loss.type=trajectory_balance"])
    assert isinstance(cfg.learner.estimator, HGPOConfig)
    assert isinstance(cfg.learner.loss, TrajectoryBalanceConfig)
    # or the whole section, options included, as one YAML flow mapping
    assert isinstance(load_config(None, ["learner.estimator={type: igpo, gamma: 0.9}"]).learner.estimator,
                      IGPOConfig)


def test_typo_in_estimator_type_fails_at_load_naming_the_key() -> None:
    with pytest.raises(ConfigError, match=r"learner\.estimator") as err:
        load_config(None, ["learner.estimator.type=hgppo"])
    assert "hgpo" in str(err.value) and "gigpo" in str(err.value)  # the known names are listed
    with pytest.raises(ConfigError, match=r"learner\.estimator"):
        load_config(None, ["learner.estimator.type=gigpo", "learner.estimator.step_wieght=1.0"])


# -- failures at start, naming the missing field --------------------------------------------
@pytest.mark.parametrize("estimator", ["hgpo", "gigpo"])
def test_anchor_estimators_fail_without_anchor_observations(estimator: str) -> None:
    cfg = _config("household", estimator)
    with pytest.raises(ValueError, match=rf"{estimator}'? needs \['anchor'\]"):
        check_requirements(cfg, _WithoutAnchors(_source("household")))


def test_igpo_fails_without_ig_rewards() -> None:
    with pytest.raises(ValueError, match=r"igpo'? needs \['ig'\]"):
        check_requirements(_config("search_qa", "igpo"), _source("search_qa"))


def test_matchtir_fails_without_match_rewards() -> None:
    with pytest.raises(ValueError, match=r"matchtir'? needs \['match'\]"):
        check_requirements(_config("tool_use", "matchtir"), _source("tool_use"))


def test_reward_sources_fail_when_the_env_lacks_their_labels() -> None:
    # household tasks carry only a sentinel answer and a planner trace, not labels
    with pytest.raises(ValueError, match=r"rewards\.ig needs gold_answers"):
        check_requirements(_config("household", "igpo", "rewards.ig={}"), _source("household"))
    with pytest.raises(ValueError, match=r"rewards\.match needs gold_tool_calls"):
        check_requirements(_config("household", "matchtir", "rewards.match={}"), _source("household"))


def test_match_rewards_fail_when_task_files_have_no_gold_calls(tmp_path: Path) -> None:
    # provides() is per env type; a tool-use file without gold_calls must still fail at start
    records = [json.loads(x) for x in (FIXTURES / "train.jsonl").read_text().splitlines()]
    path = tmp_path / "train.jsonl"
    path.write_text("".join(json.dumps({k: v for k, v in r.items() if k != "gold_calls"}) + "\n"
                            for r in records))
    cfg = load_config(None, ["env.type=tool_use", f"env.train_path={path}", f"env.heldout_path={path}",
                             "learner.estimator.type=matchtir", "rewards.match={}"])
    with pytest.raises(ValueError, match=r"rewards\.match needs gold_tool_calls, but no train task"):
        check_requirements(cfg, make_task_source(cfg.env))
    # the fixture with its gold calls passes
    ok = load_config(None, ["env.type=tool_use", f"env.train_path={FIXTURES / 'train.jsonl'}",
                            f"env.heldout_path={FIXTURES / 'heldout.jsonl'}",
                            "learner.estimator.type=matchtir", "rewards.match={}"])
    check_requirements(ok, make_task_source(ok.env))


# -- every configured reward source counts: an estimator reads it or the run is refused -----
_PRM = "rewards.prm={type: model, path: runs/prm}"


def test_a_source_the_estimator_ignores_fails_at_start_naming_it() -> None:
    # GRPO reads the outcome only: a PRM would score every turn and be thrown away.
    with pytest.raises(ValueError, match=r"grpo'? does not read rewards\.prm"):
        check_requirements(_config("search_qa", "grpo", _PRM), _source("search_qa"))
    # IG under RLOO, and env named in rewards.weights under GRPO, too.
    with pytest.raises(ValueError, match=r"does not read rewards\.ig, rewards\.weights\.env"):
        check_requirements(_config("search_qa", "rloo", "rewards.ig={}", "rewards.weights={env: 0.5}"),
                           _source("search_qa"))
    # HGPO never reads the outcome: an outcome weight set on purpose is named.
    with pytest.raises(ValueError, match=r"hgpo'? does not read rewards\.outcome"):
        check_requirements(_config("household", "hgpo", "rewards.outcome.weight=2"), _source("household"))


def test_ignored_source_warns_when_opted_in_or_weighted_zero() -> None:
    cfg = _config("search_qa", "grpo", _PRM, "rewards.unread=warn")
    with pytest.warns(UserWarning, match=r"does not read rewards\.prm"):
        check_requirements(cfg, _source("search_qa"))
    # weight 0: scored for monitoring, deliberately not trained on
    check_requirements(_config("search_qa", "grpo", _PRM, "rewards.weights={prm: 0}"), _source("search_qa"))


@pytest.mark.parametrize("env,estimator,extra", [
    ("search_qa", "prm", [_PRM]),
    ("search_qa", "igpo", ["rewards.ig={}", _PRM]),
    ("household", "gigpo", [_PRM]),
    ("tool_use", "matchtir", ["rewards.match={}", _PRM]),
])
def test_turn_estimators_read_every_configured_source(env: str, estimator: str, extra: list[str]) -> None:
    from cluster.requirements import unread_sources

    cfg = _config(env, estimator, *extra)
    check_requirements(cfg, _source(env))  # raises on a source it would not read
    weights = cfg.rewards.trained_weights()
    assert "prm" in weights and unread_sources(cfg) == []
    # "Reads" means the advantages move with it: change each configured source on one
    # non-final turn (the outcome on one rollout) and the estimator's output must change.
    base = _three_rollouts(weights)
    before = compute_advantages(base, cfg.learner.estimator, weights).advantages
    # The outcome is always scored; GiGPO's default episode return is the env reward instead.
    read = {s for s in weights if s != "outcome"} | (required_fields(cfg.learner.estimator) & {"outcome"})
    for source in read:
        moved = _three_rollouts(weights, moved=source)
        after = compute_advantages(moved, cfg.learner.estimator, weights).advantages
        assert not np.allclose(before, after), f"{estimator} ignored {source}"


_JUDGE = "rewards.prm={type: judge, backend: callable, function: 'rewards.judge:format_judge'}"


@pytest.mark.parametrize("prm", [_PRM, _JUDGE])
def test_live_training_with_a_prm_or_judge_passes_under_the_default_estimator(prm: str) -> None:
    # train.source: live trains only live sessions, whose estimator is the
    # running baseline (learner.live_baseline), which reads every source; the default
    # estimator (GRPO, outcome only) never sees a batch, so it cannot refuse the PRM/judge.
    from cluster.requirements import unread_sources
    from learner.advantages.config import LiveBaselineConfig
    from learner.advantages.live import running_baseline

    cfg = load_config(None, [*_ENV_SIZES["search_qa"], prm, "live.enabled=true", "train.source=live"])
    assert cfg.learner.estimator.type == "grpo"
    check_requirements(cfg, _source("search_qa"))
    assert unread_sources(cfg) == []
    # mixed trains rollout groups under GRPO too: there the PRM would be thrown away, refused
    mixed = load_config(None, [*_ENV_SIZES["search_qa"], prm, "live.enabled=true", "train.source=mixed"])
    with pytest.raises(ValueError, match=r"does not read rewards\.prm"):
        check_requirements(mixed, _source("search_qa"))
    # "reads every source": the live advantages move with the PRM's value of one turn
    weights = cfg.rewards.trained_weights()
    assert set(weights) == {"outcome", "prm"}
    before = running_baseline(_three_rollouts(weights), LiveBaselineConfig(), {}, weights)[0].advantages
    after = running_baseline(_three_rollouts(weights, moved="prm"), LiveBaselineConfig(), {}, weights)[0].advantages
    assert not np.allclose(before, after)


def _three_rollouts(weights: dict[str, float], moved: str | None = None) -> TurnBatch:
    """One group of three 2-turn rollouts with a value for every source in ``weights``
    (and the env reward and anchors GiGPO reads); ``moved`` changes one value of that source:
    turn 0 of rollout 0, or rollout 0's outcome. Three rollouts, because a pool of two
    z-scores to +-1 whatever the values."""
    values = {s: np.array([0.2, 0.7, 0.5, 0.1, 0.9, 0.4]) for s in {*weights, "env"} - {"outcome"}}
    outcome = np.array([1.0, 1.0, 0.0, 0.0, 0.5, 0.5])
    if moved == "outcome":
        outcome[:2] = 0.25
    elif moved is not None:
        values[moved][0] = 0.65
    return TurnBatch(
        group_id=np.zeros(6, np.int64), rollout_id=np.repeat(np.arange(3), 2),
        turn_index=np.tile(np.arange(2), 3), outcome=outcome, rewards=values,
        anchor=np.array([anchor_hash(a) for a in ["s", "x", "s", "y", "s", "x"]]),
        mask=np.ones(6, bool), invalid=None)


def test_prm_estimator_needs_a_prm() -> None:
    with pytest.raises(ValueError, match=r"prm'? needs \['prm'\]"):
        check_requirements(_config("search_qa", "prm"), _source("search_qa"))


# -- the runs the learning bench makes start --------------------------------------------------
@pytest.mark.parametrize("env,estimator,extra", [
    ("search_qa", "grpo", []),
    ("search_qa", "igpo", ["rewards.ig={}"]),
    ("search_qa", "a2tgpo", ["rewards.ig={}"]),
    ("household", "grpo", []),
    ("household", "gigpo", []),
    ("household", "hgpo", []),
    ("household", "gigpo", ["learner.estimator.episode_return=outcome"]),
    ("tool_use", "grpo", []),
    ("tool_use", "matchtir", ["rewards.match={}"]),
    ("tool_use", "matchtir", ["rewards.match={}", "learner.estimator.final_turn_reward=match"]),
])
def test_supported_combinations_pass(env: str, estimator: str, extra: list[str]) -> None:
    from cluster.requirements import supplied_fields

    from cluster.requirements import unread_sources

    cfg, source = _config(env, estimator, *extra), _source(env)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # accepted means accepted silently, not with a warning
        check_requirements(cfg, source)  # raises on a combination it refuses
    assert unread_sources(cfg) == []  # nothing configured is scored and thrown away
    # and what it accepted is really covered: every field the estimator reads is supplied
    assert required_fields(cfg.learner.estimator) <= supplied_fields(cfg, source)
    assert cfg.learner.estimator.type == estimator and cfg.env.type == env


def test_trajectory_balance_with_a_history_window_fails_naming_both_keys() -> None:
    cfg = load_config(None, ["env.type=household", "learner.loss.type=trajectory_balance",
                             "rollout.history_turns=2"])
    with pytest.raises(ValueError, match=r"learner\.loss\.type.*rollout\.history_turns=2"):
        check_requirements(cfg, make_task_source(cfg.env))
