"""Replay store on Redis: durable, staleness-aware, every group trained exactly once.

Key layout, one run (``P`` = ``{key_prefix}:{<run_id>}:``, e.g. ``turnrl:{run-7}:ready``)::

    P ready      LIST   group ids ready to claim, oldest at the head
    P ready_ver  ZSET   ready group id -> oldest policy version (finds stale groups in O(log n))
    P g:<id>     STRING a held group's record (replay/codec.py; zlib when compressed); held =
                        ready + claimed
    P gver       HASH   held group id -> oldest policy version (kept while claimed, for recover)
    P gbytes     HASH   held group id -> record bytes, uncompressed (what capacity_bytes counts)
    P claims     HASH   claim id -> JSON list of its group ids, until acknowledged
    P acked      HASH   claim id -> JSON [version, group ids, group versions]: trained, payloads
                        kept until a checkpoint covers the version (commit)
    P seen       SET    every group id ever accepted: refuses duplicates, also after training
    P live_ready LIST   live group ids ready to claim (unscheduled puts), oldest at the head
    P live_held  SET    live group ids held (ready or claimed): live_capacity_groups counts it
    P live       SET    live group ids until committed, so recover() requeues them as live
    P stats      HASH   version, accepted, live_accepted, running, trained, live_trained,
                        retained, bytes, claim_seq, scheduled_evicted (accepted groups
                        evicted untrained: the admission rule gives their places back)
    P refused    HASH   reason -> puts refused (full, live_full, stale, duplicate)
    P evicted    HASH   reason -> groups removed untrained (stale)
    P staleness  HASH   staleness at claim -> groups claimed
    P op:<id>    STRING one call's script reply, kept (with a TTL) for a re-sent command

Why lists and hashes rather than a Stream with a consumer group: a claim must take exactly B
groups or none, skip and count stale ones, and be requeued in order by ``recover()``; XREADGROUP
does none of that, and XAUTOCLAIM's idle-time redelivery would hand a slow learner's batch to a
second reader. Each operation is one Lua script, so reserve/put/claim/ack/recover are atomic
with respect to concurrent producers and the counters they update, and every key of a run sits
in one Redis Cluster slot (the braces are a hash tag).

Payloads (~0.5 MB) never pass through Lua, which would copy them twice: ``put`` SETs the bytes
under a fresh staging key (with a TTL) and runs the script in the same pipeline, and the script
RENAMEs the staging key to ``P g:<id>`` (and PERSISTs it) or UNLINKs it; ``claim`` returns ids
and the client MGETs them, each read off the socket straight into a buffer of its own
(replay/redis_reads.py).

The admission and staleness rules are those of ``replay.admission``, transcribed in ``_RULES``
because they must run inside the scripts to be atomic; tests/test_replay_redis.py checks the
transcription against the Python functions on a grid of inputs.

Delivery: a claim moves ids from ``ready`` to ``claims``; ``ack`` moves them to ``acked`` and
counts them trained; ``commit(v)`` unlinks the payloads of claims acknowledged at or before
``v`` (a checkpoint holds their update); ``recover(v)`` puts every unacknowledged claim, and
every claim acknowledged after ``v``, back at the head of ``ready`` in claim order. ``seen`` makes
a second put of one group id a counted duplicate, never a second copy.

Retries: the client re-sends a command after a dropped connection, a timeout or a restarting
server, with exponential backoff for up to ``replay.retry_s``. Each call carries an operation id
of its own, and the scripts (replay/redis_scripts.py) run at most once per id, so a re-sent
script whose first run's reply was lost returns that run's reply and changes nothing.
"""

from __future__ import annotations

import os
import re
import uuid
import zlib
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import redis
from redis.backoff import ExponentialBackoff, NoBackoff
from redis.retry import Retry

from replay.base import Claim, LiveShare, PutResult, ReplayStats, ReplayStore, check_live_share
from replay.config import ReplayConfig
from replay.record import GroupRecord, as_record
from replay.redis_reads import bulk_parser_kwargs
from replay.redis_scripts import KEY_NAMES, SCRIPTS
from replay.redis_server import RedisServer, ensure_embedded
from rollout.trajectory import Group

_RUN_ID = re.compile(r"^[A-Za-z0-9._-]+$")


class ReplayConnectionError(ConnectionError):
    """Redis is unreachable or refused our credentials."""


# -- helpers -------------------------------------------------------------------------------
def mask_url(url: str) -> str:
    """The URL with any password replaced by ``***`` (safe for logs and errors)."""
    parts = urlsplit(url)
    userinfo, at, hostport = parts.netloc.rpartition("@")
    if not at or ":" not in userinfo:
        return url
    return urlunsplit(parts._replace(netloc=f"{userinfo.partition(':')[0]}:***@{hostport}"))


def run_keys(key_prefix: str, run_id: str) -> list[str]:
    """The run's keys, in the order the scripts expect them as KEYS."""
    if not _RUN_ID.match(run_id):
        raise ValueError(f"run_id {run_id!r}: use only letters, digits, '.', '_' and '-' (it "
                         f"becomes the Redis key prefix {key_prefix}:{{run_id}}:)")
    return [f"{key_prefix}:{{{run_id}}}:{name}" for name in KEY_NAMES]


_BACKOFF_BASE_S, _BACKOFF_CAP_S = 0.05, 2.0


def retry_policy(cfg: ReplayConfig) -> Retry:
    """Exponential backoff (0.1 s, 0.2 s, ... capped at 2 s) whose sleeps add up to at least
    ``cfg.retry_s``, on connection errors and timeouts (a restarting server's LOADING reply is
    a ConnectionError too). Each attempt may add up to a connect or socket timeout."""
    retries, slept = 0, 0.0
    while slept < cfg.retry_s:
        retries += 1
        slept += min(_BACKOFF_CAP_S, _BACKOFF_BASE_S * 2**retries)
    return Retry(ExponentialBackoff(cap=_BACKOFF_CAP_S, base=_BACKOFF_BASE_S), retries,
                 supported_errors=(redis.exceptions.ConnectionError, redis.exceptions.TimeoutError))


def op_ttl_s(cfg: ReplayConfig) -> int:
    """How long a script's reply is kept for re-sent requests: longer than any retry lasts
    (every attempt may wait a connect and a socket timeout, plus the backoff sleeps)."""
    attempts = retry_policy(cfg).get_retries() + 1
    return int(cfg.retry_s + attempts * (cfg.connect_timeout_s + cfg.socket_timeout_s)) + 60


def connect(url: str, cfg: ReplayConfig) -> redis.Redis:
    """A client that answered PING, or ReplayConnectionError within ~connect_timeout_s; it
    then retries per ``retry_policy`` (a server that was never up fails fast, one that goes
    away mid-run is waited for)."""
    kwargs: dict[str, object] = {
        "socket_connect_timeout": cfg.connect_timeout_s,
        "socket_timeout": cfg.socket_timeout_s,
        "retry": Retry(NoBackoff(), 0),
    }
    if cfg.password_env:
        if cfg.password_env not in os.environ:
            raise ValueError(f"replay.password_env names ${cfg.password_env}, which is not set")
        kwargs["password"] = os.environ[cfg.password_env]
    try:
        kwargs |= bulk_parser_kwargs(url, kwargs)  # claims read payloads without copies
        client = redis.Redis.from_url(url, **kwargs)
        client.ping()
    except (redis.exceptions.RedisError, OSError, ValueError) as exc:
        raise ReplayConnectionError(
            f"replay: cannot use Redis at {mask_url(url)}: {type(exc).__name__}: {exc}. Check "
            "replay.url, replay.password_env and that the server is up"
        ) from None  # the chained exception may carry connection arguments
    _refuse_evicting_server(client, url)
    client.set_retry(retry_policy(cfg))
    return client


def _refuse_evicting_server(client: redis.Redis, url: str) -> None:
    """An ``allkeys-*`` maxmemory policy would drop held groups silently: refuse it."""
    try:
        reply = client.config_get("maxmemory-policy")
    except redis.exceptions.ResponseError:
        return  # CONFIG is disabled (managed Redis): nothing to check with
    policy = {(k.decode() if isinstance(k, bytes) else k): v for k, v in reply.items()}.get(
        "maxmemory-policy", "")
    policy = policy.decode() if isinstance(policy, bytes) else policy
    if policy.startswith("allkeys"):
        client.close()
        raise ReplayConnectionError(
            f"replay: Redis at {mask_url(url)} has maxmemory-policy {policy}, which may evict "
            "held groups without a trace: use noeviction (or a volatile-* policy) on it, or "
            "another Redis"
        )


def stored_payload(record: GroupRecord, compress: bool) -> bytes:
    """What the store writes for ``record``: its bytes, zlib level 1 when ``compress``.
    Capacity counts the uncompressed record either way, so a capacity means the same."""
    return zlib.compress(record.payload, 1) if compress else record.payload


def delete_run(client: redis.Redis, run_id: str, key_prefix: str = "turnrl") -> int:
    """Delete every key of one run (SCAN + UNLINK, never KEYS); returns keys deleted."""
    run_keys(key_prefix, run_id)  # validates run_id, so the pattern has no glob characters
    deleted = 0
    batch: list[bytes] = []
    for key in client.scan_iter(match=f"{key_prefix}:{{{run_id}}}:*", count=500):
        batch.append(key)
        if len(batch) >= 500:
            deleted += client.unlink(*batch)
            batch.clear()
    if batch:
        deleted += client.unlink(*batch)
    return deleted


# -- the store -----------------------------------------------------------------------------
class RedisReplayStore(ReplayStore):
    """Groups held in Redis; survives learner and (with persistence) redis-server crashes."""

    def __init__(self, cfg: ReplayConfig, batch_groups: int, *, run_dir: str | Path | None = None,
                 run_id: str = "default") -> None:
        self.cfg, self.batch_groups, self.run_id = cfg, batch_groups, run_id
        self.run_dir = Path(run_dir) if run_dir is not None else None
        self.keys = run_keys(cfg.key_prefix, run_id)
        self._gkey = self.keys[-1].encode()
        self._prefix = self.keys[-1][: -len("g:")]
        self.server: RedisServer | None = None
        """The embedded redis-server, when this store object started it (and will stop it)."""
        if cfg.url == "embedded" and self.run_dir is None:
            raise ValueError("replay.url 'embedded' keeps its data in the run directory: "
                             "pass run_dir, or set replay.url to redis://host:port")
        # An embedded server found alive may die before we connect (its host was just
        # killed): the second look finds it dead and starts it again on the same port.
        attempts = 2 if cfg.url == "embedded" else 1
        for attempt in range(attempts):
            self.url = self._resolve_url()
            try:
                self._r = connect(self.url, cfg)
                break
            except ReplayConnectionError:
                self.close()
                if attempt == attempts - 1:
                    raise
        self._scripts = {name: self._r.register_script(text) for name, text in SCRIPTS.items()}
        self._op_ttl = op_ttl_s(cfg)

    def _resolve_url(self) -> str:
        """``replay.url``, or the live embedded server's URL (starting it if none is)."""
        if self.cfg.url != "embedded":
            return self.cfg.url
        assert self.run_dir is not None
        url, self.server = ensure_embedded(self.run_dir, appendonly=self.cfg.appendonly,
                                           appendfsync=self.cfg.appendfsync, binary=self.cfg.server_binary)
        return url

    def __reduce__(self) -> tuple[object, ...]:
        # Another process (a Ray actor) reconnects; an embedded server stays with its starter.
        return (_reopen, (self.cfg, self.batch_groups, self.run_dir, self.run_id))

    def _op_key(self, op_id: str | None) -> str:
        """The key a script's reply is kept under: one fresh id per call, so redis-py's
        re-sent command (same id) is recognised and a new call (new id) is not."""
        return f"{self._prefix}op:{op_id or uuid.uuid4().hex}"

    def _run(self, name: str, *args: object, op_id: str | None = None) -> object:
        return self._scripts[name](keys=[*self.keys, self._op_key(op_id)],
                                   args=[*args, self._op_ttl])

    # -- producers -------------------------------------------------------------------------
    def reserve(self, n: int) -> int:
        if n < 0:
            raise ValueError(f"reserve(n={n}): n must be >= 0")
        return int(self._run("reserve", n, self.cfg.max_concurrent_groups, self.cfg.eta,
                             self.batch_groups))

    def release(self, n: int) -> None:
        self._run("release", n)

    def put(self, group: Group | GroupRecord, scheduled: bool = True, *,
            op_id: str | None = None) -> PutResult:
        return self._put_all([as_record(group)], scheduled, [op_id or uuid.uuid4().hex])[0]

    def put_many(self, groups: list[Group | GroupRecord], scheduled: bool = True) -> list[PutResult]:
        return self._put_all([as_record(g) for g in groups], scheduled,
                             [uuid.uuid4().hex for _ in groups])

    def _put_all(self, records: list[GroupRecord], scheduled: bool, op_ids: list[str]) -> list[PutResult]:
        """One pipeline for all ``records``: one round trip and (``appendfsync always``) as few
        fsyncs as a raw pipeline of the same bytes has. Each group keeps its own staging key,
        script run and operation id, so each is accepted or refused on its own.

        Not a MULTI/EXEC: Redis would queue every payload and write the whole batch to its
        append-only file only at EXEC, after the last byte arrived; outside a transaction it
        writes what has arrived while the rest is still on the wire (3-12% faster here,
        docs/replay.md). A staging key is unique to its operation, so nothing else can see it
        between its SET and its script, and it expires on its own (after the operation's TTL)
        if the script never runs (a producer killed between them)."""
        pipe = self._r.pipeline(transaction=False)
        for record, op_id in zip(records, op_ids):
            staged = f"{self._prefix}stage:{op_id}"
            keys = [*self.keys, self._op_key(op_id), staged]
            pipe.set(staged, stored_payload(record, self.cfg.compress), ex=self._op_ttl)
            # EVAL, not EVALSHA: a pipeline's NOSCRIPT reply would cost a second round trip.
            pipe.eval(SCRIPTS["put"], len(keys), *keys, record.group_id, record.nbytes, record.min_version,
                      self.cfg.capacity_groups, self.cfg.capacity_bytes, self.cfg.eta,
                      int(scheduled), self.cfg.live_capacity_groups, self._op_ttl)
        replies = pipe.execute()  # a re-sent pipeline re-runs it all: see "put"'s on_replay
        return [PutResult(status.decode(), detail.decode()) for status, detail in replies[1::2]]

    def live_room(self) -> int:
        k = dict(zip(KEY_NAMES, self.keys))
        pipe = self._r.pipeline(transaction=True)
        pipe.scard(k["live_held"])
        pipe.hlen(k["gver"])
        live_held, held = pipe.execute()
        return max(0, min(self.cfg.live_capacity_groups - live_held, self.cfg.capacity_groups - held))

    # -- learner ---------------------------------------------------------------------------
    def claim(self, num_groups: int, live: LiveShare | None = None) -> Claim | None:
        lo, hi = check_live_share(num_groups, live)
        got = self._run("claim", num_groups, self.cfg.eta, lo, hi)
        if got is None:
            return None
        claim_id, gids, ages = got
        # Claimed payloads stay until this claim is acknowledged, so reading after is safe.
        payloads = self._r.mget([self._gkey + gid for gid in gids])
        if any(p is None for p in payloads):
            raise RuntimeError(f"replay run {self.run_id!r}: claim {claim_id!r} lost payloads "
                               "(was the run deleted while training?)")
        return Claim(claim_id.decode(), payloads, [int(age) for age in ages])

    def ack(self, claim_id: str, new_version: int, commit: bool = False, *, op_id: str | None = None) -> None:
        """``op_id``: the caller's id for this acknowledgement (the replay host's, so a call Ray
        re-sends after the host restarted returns the first one's reply); None: a fresh one."""
        if self._run("ack", claim_id, int(new_version), int(commit), op_id=op_id) is None:
            raise KeyError(f"unknown or already acknowledged claim {claim_id!r}")

    def commit(self, version: int) -> int:
        return int(self._run("commit", int(version)))

    def recover(self, checkpoint_version: int | None = None) -> int:
        return int(self._run("recover", "" if checkpoint_version is None else int(checkpoint_version)))

    # -- reading ---------------------------------------------------------------------------
    def stats(self) -> ReplayStats:
        k = dict(zip(KEY_NAMES, self.keys))
        pipe = self._r.pipeline(transaction=True)  # one consistent snapshot
        for name in ("stats", "refused", "evicted", "staleness"):
            pipe.hgetall(k[name])
        pipe.llen(k["ready"])
        pipe.llen(k["live_ready"])
        pipe.scard(k["live_held"])
        pipe.hlen(k["gver"])
        counters, refused, evicted, hist, ready, live_ready, live_held, held = pipe.execute()
        c = {key.decode(): int(v) for key, v in counters.items()}
        return ReplayStats(
            version=c.get("version", 0), ready=ready + live_ready, claimed=held - ready - live_ready,
            running=c.get("running", 0), bytes=c.get("bytes", 0), accepted=c.get("accepted", 0),
            live_ready=live_ready, live_held=live_held, live_accepted=c.get("live_accepted", 0),
            live_trained=c.get("live_trained", 0),
            trained=c.get("trained", 0), retained=c.get("retained", 0),
            refused={key.decode(): int(v) for key, v in refused.items()},
            evicted={key.decode(): int(v) for key, v in evicted.items()},
            staleness_hist={int(key): int(v) for key, v in hist.items()},
        )

    def size(self) -> int:
        k = dict(zip(KEY_NAMES, self.keys))
        pipe = self._r.pipeline(transaction=False)
        pipe.llen(k["ready"])
        pipe.llen(k["live_ready"])
        return sum(int(n) for n in pipe.execute())

    def version(self) -> int:
        return int(self._r.hget(self.keys[KEY_NAMES.index("stats")], "version") or 0)

    # -- lifetime --------------------------------------------------------------------------
    def delete_run(self) -> int:
        """Delete all of this run's keys; returns keys deleted."""
        return delete_run(self._r, self.run_id, self.cfg.key_prefix)

    def close(self) -> None:
        client = getattr(self, "_r", None)
        if client is not None:
            client.close()
        if self.server is not None:  # only the process that started the embedded server
            self.server.stop()
            self.server = None


def _reopen(cfg: ReplayConfig, batch_groups: int, run_dir: Path | None, run_id: str
            ) -> RedisReplayStore:
    return RedisReplayStore(cfg, batch_groups, run_dir=run_dir, run_id=run_id)
