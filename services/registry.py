"""The run registry: who submitted which run, where it lives and what Ray last said about it.

SQLite (WAL), one row per run, so a restarted service finds its runs again and reconnects to
the Ray jobs behind them. Status is a small state machine; ``TERMINAL`` states never change.
"""

from __future__ import annotations

import sqlite3
import threading
import time
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Literal

Status = Literal["queued", "pending", "running", "stopping", "succeeded", "stopped", "failed", "lost"]
TERMINAL: frozenset[str] = frozenset({"succeeded", "stopped", "failed", "lost"})
STARTED: tuple[str, ...] = ("pending", "running", "stopping")
"""Runs with a Ray job: what ``jobs.max_running`` counts."""
ACTIVE: tuple[str, ...] = ("queued", *STARTED)
"""Runs not finished: what a tenant's ``limits.max_concurrent_runs`` counts, queued ones too."""

_SCHEMA = """
CREATE TABLE IF NOT EXISTS runs (
    id TEXT PRIMARY KEY,
    owner TEXT NOT NULL,
    name TEXT NOT NULL,
    status TEXT NOT NULL,
    run_dir TEXT NOT NULL,
    total_steps INTEGER NOT NULL,
    created_at REAL NOT NULL,
    updated_at REAL NOT NULL,
    finished_at REAL,
    stop_requested INTEGER NOT NULL DEFAULT 0,
    message TEXT
);
CREATE INDEX IF NOT EXISTS runs_owner ON runs (owner, created_at);
CREATE INDEX IF NOT EXISTS runs_status ON runs (status);
"""


@dataclass
class RunRecord:
    id: str
    owner: str
    name: str
    status: str
    run_dir: str
    total_steps: int
    created_at: float
    updated_at: float
    finished_at: float | None = None
    stop_requested: bool = False
    message: str | None = None

    @property
    def terminal(self) -> bool:
        return self.status in TERMINAL


_COLUMNS = [f.name for f in fields(RunRecord)]


class RunRegistry:
    """Thread-safe: FastAPI runs sync endpoints on a thread pool."""

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self._lock = threading.Lock()
        self._db = sqlite3.connect(str(path), check_same_thread=False, isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL")  # readers never block the writer
        self._db.execute("PRAGMA busy_timeout=5000")
        self._db.executescript(_SCHEMA)

    def close(self) -> None:
        with self._lock:
            self._db.close()

    def _row(self, row: tuple[Any, ...] | None) -> RunRecord | None:
        if row is None:
            return None
        rec = RunRecord(**dict(zip(_COLUMNS, row)))
        rec.stop_requested = bool(rec.stop_requested)
        return rec

    def add(self, rec: RunRecord) -> None:
        with self._lock:
            self._db.execute(f"INSERT INTO runs ({', '.join(_COLUMNS)}) VALUES ({', '.join('?' * len(_COLUMNS))})",
                             [getattr(rec, c) for c in _COLUMNS])

    def get(self, run_id: str) -> RunRecord | None:
        with self._lock:
            cur = self._db.execute(f"SELECT {', '.join(_COLUMNS)} FROM runs WHERE id = ?", (run_id,))
            return self._row(cur.fetchone())

    def list(self, owner: str | None = None, statuses: tuple[str, ...] | None = None) -> list[RunRecord]:
        where, args = [], []
        if owner is not None:
            where.append("owner = ?")
            args.append(owner)
        if statuses:
            where.append(f"status IN ({', '.join('?' * len(statuses))})")
            args.extend(statuses)
        sql = f"SELECT {', '.join(_COLUMNS)} FROM runs"
        if where:
            sql += " WHERE " + " AND ".join(where)
        with self._lock:
            rows = self._db.execute(sql + " ORDER BY created_at DESC", args).fetchall()
        return [self._row(r) for r in rows]

    def update(self, run_id: str, **changes: Any) -> RunRecord | None:
        """Apply ``changes``; a terminal run keeps its status (late reports cannot revive it)."""
        unknown = set(changes) - set(_COLUMNS)
        if unknown:
            raise ValueError(f"unknown run fields: {sorted(unknown)}")
        changes["updated_at"] = time.time()
        sets = ", ".join(f"{k} = ?" for k in changes)
        guard = "" if "status" not in changes else f" AND status NOT IN ({', '.join('?' * len(TERMINAL))})"
        args = [*changes.values(), run_id, *(sorted(TERMINAL) if guard else [])]
        with self._lock:
            self._db.execute(f"UPDATE runs SET {sets} WHERE id = ?{guard}", args)
        return self.get(run_id)

    def delete(self, run_id: str) -> bool:
        with self._lock:
            return self._db.execute("DELETE FROM runs WHERE id = ?", (run_id,)).rowcount > 0

    def count_by_status(self) -> dict[str, int]:
        with self._lock:
            rows = self._db.execute("SELECT status, COUNT(*) FROM runs GROUP BY status").fetchall()
        return {status: n for status, n in rows}
