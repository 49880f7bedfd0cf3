"""A run's folder in storage, and node-local copies of stored folders."""

from __future__ import annotations

import hashlib
import os
import shutil
import time
from pathlib import Path

NODE_CACHE_ENV = "TURNRL_NODE_CACHE"
"""Where a node keeps its copies of stored folders (default ``~/.cache/turnrl/storage``)."""


def is_storage_url(ref: str) -> bool:
    """``ref`` names a folder in storage (``scheme://...``), not a local path or hub id; the
    rule is ``storage.places``'s (a ``scheme://`` at the start, not anywhere in the value)."""
    from storage.places import split_url

    return split_url(str(ref)) is not None


class RunStorage:
    """``<url>``: files and folders under one storage prefix, through fsspec."""

    def __init__(self, url: str) -> None:
        import fsspec

        self.url = url.rstrip("/")
        self.fs, self.root = fsspec.core.url_to_fs(self.url)

    def child(self, key: str) -> "RunStorage":
        return RunStorage(f"{self.url}/{key}")

    def path(self, key: str) -> str:
        return f"{self.root}/{key}" if key else self.root

    def exists(self, key: str = "") -> bool:
        return self.fs.exists(self.path(key))

    def put_file(self, local: str | Path, key: str) -> None:
        """Upload one file; whole-object PUT on object stores, so readers never see half."""
        parent = self.path(key).rsplit("/", 1)[0]
        self.fs.makedirs(parent, exist_ok=True)
        self.fs.put_file(str(local), self.path(key))

    def put_dir(self, local: str | Path, key: str) -> None:
        for file in sorted(Path(local).rglob("*")):
            if file.is_file():
                self.put_file(file, f"{key}/{file.relative_to(local).as_posix()}")

    def get_file(self, key: str, local: str | Path) -> Path:
        Path(local).parent.mkdir(parents=True, exist_ok=True)
        self.fs.get_file(self.path(key), str(local))
        return Path(local)

    def get_dir(self, key: str, local: str | Path) -> Path:
        """Download folder ``key`` into ``local`` (created; files there are overwritten)."""
        base = self.path(key).rstrip("/")
        for remote in self.fs.find(base):
            target = Path(local) / remote[len(base) + 1:]
            target.parent.mkdir(parents=True, exist_ok=True)
            self.fs.get_file(remote, str(target))
        return Path(local)

    def read_text(self, key: str) -> str:
        with self.fs.open(self.path(key), "r") as fh:
            return fh.read()

    def write_text(self, key: str, text: str) -> None:
        self.fs.makedirs(self.path(key).rsplit("/", 1)[0], exist_ok=True)
        with self.fs.open(self.path(key), "w") as fh:
            fh.write(text)


def node_copy(ref: str) -> str:
    """A local path for ``ref``: a stored folder (``scheme://...``) is downloaded once per node
    into the node cache (a marker file says the copy is complete); anything else (a local
    path, a hub id) is returned as it is."""
    if not is_storage_url(ref):
        return ref
    cache = Path(os.environ.get(NODE_CACHE_ENV) or Path.home() / ".cache" / "turnrl" / "storage")
    local = cache / hashlib.sha1(ref.encode()).hexdigest()[:16]
    if (local / ".complete").exists():
        return str(local)
    tmp = local.with_name(f"{local.name}.tmp{os.getpid()}-{time.time_ns()}")
    try:
        RunStorage(ref).get_dir("", tmp)
        (tmp / ".complete").write_text(ref)
        try:
            tmp.rename(local)
        except OSError:  # another process on this node finished the same copy first
            pass
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return str(local)


def upload_policy(local: str | Path, storage_url: str) -> str:
    """The policy folder's URL under ``<storage>/policies/``, uploaded unless already there.
    Keyed by the folder's name and a digest of its files' names, sizes and times, so a
    changed folder never reuses a stale copy."""
    local = Path(local)
    files = sorted(p for p in local.rglob("*") if p.is_file())
    digest = hashlib.sha1("".join(f"{p.relative_to(local)}:{p.stat().st_size}:{p.stat().st_mtime_ns};"
                                  for p in files).encode()).hexdigest()[:12]
    key = f"policies/{local.name}-{digest}"
    store = RunStorage(storage_url)
    if not store.exists(f"{key}/.uploaded"):
        store.put_dir(local, key)
        store.write_text(f"{key}/.uploaded", str(local))
    return f"{store.url}/{key}"
