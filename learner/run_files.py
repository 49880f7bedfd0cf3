"""Step-keyed JSONL logs of a run directory, cut back when a run resumes from a checkpoint."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def keep_steps_through(path: Path, step: int) -> int:
    """Drop the rows of ``path`` whose ``step`` is after ``step`` (the resumed run writes them
    again); returns rows dropped. Rows without a step, and a torn last line, are dropped too."""
    if not path.exists():
        return 0
    keep, dropped = [], 0
    for line in path.read_text().splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            dropped += 1  # the crash tore this line mid-write
            continue
        if isinstance(row, dict) and isinstance(row.get("step"), int) and row["step"] <= step:
            keep.append(line)
        else:
            dropped += bool(line.strip())
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(line + "\n" for line in keep))
    tmp.replace(path)
    return dropped


def log_trained(path: Path, step: int, version: int, claim: Any) -> None:
    """Append what a step trained (``claim``'s groups and trajectories, by id) to ``path``, the
    run's ``trained_groups.jsonl``: exactly-once is checked on it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as fh:
        fh.write(json.dumps({"step": step, "version": version, "claim_id": claim.claim_id,
                             "group_ids": [g.group_id for g in claim.groups],
                             "trajectory_ids": [t.trajectory_id for g in claim.groups for t in g.trajectories]}) + "\n")
