"""The credit study's task (configs/credit_search_qa.yaml) and driver (bench/credit.py).

The task: its held-out hop mix, every held-out question answerable by the gold searches in the
corpus, a turn limit of hops + 2, and no held-out or RL-train question among the warm start's
demonstrations. The driver: a two-cell matrix on the tiny policy runs, a second ``run`` skips
the finished cells, and ``table`` prints the paired comparison from the run directories.
"""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from cluster.config import load_config
from cluster.paired_bootstrap import hierarchical_bootstrap, sign_test
from envs.registry import make_task_source
from learner.bootstrap import demo_env_config

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "configs" / "credit_search_qa.yaml"


@pytest.fixture(scope="module")
def task():
    cfg = load_config(str(CONFIG), [])
    return cfg, make_task_source(cfg.env)


def _pairs(tasks) -> set[tuple[str, ...]]:
    """(entity path) of each task: the (start entity, relation chain) pair it asks about."""
    return {tuple(t.metadata["path"][:1] + t.metadata["chain"]) for t in tasks}


def test_the_held_out_set_has_its_hop_mix_and_every_question_is_answerable(task) -> None:
    cfg, source = task
    heldout = source.tasks("heldout")
    assert len(heldout) == 240 >= 200
    assert Counter(t.metadata["hops"] for t in heldout) == {1: 80, 2: 80, 3: 80}
    for t in heldout:  # the gold searches, run through a real episode, retrieve every hop's fact
        messages = source.demonstration(t)
        assert len([m for m in messages if m["role"] == "assistant"]) == t.metadata["hops"] + 1
    assert len(_pairs(heldout)) == 240  # one wording per pair: no pair asked twice


def test_an_episode_may_take_its_hops_plus_two_turns(task) -> None:
    cfg, source = task
    for t in source.tasks("heldout")[:30]:
        env = source.make_env()
        asyncio.run(env.reset(t))
        assert env.max_turns == t.metadata["hops"] + 2
    assert cfg.env.max_turns == 5


def test_the_warm_start_demonstrates_no_held_out_or_rl_train_question(task) -> None:
    cfg, source = task
    demo_source = make_task_source(demo_env_config(cfg.policy, cfg.env))
    demonstrated = _pairs(demo_source.tasks("train")[: cfg.policy.sft.num_demos])
    assert Counter(t.metadata["hops"] for t in demo_source.tasks("train")[: cfg.policy.sft.num_demos]).keys() == {1, 2, 3}
    assert not demonstrated & _pairs(source.tasks("heldout"))
    assert not demonstrated & _pairs(source.tasks("train"))
    # the demonstrations' own held-out part is the run's, and more: the same pools, shuffled alike
    assert _pairs(source.tasks("heldout")) <= _pairs(demo_source.tasks("heldout"))


def test_held_out_questions_do_not_depend_on_how_many_train_tasks_were_drawn() -> None:
    base = ["env.hops=[1, 2, 3]", "env.num_entities=120", "env.num_heldout_tasks=30", "env.max_turns=4"]
    a = make_task_source(load_config(None, [*base, "env.num_train_tasks=50"]).env).tasks("heldout")
    b = make_task_source(load_config(None, [*base, "env.num_train_tasks=700", "env.max_train_pairs=20"]).env)
    assert _pairs(a) == _pairs(b.tasks("heldout"))


def test_turn_limits_beyond_max_turns_are_refused() -> None:
    from cluster.config import ConfigError

    with pytest.raises(ConfigError, match="extra_turns=2 gives 3-hop questions 5 turns, more than max_turns=4"):
        load_config(None, ["env.hops=[1, 3]", "env.max_turns=4", "env.extra_turns=2"])


def test_the_pooled_interval_and_the_sign_test() -> None:
    # three seeds, four tasks each; pooled mean = mean of the seeds' means = (0.5 + 0.25 + 0.5) / 3
    diffs = [np.array([1.0, 0.0, 1.0, 0.0]), np.array([1.0, 0.0, 0.0, 0.0]), np.array([1.0, 1.0, 0.0, 0.0])]
    mean, low, high = hierarchical_bootstrap(diffs, resamples=4000, seed=1)
    assert mean == pytest.approx(5 / 12)
    assert 0.0 <= low < mean < high <= 1.0
    same = hierarchical_bootstrap([np.full(5, 0.2)] * 3, resamples=200)
    assert same == pytest.approx((0.2, 0.2, 0.2))  # nothing varies: a zero-width interval
    assert sign_test([0.1, 0.2, 0.05]) == (3, 0, pytest.approx(0.25))  # 2 * 0.5**3
    assert sign_test([0.1, -0.2, 0.0]) == (1, 1, pytest.approx(1.0))  # the tie is dropped


def _credit(*args: str, out: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / "bench" / "credit.py"), *args, "--quick", "--out", str(out),
                           "--set", f"policy.cache_dir={out / 'policies'}"],
                          cwd=ROOT, capture_output=True, text=True, timeout=1200)


@pytest.mark.slow
def test_a_two_cell_matrix_runs_resumes_and_tabulates(tmp_path) -> None:
    first = _credit("run", "--methods", "grpo,matchtir", "--seeds", "0", out=tmp_path)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    assert "0 of 2 cells done; 2 to run" in first.stdout
    for name in ("grpo-s0", "matchtir-s0"):
        info = json.loads((tmp_path / "cells" / name / "cell.json").read_text())
        assert info["rc"] == 0 and info["load"]["samples"] >= 1 and info["load"]["mean"] >= 0
        evals = [json.loads(x) for x in (tmp_path / "cells" / name / "evals.jsonl").read_text().splitlines()]
        assert [e["step"] for e in evals] == [0, 1]  # before, and after the (last) step
        assert all(len(e["rows"]) == 6 and {"searches", "tool_calls"} <= set(e["rows"][0]["metrics"]) for e in evals)
        rows = [json.loads(x) for x in (tmp_path / "cells" / name / "metrics.jsonl").read_text().splitlines()]
        assert all(0.0 <= r["groups/no_outcome_signal"] <= 1.0 and 0.0 <= r["groups/no_signal"] <= 1.0 for r in rows)
    again = _credit("run", "--methods", "grpo,matchtir", "--seeds", "0", out=tmp_path)
    assert again.returncode == 0 and "2 of 2 cells done; 0 to run" in again.stdout, again.stdout
    table = _credit("table", out=tmp_path)
    assert table.returncode == 0, table.stderr[-3000:]
    for measure in ("final", "auc"):  # both primary measures, each pooled, sign-tested and per seed
        assert re.search(rf"^matchtir +{measure} +pooled [+-]\d\.\d{{3}} \[[+-]\d\.\d{{3}}, [+-]\d\.\d{{3}}\] +"
                         rf"sign \d\+/\d- p=\d\.\d{{3}} +\| s0 [+-]", table.stdout, re.M), table.stdout
    per_cell = (tmp_path / "per_cell.csv").read_text().splitlines()
    assert per_cell[0].startswith("method,seed,steps,success@0,success@last,auc,steps_to_gain,hop1")
    assert [line.split(",")[:3] for line in per_cell[1:]] == [["grpo", "0", "1"], ["matchtir", "0", "1"]]
    assert (tmp_path / "curves.png").stat().st_size > 0


def test_the_tuning_choice_follows_the_registered_rule(tmp_path) -> None:
    """Mean training success over steps 11-20 decides; within 0.02 of the best, the smaller batch."""
    sys.path.insert(0, str(ROOT))
    from bench.credit import cells_dir, tuning_cells, tuning_report

    # steps 1-10 are not counted; 11-20 average to these
    late = {"lr1e-05-b2": 0.30, "lr1e-05-b4": 0.31, "lr3e-05-b2": 0.20, "lr3e-05-b4": 0.45}
    for cell in tuning_cells():
        run_dir = cells_dir(tmp_path) / cell.name
        run_dir.mkdir(parents=True)
        (run_dir / "cell.json").write_text(json.dumps({"rc": 0, "wall_s": 60.0, "tag": cell.tag}))
        (run_dir / "result.json").write_text(json.dumps({"interrupted": False}))
        rows = [{"step": s, "rollout/success_rate": 0.9 if s <= 10 else late[cell.tag]} for s in range(1, 21)]
        (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    text = tuning_report(tmp_path)
    assert "lr3e-05-b4: mean training success, steps 11-20: 0.450" in text
    assert text.endswith("chosen: lr3e-05-b4 (learner.lr=3e-05 learner.batch_groups=4)")
    late["lr3e-05-b2"] = 0.44  # within 0.02 of the best: the smaller batch wins
    rows = [{"step": s, "rollout/success_rate": 0.44} for s in range(1, 21)]
    (cells_dir(tmp_path) / "grpo-lr3e-05-b2-s0" / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert tuning_report(tmp_path).endswith("chosen: lr3e-05-b2 (learner.lr=3e-05 learner.batch_groups=2)")
