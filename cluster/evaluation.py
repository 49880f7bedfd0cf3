"""Held-out evaluation spread over the rollout workers."""

from __future__ import annotations

import json
from collections import deque
from pathlib import Path
from typing import Any

import numpy as np

from cluster.config import EvalConfig


CHUNK_TASKS = 8
"""Tasks per evaluate call: small enough for a smooth progress bar and ETA."""
CHUNKS_IN_FLIGHT = 4
"""Calls each worker holds at once: with 4 samples a task, 128 episodes, more than the
engine's default batch (64), so it stays full while finished chunks are replaced."""


EVALS_FILE = "evals.jsonl"
"""Every held-out evaluation of a run, one JSON line each: ``{"step": N, "rows": [...]}`` with
one row per task (``RolloutWorker.score_task``: success, turns, the environment's metrics), so
curves can be compared task by task between runs."""


def evaluate(rollouts: list[Any], tasks: list[Any], cfg: EvalConfig, show_progress: bool = False,
             record: tuple[Path, int] | None = None) -> dict[str, float]:
    """Success per task id: tasks go out in chunks, a few per worker at a time, and a bar
    (``show_progress``) follows them to the end with an ETA. ``record``: (run directory, step)
    appends the rows to its ``EVALS_FILE``."""
    rows = evaluate_rows(rollouts, tasks, cfg, show_progress)
    if record is not None:
        run_dir, step = record
        with (run_dir / EVALS_FILE).open("a") as f:
            f.write(json.dumps({"step": step, "rows": rows}) + "\n")
    return {row["task_id"]: row["success"] for row in rows}


def evaluate_rows(rollouts: list[Any], tasks: list[Any], cfg: EvalConfig,
                  show_progress: bool = False) -> list[dict[str, Any]]:
    """``evaluate``'s rows, one per task, in the order they finished."""
    import ray
    from tqdm import tqdm

    queue = deque(tasks[i : i + CHUNK_TASKS] for i in range(0, len(tasks), CHUNK_TASKS))
    free = deque(w for _ in range(CHUNKS_IN_FLIGHT) for w in rollouts)  # a worker per free slot
    pending: dict[Any, Any] = {}
    out: list[dict[str, Any]] = []
    with tqdm(total=len(tasks), desc="eval", unit="task", dynamic_ncols=True, disable=not show_progress) as bar:
        while queue or pending:
            while queue and free:
                worker = free.popleft()
                pending[worker.evaluate.remote(queue.popleft(), cfg.samples_per_task, cfg.temperature)] = worker
            (ref,), _ = ray.wait(list(pending), num_returns=1)
            free.append(pending.pop(ref))
            rows = ray.get(ref)
            out += rows
            bar.update(len(rows))
    return out


def aligned(before: dict[str, float], after: dict[str, float]) -> tuple[np.ndarray, np.ndarray]:
    ids = sorted(set(before) & set(after))
    return np.array([before[i] for i in ids]), np.array([after[i] for i in ids])
