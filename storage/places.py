"""What a config value that names a model or data place means: the one rule for the run
service's admission and for the runtime that loads it.

A value is one of
- ``url``: ``scheme://netloc/path`` with a scheme other than ``file``, read through fsspec
  (``storage.node_copy``); a host that is loopback or link-local (``localhost``,
  ``127.0.0.0/8``, ``::1``, ``169.254.0.0/16``, ``fe80::/10``: cloud metadata lives there) is
  never allowed;
- ``path``: a local path, ``file://`` URLs included (``file:///abs`` or ``file://localhost/abs``
  mean exactly the path ``/abs``), resolved against a base directory (``..`` and symlinks
  resolved);
- ``hub``: a Hugging Face hub id (``name`` or ``org/name``) that is no existing path.

The runtime (``local_model``) loads a path only if it exists, so ``from_pretrained`` never
takes a missing path for a hub id; it asks the hub only for a value that is hub-shaped and
names no local path. Admission (``services.admission``) classifies with the same function,
allows a hub id only from the operator's list, a URL only under the operator's
``storage_urls``, a path only under its roots and only when it exists, and hands the runtime
the resolved path (so what the runtime sees is never a hub id by accident).
"""

from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Literal
from urllib.parse import SplitResult, unquote, urlsplit

HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*(/[A-Za-z0-9][A-Za-z0-9._-]*)?$")
"""``name`` or ``org/name`` as the hub spells them (no ``..``, no leading dot or slash)."""
_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")


class PlaceError(ValueError):
    """A value that names no place the rule allows (a forbidden host, a malformed URL, a
    missing path that cannot be a hub id)."""


@dataclass(frozen=True)
class Place:
    kind: Literal["url", "path", "hub"]
    value: str
    """The value as written."""
    path: Path | None = None
    """``path``: absolute, ``..`` and symlinks resolved."""
    url: SplitResult | None = None
    """``url``: the split URL (scheme lower-cased)."""


def forbidden_host(host: str) -> str | None:
    """Why ``host`` may never be reached (loopback, link-local, unspecified), or None."""
    name = host.strip("[]").rstrip(".").lower()
    if name == "localhost" or name.endswith(".localhost"):
        return "a loopback host"
    try:
        ip = ipaddress.ip_address(name.split("%", 1)[0])
    except ValueError:
        return None  # a name: allowed only where the operator lists it
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    if ip.is_loopback:
        return "a loopback address"
    if ip.is_link_local:
        return "a link-local address (cloud metadata services answer there)"
    if ip.is_unspecified:
        return "the unspecified address"
    return None


def split_url(value: str) -> SplitResult | None:
    """The URL ``value`` names (scheme lower-cased), or None when it is no ``scheme://`` URL."""
    if not _SCHEME.match(value):
        return None
    try:
        parts = urlsplit(value)
        parts.port  # noqa: B018 - raises on a port that is no number
    except ValueError as exc:
        raise PlaceError(f"{value!r} is not a valid URL: {exc}") from None
    return parts._replace(scheme=parts.scheme.lower())


def _file_path(value: str, parts: SplitResult) -> str:
    if parts.netloc not in ("", "localhost") or parts.query or parts.fragment:
        raise PlaceError(f"{value!r}: a file:// URL names a local path (file:///abs/path); it takes no "
                         "host, query or fragment")
    return unquote(parts.path)


def _resolve(value: str, base: Path) -> Path:
    try:
        return (base / Path(value).expanduser()).resolve()  # an absolute value replaces base
    except (ValueError, OSError, RuntimeError):  # NUL byte, symlink loop
        raise PlaceError(f"{value!r} is not a valid path") from None


def exists(path: Path) -> bool:
    """``path.exists()``, False for a name the OS refuses (too long) rather than an error."""
    try:
        return path.exists()
    except OSError:
        return False


def classify(value: str, base: Path | None = None) -> Place:
    """What ``value`` names; relative paths resolve from ``base`` (the working directory when
    None). Raises PlaceError for a forbidden host or a malformed URL."""
    base = Path.cwd() if base is None else base
    parts = split_url(value)
    if parts is not None and parts.scheme != "file":
        why = forbidden_host(parts.hostname or "") if parts.hostname else None
        if why:
            raise PlaceError(f"{value!r} names {why}; such hosts are never allowed")
        return Place("url", value, url=parts)
    raw = _file_path(value, parts) if parts is not None else value
    path = _resolve(raw, base)
    if parts is None and not exists(path) and HUB_ID.match(value) and not value.startswith("."):
        return Place("hub", value)
    return Place("path", value, path=path)


def under_prefix(parts: SplitResult, prefix: str) -> bool:
    """``parts`` is ``prefix`` or inside it: same scheme and netloc (host or bucket), and its
    path starts with the prefix's path at a ``/`` boundary; ``..`` and ``.`` segments never match."""
    want = urlsplit(prefix)
    if (parts.scheme, parts.netloc.lower()) != (want.scheme.lower(), want.netloc.lower()):
        return False
    segments = [s for s in unquote(parts.path).split("/") if s]
    if any(s in (".", "..") for s in segments) or parts.query or parts.fragment:
        return False
    root = [s for s in unquote(want.path).split("/") if s]
    return segments[:len(root)] == root


def check_prefix(prefix: str) -> None:
    """An operator's ``storage_urls`` entry: ``scheme://host-or-bucket[/path]``, not ``file``
    (paths are listed as roots), never a loopback or link-local host."""
    parts = split_url(prefix)
    if parts is None or not parts.netloc:
        raise PlaceError(f"{prefix!r}: expected scheme://host-or-bucket[/path]")
    if parts.scheme == "file":
        raise PlaceError(f"{prefix!r}: file:// URLs are checked as paths; list the directory in the roots")
    why = forbidden_host(parts.hostname or "")
    if why:
        raise PlaceError(f"{prefix!r} names {why}; such hosts are never allowed")


def model_ref(value: str | Path, field: str = "model path") -> str:
    """``value`` checked for loading anywhere: a URL as it is (each node copies it with
    ``node_copy``), a path resolved and only when it exists (a missing one raises
    FileNotFoundError naming ``field`` instead of becoming a hub lookup), a hub id as it is."""
    place = classify(str(value))
    if place.kind != "path":
        return place.value
    if not exists(place.path):
        raise FileNotFoundError(f"{field}: {str(value)!r} does not exist (resolved to {place.path}); a path is "
                                "never looked up on the Hugging Face hub")
    return str(place.path)


def local_dir(value: str | Path, field: str, base: Path | None = None) -> Path:
    """The local directory a write field (an output or cache folder) names, absolute, by the
    same rule as read fields: a ``file://`` URL is its path, a relative path resolves from
    ``base``; any other URL is refused naming ``field`` (runs write these folders on their
    node's disk; ``cluster.storage`` is where a run's files go to remote storage), so a URL
    never becomes a folder named after it."""
    base = Path.cwd() if base is None else base
    place = classify(str(value), base)
    if place.kind == "url":
        raise PlaceError(f"{field}: {str(value)!r} is a URL, but runs write {field} to a local directory; "
                         "give a path (cluster.storage puts a run's files in remote storage)")
    return place.path if place.path is not None else _resolve(str(value), base)  # a hub-shaped name: a folder


def local_model(value: str | Path, field: str = "model path") -> str:
    """What to hand ``from_pretrained`` on this node: ``model_ref``, with a URL replaced by this
    node's copy of the folder."""
    from storage.folders import node_copy

    ref = model_ref(value, field)
    return node_copy(ref) if split_url(ref) is not None else ref
