"""A learner built in the test process itself: it joins a process group of one and exports
MASTER_PORT, which later tests' learner subprocesses would inherit, already bound here."""

from __future__ import annotations

import os
from contextlib import contextmanager
from typing import Iterator

DIST_ENV = ("MASTER_ADDR", "MASTER_PORT", "RANK", "LOCAL_RANK", "WORLD_SIZE")


@contextmanager
def own_process_group() -> Iterator[None]:
    """Around in-process learners: afterwards the group is released (DeepSpeed's cached
    groups with it) and the distributed environment variables are as they were."""
    from learner.deepspeed_setup import leave_distributed

    saved = {k: os.environ.get(k) for k in DIST_ENV}
    try:
        yield
    finally:
        leave_distributed()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
