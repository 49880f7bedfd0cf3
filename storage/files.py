"""Writing one local file or folder so that no reader ever sees half of it."""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path


def atomic_write(path: Path, text: str) -> None:
    """Readers (a resume, a rank on the same node) see the old file or the new, never half."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)


def atomic_folder(final: Path, build: Callable[[Path], None], done: Callable[[], bool] = lambda: False) -> Path:
    """``final``, filled by ``build(tmp)`` in a new temporary folder beside it and renamed into
    place whole (replacing an older one). ``done()`` true after the build: a complete one
    another process finished meanwhile is kept (two test workers sharing a cache; replacing it
    would pull the folder from under the runs already reading it)."""
    tmp = final.with_name(f"{final.name}.tmp{time.time_ns()}")
    tmp.mkdir(parents=True)
    try:
        build(tmp)
        if done():
            return final
        if final.exists():
            shutil.rmtree(final)
        tmp.rename(final)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final
