"""A learner's checkpoints: saved in the run directory (Hugging Face weights and tokenizer
under ``checkpoints/<tag>``; a LoRA run's adapter there instead, naming its base:
``learner/lora.py``), DeepSpeed's optimizer state and every rank's shards under
``ds_checkpoint/<tag>``, trajectory balance's log Z beside them), committed by ``state.json``,
uploaded to the run's storage (``cluster.storage``) after every local save and fetched back
by a resume on any node.

The local run directory stays the working copy; storage is the record. A ``state.json``
names a complete checkpoint: it is written (and uploaded) last, after every rank's shards.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch

from learner.deepspeed_setup import full_state_dict
from learner.lora import save_adapter
from storage import RunStorage, atomic_write


def checkpoint_tag(step: int) -> str:
    return f"step_{step:06d}"


def save_local(ds_engine: Any, tokenizer: Any, run_dir: Path, tag: str, rank: int,
               log_z: dict[str, Any] | None = None, lora_of: tuple[str, Any] | None = None) -> Path:
    """Checkpoint ``tag`` into ``run_dir`` (a collective: every rank calls it): rank 0 the
    Hugging Face weights and tokenizer, every rank its DeepSpeed shards, rank 0 ``log_z``
    (trajectory balance's table, optimiser and task codes; None: no such loss). ``lora_of``
    = (base, ``LoRAConfig``) of a LoRA run, whose folder holds the adapter and names the base
    instead of whole weights (``learner/lora.py``). Returns the Hugging Face folder."""
    path = run_dir / "checkpoints" / tag
    weights = full_state_dict(ds_engine, gather_to_all=False)
    if rank == 0:
        path.mkdir(parents=True, exist_ok=True)
        if lora_of is None:
            ds_engine.module.save_pretrained(path, state_dict=weights)
        else:
            save_adapter(ds_engine.module, weights, path, *lora_of)
        tokenizer.save_pretrained(path)
    # a LoRA run's frozen base is the policy it names: its DeepSpeed state is the adapter alone
    ds_engine.save_checkpoint(str(run_dir / "ds_checkpoint"), tag=tag, exclude_frozen_parameters=lora_of is not None)
    if rank == 0 and log_z is not None:
        torch.save(log_z, log_z_path(run_dir, tag))
    return path


def write_state(run_dir: Path, store: RunStorage | None, state: dict[str, Any]) -> None:
    """Commit a saved checkpoint (rank 0, after every rank's shards are saved and stored):
    ``state.json``, then the trained-groups log and it into storage."""
    atomic_write(run_dir / "state.json", json.dumps(state, indent=2))
    if store is not None:
        commit_run_state(store, run_dir)


def resume_state(store: RunStorage | None, run_dir: Path) -> dict[str, Any] | None:
    """The committed ``state.json`` a resume continues from (fetched from storage first, which
    is the record: this node may have none); None when there is no checkpoint."""
    if store is not None:
        fetch_checkpoint(store, run_dir)
    path = run_dir / "state.json"
    return json.loads(path.read_text()) if path.exists() else None


def log_z_path(run_dir: Path, tag: str) -> Path:
    """Trajectory balance's log Z table, beside the DeepSpeed checkpoint of ``tag``."""
    return run_dir / "ds_checkpoint" / tag / "log_z.pt"


def load_log_z(run_dir: Path, tag: str, log_z: torch.nn.Module, opt: torch.optim.Optimizer,
               device: torch.device) -> dict[str, int]:
    """Restore log Z's table and optimiser from checkpoint ``tag``; returns its task codes."""
    saved = torch.load(log_z_path(run_dir, tag), map_location=device)
    log_z.load_state_dict(saved["table"])
    opt.load_state_dict(saved["opt"])
    return dict(saved["task_codes"])


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
