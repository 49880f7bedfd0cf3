"""A learner's checkpoints in the run's storage (``cluster.storage``): uploaded after every
local save, fetched back by a resume on any node.

The local run directory stays the working copy; storage is the record. A stored
``state.json`` names a complete checkpoint: it is uploaded last, after every rank's shards.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

from storage import RunStorage, atomic_write


def upload_checkpoint(store: RunStorage, run_dir: Path, tag: str, rank: int) -> None:
    """This rank's part of checkpoint ``tag``: rank 0 the Hugging Face folder and the
    DeepSpeed folder it sees, every other rank its own ZeRO shards (written on its node)."""
    ds = run_dir / "ds_checkpoint" / tag
    if rank == 0:
        store.put_dir(run_dir / "checkpoints" / tag, f"checkpoints/{tag}")
        store.put_dir(ds, f"ds_checkpoint/{tag}")
        return
    for shard in sorted(ds.glob(f"*zero_pp_rank_{rank}_*")):
        store.put_file(shard, f"ds_checkpoint/{tag}/{shard.name}")


def commit_run_state(store: RunStorage, run_dir: Path) -> None:
    """The trained-groups log, then ``state.json``, which makes the checkpoint the one a
    resume continues from."""
    for name in ("trained_groups.jsonl", "state.json"):
        if (run_dir / name).exists():
            store.put_file(run_dir / name, name)


def fetch_checkpoint(store: RunStorage, run_dir: Path) -> dict[str, Any] | None:
    """The stored run's last checkpoint into ``run_dir`` (what a resume reads), its
    ``state.json`` rewritten to point at the local copy; None when storage holds none."""
    if not store.exists("state.json"):
        return None
    state = json.loads(store.read_text("state.json"))
    tag = state["ds_tag"]
    for key in (f"checkpoints/{tag}", f"ds_checkpoint/{tag}"):
        _get_dir_once(store, key, run_dir / key)
    if store.exists("trained_groups.jsonl"):
        atomic_write(run_dir / "trained_groups.jsonl", store.read_text("trained_groups.jsonl"))
    state["hf_path"] = str(run_dir / "checkpoints" / tag)
    atomic_write(run_dir / "state.json", json.dumps(state, indent=2))
    return state


def _get_dir_once(store: RunStorage, key: str, local: Path) -> None:
    """Download folder ``key`` unless ``local`` holds it; ranks on one node race here, so the
    copy lands under a temporary name and is renamed into place whole."""
    if local.exists():
        return
    tmp = local.with_name(f"{local.name}.part{os.getpid()}")
    store.get_dir(key, tmp)
    try:
        tmp.rename(local)
    except OSError:  # another rank on this node got there first
        shutil.rmtree(tmp, ignore_errors=True)
