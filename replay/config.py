"""Replay store configuration (pydantic only)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class ReplayConfig(BaseModel):
    """Where groups wait between the reward stage and the learner."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    type: Literal["inproc", "redis"] = "inproc"
    """Backend: ``inproc`` (in a Ray actor, the embedded default) or ``redis``."""
    url: str = "embedded"
    """Redis only: ``redis://[:password@]host:port/db``, or ``embedded`` to start a local
    redis-server with its data in the run directory."""
    eta: int = Field(1, ge=0)
    """Staleness bound: no group more than ``eta`` weight versions older than the learner is
    trained on, and generation is admitted only so far ahead (AReaL's rule)."""
    capacity_groups: int = Field(64, ge=1)
    """Most groups held (ready plus claimed but not yet acknowledged)."""
    capacity_bytes: int = Field(512 * 2**20, ge=1024)
    """Most bytes held, counted as each group's binary replay record (replay/codec.py,
    uncompressed; about half its JSON size), the same in both backends."""
    on_full: Literal["wait", "error"] = "wait"
    """When full, producers wait (up to ``put_timeout_s``) or get an error at once."""
    put_timeout_s: float = Field(300.0, gt=0)
    """Longest a producer waits for room before failing with ReplayFullError."""
    max_concurrent_groups: int = Field(64, ge=1)
    """Most groups being generated at once across all rollout actors (admission rule)."""
    live_capacity_groups: int = Field(16, ge=1)
    """Most live groups (served sessions, put unscheduled) held at once, within
    ``capacity_groups``. A live put never waits: past this bound it is refused as
    ``live_full`` and counted, so a burst of traffic never blocks serving or crowds out the
    rollouts' groups."""

    # -- Redis backend (ignored by ``inproc``) -----------------------------------------------
    password_env: str | None = None
    """Redis only: name of an environment variable holding the password, so it never has to be
    written into a config file; overrides a password in ``url``. Not used by ``embedded``."""
    key_prefix: str = Field("turnrl", pattern=r"^[A-Za-z0-9._-]+$")
    """Redis only: keys are ``{key_prefix}:{<run_id>}:<name>``; runs sharing one Redis never see
    each other's keys."""
    connect_timeout_s: float = Field(2.0, gt=0)
    """Redis only: an unreachable server fails the run after this long, naming the URL."""
    socket_timeout_s: float = Field(30.0, gt=0)
    """Redis only: longest wait for one reply (a claim carries whole groups)."""
    retry_s: float = Field(30.0, ge=0)
    """Redis only: after a dropped connection, a timeout or a restarting server, a command is
    re-sent with exponential backoff (0.1 s doubling to 2 s) for about this long before the run
    fails; 0 never re-sends. Safe for every operation: each call carries its own id and the
    store's scripts run at most once per id, so a re-sent command whose reply was lost returns
    that reply instead of running again. A server that cannot be reached at start-up still
    fails within ``connect_timeout_s``."""
    compress: bool = False
    """Redis only: zlib-compress (level 1) group payloads. Saves only ~15 % on the binary
    record of random token ids (packed numbers compress poorly) for 6-10x the encoding time;
    worth it on a remote Redis over a slow link at most, not on the embedded loopback one
    (see docs/replay.md)."""
    appendonly: bool = True
    """Embedded only: append-only file persistence, so held groups, claims and counters survive
    a redis-server crash. A remote server's persistence is its operator's setting."""
    appendfsync: Literal["always", "everysec", "no"] = "always"
    """Embedded only: ``always`` fsyncs before every reply, so nothing acknowledged is ever
    lost (about 10 % off the store's throughput, far above what rollouts produce);
    ``everysec`` can lose the last 1-2 s of acknowledged writes on a crash, i.e. groups lost or
    trained twice (see docs/replay.md); ``no`` leaves flushing to the OS."""
    server_binary: str = "redis-server"
    """Embedded only: the redis-server executable, a name looked up on PATH or a path."""
