"""Run-directory bookkeeping for resume: step-keyed logs and the run id."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from learner.run_files import keep_steps_through


def test_keep_steps_through_cuts_later_steps_and_a_torn_line(tmp_path: Path) -> None:
    log = tmp_path / "trained_groups.jsonl"
    rows = [{"step": s, "group_ids": [f"g{s}"]} for s in (1, 2, 3, 4)]
    log.write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"step": 5, "gro')
    assert keep_steps_through(log, 2) == 3  # steps 3 and 4, and the torn step-5 line
    assert [json.loads(line)["step"] for line in log.read_text().splitlines()] == [1, 2]
    assert keep_steps_through(tmp_path / "absent.jsonl", 2) == 0


def test_resume_needs_a_checkpointed_run_and_keeps_its_id(tiny_run_config, tmp_path: Path) -> None:
    from cluster.driver import NothingToResumeError, prepare_run_dir

    cfg = tiny_run_config([f"output_dir={tmp_path}", "name=r"])
    with pytest.raises(NothingToResumeError, match="checkpoint_every"):
        prepare_run_dir(cfg, resume=True)
    run_dir, run_id = prepare_run_dir(cfg)
    (run_dir / "state.json").write_text(json.dumps({"step": 2}))
    (run_dir / "metrics.jsonl").write_text('{"step": 1}\n')
    assert prepare_run_dir(cfg, resume=True) == (run_dir, run_id)
    assert (run_dir / "metrics.jsonl").exists()
    notes: list[str] = []
    _, fresh_id = prepare_run_dir(cfg, say=notes.append)  # a fresh start begins the logs again
    assert fresh_id != run_id and "--resume" in notes[0]
    assert not (run_dir / "metrics.jsonl").exists() and not (run_dir / "state.json").exists()
