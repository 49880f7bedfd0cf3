"""``turnrl eval``: a checkpoint saved by a real (one-step) training run, evaluated through the
CLI on held-out tasks."""

from __future__ import annotations

import json

import pytest
from conftest import TINY_OVERRIDES

from cluster.cli import main


@pytest.mark.slow
def test_eval_reports_success_with_an_interval_and_writes_one_row_per_task(
        tiny_run_config, tiny_policy, ray_cluster, tmp_path, capsys) -> None:
    from cluster.driver import train

    run_cfg = [*TINY_OVERRIDES, f"policy.cache_dir={tiny_run_config().policy.cache_dir}",
               f"output_dir={tmp_path}", "name=ev", "progress=none"]
    cfg = tiny_run_config([*run_cfg[-3:], "train.steps=1", "rollout.group_size=2", "learner.batch_groups=2",
                           "rollout.groups_in_flight=2", "rollout.max_new_tokens=48", "eval.num_tasks=0"])
    result = train(cfg, on_stage=lambda s: None)
    out = tmp_path / "rows.jsonl"
    sets = [a for kv in [*run_cfg, "eval.num_tasks=6", "eval.samples_per_task=2", "eval.temperature=1.0",
                         "rollout.max_new_tokens=48"] for a in ("--set", kv)]
    capsys.readouterr()
    # the run directory: its state.json names the last checkpoint
    assert main(["eval", "--checkpoint", str(result.run_dir), *sets, "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    summary = json.loads(printed.strip().splitlines()[-1])
    rows = [json.loads(line) for line in out.read_text().splitlines()]

    assert summary["checkpoint"] == str(result.checkpoint)
    from envs.registry import make_task_source

    heldout = make_task_source(cfg.env).tasks("heldout")[:6]
    assert [r["task_id"] for r in rows] == [t.task_id for t in heldout]  # in task order, each once
    for r in rows:
        assert len(r["samples"]) == 2 and set(r["samples"]) <= {0.0, 1.0}
        assert r["success"] == sum(r["samples"]) / 2  # per-task mean of its samples
        assert 1 <= r["turns"] <= cfg.env.max_turns
        # per-task means of each sample's counts: halves, and the searches among the calls
        assert (2 * r["metrics"]["tool_calls"]).is_integer() and (2 * r["metrics"]["searches"]).is_integer()
        assert r["metrics"]["searches"] <= r["metrics"]["tool_calls"]
    mean = sum(r["success"] for r in rows) / 6
    assert summary["tasks"] == 6 and summary["success"] == pytest.approx(mean, abs=1e-12)
    low, high = summary["ci95"]
    assert 0.0 <= low <= mean <= high <= 1.0
    # the environment's own metrics: each the mean of the per-task means
    assert summary["metrics"]["tool_calls"] == pytest.approx(sum(r["metrics"]["tool_calls"] for r in rows) / 6)
    assert f"held-out success {mean:.3f} on 6 tasks x 2 samples" in printed
    assert f"bootstrap 95% CI [{low:.3f}, {high:.3f}]" in printed


def test_eval_without_a_checkpoint_folder_names_what_to_pass(tmp_path, capsys) -> None:
    assert main(["eval", "--checkpoint", str(tmp_path)]) == 2
    assert "not a Hugging Face model folder" in capsys.readouterr().err


def test_bootstrap_interval_of_a_constant_is_that_constant() -> None:
    import numpy as np

    from cluster.paired_bootstrap import bootstrap_mean_ci

    # every resample of [1, 1, 1] has mean 1; of [0, 1] the means are 0, 0.5 or 1
    assert bootstrap_mean_ci(np.ones(3)) == (1.0, 1.0)
    low, high = bootstrap_mean_ci(np.array([0.0, 1.0]), resamples=4000)
    assert (low, high) == (0.0, 1.0)
