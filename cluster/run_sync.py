"""The driver's side of ``cluster.storage``: the policy folder uploaded once, the run's own
files mirrored to ``<storage>/runs/<name>/`` as they change, and pulled back by ``--resume``
on whatever node the driver restarts on. Checkpoints are the learner's to upload
(``learner/worker.py``); without a storage URI every method here does nothing.
"""

from __future__ import annotations

from pathlib import Path

from cluster.config import RunConfig
from storage import RunStorage, upload_policy

RESUME_FILES = ("run.json", "config.json", "state.json", "metrics.jsonl", "eval_before.json")
"""What a resumed driver reads from its run directory (the learner fetches its checkpoint)."""


class RunSync:
    def __init__(self, cfg: RunConfig, run_dir: Path) -> None:
        self.storage = cfg.cluster.storage
        self.run_dir = run_dir
        self.store = RunStorage(f"{self.storage}/runs/{cfg.name}") if self.storage else None

    @property
    def url(self) -> str | None:
        """Where the learner uploads checkpoints and run state (None: the run directory)."""
        return self.store.url if self.store else None

    def policy(self, local: str | Path) -> str:
        """What actors load the policy from: its stored copy when there is storage."""
        if self.storage and Path(local).is_dir():
            return upload_policy(local, self.storage)
        return str(local)

    def push(self, *names: str) -> None:
        """Mirror these run files (those that exist) to storage."""
        if self.store is None:
            return
        for name in names:
            if (self.run_dir / name).exists():
                self.store.put_file(self.run_dir / name, name)

    def pull_for_resume(self) -> None:
        """Bring the stored run's files into the (possibly new, empty) run directory."""
        if self.store is None:
            return
        for name in RESUME_FILES:
            if self.store.exists(name):
                self.store.get_file(name, self.run_dir / name)

    def forget(self, names: tuple[str, ...]) -> None:
        """Remove an earlier run's state from storage (a fresh start in a used name), so a
        later ``--resume`` cannot pick up its checkpoint."""
        if self.store is None:
            return
        for name in names:
            if self.store.exists(name):
                self.store.fs.rm(self.store.path(name))
