"""The builtin policy's warm start: where its demonstrations come from and how its cache is keyed."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from envs.registry import make_task_source
from learner.bootstrap import demo_env_config, ensure_policy


def test_sft_env_replaces_keys_of_the_run_env_and_names_bad_ones(tiny_run_config) -> None:
    cfg = tiny_run_config(["policy.sft.env={seed: 3, num_train_tasks: 20}"])
    demo = demo_env_config(cfg.policy, cfg.env)
    assert (demo.seed, demo.num_train_tasks, demo.num_entities) == (3, 20, cfg.env.num_entities)
    assert demo_env_config(tiny_run_config().policy, cfg.env) is None
    bad = tiny_run_config(["policy.sft.env={seeed: 3}"])
    with pytest.raises(ValueError, match=r"policy\.sft\.env.*seeed"):
        demo_env_config(bad.policy, bad.env)


def test_warm_start_on_another_world_trains_on_its_demonstrations(tiny_run_config) -> None:
    # 20 training tasks in the demonstration world vs 300 in the run's: the SFT stats tell
    # which source the demonstrations came from; the cache key separates the two policies
    cfg = tiny_run_config(["policy.sft.env={seed: 3, num_train_tasks: 20}", "policy.sft.steps=2"])
    source = make_task_source(cfg.env)
    path = Path(ensure_policy(cfg.policy, cfg.env, source, show_progress=False))
    stats = json.loads((path / "turnrl_bootstrap.json").read_text())
    assert stats["sft_demos"] == 20.0
    plain = tiny_run_config(["policy.sft.steps=2"])
    other = Path(ensure_policy(plain.policy, plain.env, source, show_progress=False))
    assert other != path
    assert json.loads((other / "turnrl_bootstrap.json").read_text())["sft_demos"] == 200.0
