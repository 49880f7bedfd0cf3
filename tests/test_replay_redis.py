"""Redis replay store beyond the shared contract: rules transcription, embedded server, runs
sharing one Redis, connection failures, concurrency, and a crash test with SIGKILL.

Tests talk to a real redis-server on a free loopback port (see tests/redis_fixture.py) and skip
when it is not installed, except those about failing without one.
"""

from __future__ import annotations

import json
import os
import pickle
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Callable

import pytest
import redis
from redis_fixture import (  # noqa: F401 (redis_server is a fixture)
    ROOT,
    ReplyDroppingProxy,
    make_group,
    new_run_id,
    redis_server,
    requires_redis,
)

from replay.admission import admission_capacity, is_stale, staleness
from replay.record import GroupRecord
from replay.config import ReplayConfig
from replay.redis_server import RedisServer, free_port
from replay.redis_scripts import RULES as _RULES
from replay.redis_store import RedisReplayStore, ReplayConnectionError
from replay.registry import make_store
from rollout.trajectory import Group

def open_store(url: str, run_id: str | None = None, batch_groups: int = 2,
               **cfg: object) -> RedisReplayStore:
    return RedisReplayStore(ReplayConfig(type="redis", url=url, **cfg), batch_groups,
                            run_id=run_id or new_run_id())


# -- the Lua transcription of replay/admission.py ----------------------------------------
def test_lua_rules_match_admission_py(redis_server: RedisServer) -> None:
    grid = [(m, r, e, v, b, a, d) for m in range(4) for r in range(5) for e in range(3)
            for v in range(4) for b in range(1, 4) for a in range(0, 14, 3) for d in (0, 2)]
    script = _RULES + """
local out = {}
for i = 1, #ARGV, 7 do
  local m, r, e, v, b, a, d = tonumber(ARGV[i]), tonumber(ARGV[i+1]), tonumber(ARGV[i+2]),
    tonumber(ARGV[i+3]), tonumber(ARGV[i+4]), tonumber(ARGV[i+5]), tonumber(ARGV[i+6])
  out[#out + 1] = admission_capacity(m, r, e, v, b, a, d)
  out[#out + 1] = staleness(v, a)             -- reuse the grid: a as a group version
  out[#out + 1] = is_stale(v, a, e) and 1 or 0
end
return out
"""
    client = redis.Redis.from_url(redis_server.url)
    got = client.eval(script, 0, *[x for row in grid for x in row])
    want = []
    for m, r, e, v, b, a, d in grid:
        want += [admission_capacity(max_concurrent=m, running=r, eta=e, version=v,
                                    batch_groups=b, accepted=a, evicted=d),
                 staleness(v, a), int(is_stale(v, a, e))]
    assert got == want


# -- embedded server ----------------------------------------------------------------------
@requires_redis
def test_embedded_starts_is_shared_and_stopped_by_its_starter(tmp_path: Path) -> None:
    cfg = ReplayConfig(type="redis", url="embedded", appendfsync="always")
    owner = make_store(cfg, 2, tmp_path, "run-a")
    # Another process of the run (here: a pickled copy) finds it instead of starting one.
    other = pickle.loads(pickle.dumps(owner))
    try:
        assert owner.server is not None and (tmp_path / "redis" / "appendonlydir").is_dir()
        assert other.server is None and other.url == owner.url
        owner.put(make_group("a"))
        assert other.size() == 1
        other.close()
        assert owner.size() == 1  # a non-owner's close leaves the server up
        pid = owner.server.pid
    finally:
        other.close()
        owner.close()
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)


@requires_redis
def test_embedded_restarts_a_dead_server_on_its_data(tmp_path: Path) -> None:
    cfg = ReplayConfig(type="redis", url="embedded", appendfsync="always")
    first = RedisReplayStore(cfg, 2, run_dir=tmp_path, run_id="r")
    first.put(make_group("a"))
    dead_pid = first.server.pid
    first.server.kill()  # SIGKILL: only the append-only file is left
    second = RedisReplayStore(cfg, 2, run_dir=tmp_path, run_id="r")
    try:
        assert second.server is not None and second.server.pid != dead_pid
        assert second.url == first.url  # the same port: clients holding the URL reconnect
        assert second.stats().accepted == 1 and second.claim(1).groups[0].group_id == "a"
    finally:
        first.close()
        second.close()


@requires_redis
def test_embedded_server_killed_mid_run_is_restarted_and_calls_go_through(tmp_path: Path) -> None:
    """kill -9 of the embedded redis-server: its starter starts it again on the same port from
    its append-only file, and a call made meanwhile (from another client of the run) waits for
    it instead of failing; nothing acknowledged is lost."""
    cfg = ReplayConfig(type="redis", url="embedded", appendfsync="always")
    owner = RedisReplayStore(cfg, 2, run_dir=tmp_path, run_id="r")
    other = pickle.loads(pickle.dumps(owner))
    try:
        owner.put(make_group("a"))
        claim = other.claim(1)
        dead_pid = owner.server.pid
        os.kill(dead_pid, signal.SIGKILL)
        assert other.put(make_group("b")).accepted
        other.ack(claim.claim_id, 1)
        # server.json is rewritten just after the new server answers (clients may get there first)
        server_json = tmp_path / "redis" / "server.json"
        _wait_for(lambda: json.loads(server_json.read_text())["pid"] != dead_pid, "server.json", 10)
        recorded = json.loads(server_json.read_text())
        assert owner.server.restarts == 1 and recorded == {"pid": owner.server.pid, "url": owner.url}
        s = owner.stats()
        assert (s.accepted, s.trained, s.ready) == (2, 1, 1)
    finally:
        other.close()
        owner.close()
    assert owner.server is None


def test_embedded_without_binary_names_the_apt_package(tmp_path: Path) -> None:
    cfg = ReplayConfig(type="redis", url="embedded", server_binary="/nonexistent/redis-server")
    with pytest.raises(RuntimeError, match=r"apt-get install redis-server"):
        RedisReplayStore(cfg, 2, run_dir=tmp_path, run_id="r")


# -- runs sharing one Redis ---------------------------------------------------------------
def test_runs_are_isolated_and_delete_run_removes_only_its_keys(redis_server: RedisServer) -> None:
    a, b = open_store(redis_server.url), open_store(redis_server.url)
    a.put(make_group("same-id"))
    assert b.put(make_group("same-id")).accepted  # not a duplicate: another run
    a.put(make_group("only-a"))
    a.claim(1)
    assert (a.stats().accepted, b.stats().accepted) == (2, 1)
    client = redis.Redis.from_url(redis_server.url)
    a_keys = list(client.scan_iter(match=f"turnrl:{{{a.run_id}}}:*"))
    assert len(a_keys) >= 8 and all(k.startswith(b"turnrl:{t") for k in a_keys)
    assert a.delete_run() == len(a_keys)
    assert not list(client.scan_iter(match=f"turnrl:{{{a.run_id}}}:*"))
    assert a.stats().accepted == 0 and b.stats().accepted == 1 and b.size() == 1


def test_run_id_with_glob_characters_is_refused(redis_server: RedisServer) -> None:
    with pytest.raises(ValueError, match="letters, digits"):
        open_store(redis_server.url, run_id="run*")


# -- connection failures ------------------------------------------------------------------
@requires_redis
def test_wrong_password_fails_fast_with_masked_url(tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    with RedisServer(tmp_path, password="right-pw") as server:
        wrong = server.url.replace("right-pw", "wrong-pw")
        start = time.monotonic()
        with pytest.raises(ReplayConnectionError) as err:
            open_store(wrong)
        assert time.monotonic() - start < 3
        assert f"redis://:***@127.0.0.1:{server.port}/0" in str(err.value)
        assert "wrong-pw" not in str(err.value)
        # The password from an environment variable, never written in the config:
        monkeypatch.setenv("TEST_REPLAY_PW", "right-pw")
        store = open_store(f"redis://127.0.0.1:{server.port}/0", password_env="TEST_REPLAY_PW")
        assert store.put(make_group("a")).accepted
        store.close()


@requires_redis
def test_server_that_may_evict_our_keys_is_refused(tmp_path: Path) -> None:
    with RedisServer(tmp_path) as server:
        redis.Redis.from_url(server.url).config_set("maxmemory-policy", "allkeys-lru")
        with pytest.raises(ReplayConnectionError, match="maxmemory-policy allkeys-lru"):
            open_store(server.url)


def test_unreachable_server_fails_within_the_connect_timeout() -> None:
    url = f"redis://:pw@127.0.0.1:{free_port()}/0"  # nothing listens there
    start = time.monotonic()
    with pytest.raises(ReplayConnectionError, match=r"redis://:\*\*\*@127\.0\.0\.1"):
        open_store(url)
    assert time.monotonic() - start < 3


# -- payloads and atomicity ---------------------------------------------------------------
def test_compressed_payloads_are_read_by_any_store(redis_server: RedisServer) -> None:
    run = new_run_id()
    writer = open_store(redis_server.url, run, compress=True)
    reader = open_store(redis_server.url, run, compress=False)
    group = make_group("z", tokens=500)
    writer.put(group)
    assert reader.claim(1).groups == [group]
    assert reader.stats().bytes == GroupRecord.of(group).nbytes  # the uncompressed record, not zlib


@pytest.mark.parametrize("compress", [False, True])
def test_groups_held_as_json_by_an_older_build_are_still_claimed(redis_server: RedisServer,
                                                                 compress: bool) -> None:
    """An upgrade with groups in Redis: payloads the JSON-writing store left behind decode."""
    def old_record(group: Group) -> GroupRecord:  # the store wrote the group's JSON then
        return GroupRecord(group.group_id, group.min_version(), None, group.model_dump_json().encode())

    run = new_run_id()
    old = open_store(redis_server.url, run, compress=compress)
    assert old.put(old_record(make_group("old", tokens=300))).accepted
    assert old.put(make_group("new", tokens=300)).accepted  # this build's binary record
    claim = open_store(redis_server.url, run).claim(2)
    assert claim.groups == [make_group("old", tokens=300), make_group("new", tokens=300)]


def test_concurrent_producers_and_learner_agree(redis_server: RedisServer) -> None:
    """4 producer threads (own connections) put overlapping ids while a learner claims/acks."""
    run, n_ids = new_run_id(), 120
    trained: list[str] = []
    done = threading.Event()

    def produce(offset: int) -> None:
        store = open_store(redis_server.url, run, capacity_groups=20)
        for i in range(n_ids):
            group = make_group(f"g{(i + offset) % n_ids}")
            while store.put(group).status == "full":
                time.sleep(0.001)

    def learn() -> None:
        store = open_store(redis_server.url, run)
        while not (done.is_set() and store.size() == 0):
            claim = store.claim(1)
            if claim is None:
                time.sleep(0.001)
                continue
            trained.extend(g.group_id for g in claim.groups)
            store.ack(claim.claim_id, new_version=0)
            store.commit(0)  # as a learner that checkpoints every step

    producers = [threading.Thread(target=produce, args=(k * 30,)) for k in range(4)]
    learner = threading.Thread(target=learn)
    for t in [*producers, learner]:
        t.start()
    for t in producers:
        t.join(30)
    done.set()
    learner.join(30)
    s = open_store(redis_server.url, run).stats()
    assert sorted(trained) == sorted(f"g{i}" for i in range(n_ids))  # each id once
    assert (s.accepted, s.trained, s.refused.get("duplicate")) == (n_ids, n_ids, 3 * n_ids)
    assert (s.ready, s.claimed, s.bytes) == (0, 0, 0)
    client = redis.Redis.from_url(redis_server.url)  # refused puts left no staged payload behind
    assert list(client.scan_iter(match=f"turnrl:{{{run}}}:*")) != []
    assert list(client.scan_iter(match=f"turnrl:{{{run}}}:stage:*")) == []
    assert list(client.scan_iter(match=f"turnrl:{{{run}}}:g:*")) == []


def test_a_put_payload_is_kept_without_expiry_and_its_staging_key_is_gone(
        redis_server: RedisServer) -> None:
    """put SETs its payload under a staging key with a TTL (so a producer killed before its
    script runs leaves nothing for good) and the script renames it: the held payload must
    have lost that TTL, or Redis would drop a group before the learner trained it."""
    run = new_run_id()
    store, client = open_store(redis_server.url, run), redis.Redis.from_url(redis_server.url)
    assert [r.status for r in store.put_many([make_group("a"), make_group("b")])] == ["accepted"] * 2
    assert client.ttl(f"turnrl:{{{run}}}:g:a") == -1 and client.ttl(f"turnrl:{{{run}}}:g:b") == -1
    assert list(client.scan_iter(match=f"turnrl:{{{run}}}:stage:*")) == []
    watcher = redis.Redis.from_url(redis_server.url, socket_timeout=10)
    with watcher.monitor() as monitor:  # what the server was sent for the next put
        store.put(make_group("c"))
        while not (cmd := monitor.next_command()["command"]).startswith("SET turnrl:"):
            pass
    assert cmd.split()[1].startswith(f"turnrl:{{{run}}}:stage:")
    assert cmd.split()[-2:] == ["EX", str(store._op_ttl)]  # so a staging key outlives no producer


def test_a_new_store_object_recovers_a_dead_learners_claim(redis_server: RedisServer) -> None:
    run = new_run_id()
    first = open_store(redis_server.url, run)
    for gid in "abc":
        first.put(make_group(gid))
    lost = first.claim(2)  # the learner dies here, mid-step
    restarted = open_store(redis_server.url, run)  # a new process
    assert restarted.recover() == 2
    again = restarted.claim(2)
    assert [g.group_id for g in again.groups] == [g.group_id for g in lost.groups]
    restarted.ack(again.claim_id, new_version=1)
    assert (restarted.stats().trained, restarted.version()) == (2, 1)


# -- retries and idempotent scripts ------------------------------------------------------
def _snapshot(client: redis.Redis, run: str) -> dict[bytes, bytes]:
    """Every key of the run but the operation replies, serialised: state and counters."""
    return {k: client.dump(k) for k in client.scan_iter(match=f"turnrl:{{{run}}}:*")
            if b":op:" not in k}


def test_every_script_re_run_with_its_operation_id_changes_nothing(redis_server: RedisServer) -> None:
    """What redis-py does after a lost reply: send the same script, same id, again. Each
    second run must return the first run's reply and leave every key as it was."""
    run = new_run_id()
    store, client = open_store(redis_server.url, run), redis.Redis.from_url(redis_server.url)

    def twice(op: str, call: Callable[[str], object]) -> object:
        first = call(op)
        before = _snapshot(client, run)
        again = call(op)
        assert again == first, op
        assert _snapshot(client, run) == before, op
        return first

    assert twice("r1", lambda op: store._run("reserve", 3, 64, 1, 2, op_id=op)) == 3
    assert twice("r2", lambda op: store._run("release", 1, op_id=op)) == 0
    for gid in "abc":  # without once(): "duplicate", refused counted again
        assert twice(f"p{gid}", lambda op: store.put(make_group(gid), op_id=op).status) == "accepted"
    # 3 reserved - 1 released - 2 ended by accepted puts = 0; a re-run would have released more
    assert store.stats().running == 0
    cid, gids, ages = twice("c1", lambda op: store._run("claim", 2, 1, 0, 0, op_id=op))
    assert (cid, gids, ages) == (b"c0", [b"a", b"b"], [0, 0])
    assert twice("a1", lambda op: store._run("ack", "c0", 1, 0, op_id=op)) == 2
    assert twice("m1", lambda op: store._run("commit", 1, op_id=op)) == 2
    twice("c2", lambda op: store._run("claim", 1, 1, 0, 0, op_id=op))
    assert twice("v1", lambda op: store._run("recover", "", op_id=op)) == 1
    s = store.stats()
    assert (s.accepted, s.trained, s.ready, s.claimed, s.refused) == (3, 2, 1, 0, {})
    assert twice("pL", lambda op: store.put(make_group("L"), False, op_id=op).status) == "accepted"
    assert (store.stats().live_accepted, store.stats().live_held) == (1, 1)
    assert list(client.scan_iter(match=f"turnrl:{{{run}}}:stage:*")) == []  # re-sent puts' staging


@pytest.mark.parametrize("trigger", [b"\r\nEVAL\r\n", b"EVALSHA"], ids=["put", "scripts"])
def test_a_lost_reply_is_re_sent_and_applied_once(redis_server: RedisServer, trigger: bytes) -> None:
    """A proxy drops the connection after Redis ran the command (put's pipeline of SET and
    EVAL, or any other script's EVALSHA) and before its reply: the production client re-sends
    it, gets the first run's reply, and the store counts the operation once."""
    proxy, run = ReplyDroppingProxy(redis_server.port), new_run_id()
    on_put, on_scripts = trigger != b"EVALSHA", trigger == b"EVALSHA"
    try:
        store = open_store(proxy.url, run)
        if on_put:
            proxy.arm(trigger)
        assert store.put(make_group("a")).status == "accepted"  # not "duplicate"
        store.put(make_group("b"))
        # Load the claim and ack scripts first (a first EVALSHA only gets NOSCRIPT back), so
        # the reply dropped below is that of a script that ran.
        assert store.claim(3) is None
        with pytest.raises(KeyError):
            store.ack("c9", 1)
        if on_scripts:
            proxy.arm(trigger)
        claim = store.claim(2)  # not a second claim of nothing, nor two claims
        assert [g.group_id for g in claim.groups] == ["a", "b"]
        if on_scripts:
            proxy.arm(trigger)
        store.ack(claim.claim_id, 1)  # not KeyError from the second run
        assert proxy.dropped == (2 if on_scripts else 1)
        s = store.stats()
        assert (s.accepted, s.trained, s.refused, s.staleness_hist) == (2, 2, {}, {0: 2})
    finally:
        proxy.close()


@requires_redis
def test_the_client_waits_out_a_redis_restart(tmp_path: Path) -> None:
    """redis-server dies and is back 1 s later: calls made meanwhile block and then succeed."""
    server = RedisServer(tmp_path, appendonly=True, appendfsync="always").start()
    try:
        store = open_store(server.url)
        store.put(make_group("a"))
        server.kill()
        threading.Timer(1.0, server.start).start()
        start = time.monotonic()
        assert store.put(make_group("b")).status == "accepted"
        assert time.monotonic() - start > 0.9  # it did wait for the server
        assert [g.group_id for g in store.claim(2).groups] == ["a", "b"]
    finally:
        server.stop()


def test_retry_policy_spans_retry_s() -> None:
    from replay.redis_store import retry_policy

    # sleeps min(2, 0.05 * 2**k) for k = 1..: 0.1 0.2 0.4 0.8 1.6 2 2 ... ; 30 s needs 3.1 + 14 x 2
    assert retry_policy(ReplayConfig(retry_s=30)).get_retries() == 5 + 14
    assert retry_policy(ReplayConfig(retry_s=0)).get_retries() == 0


# -- crash test ---------------------------------------------------------------------------
def _spawn(tmp: Path, role: str, url: str, run: str, *extra: str) -> subprocess.Popen[bytes]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    with (tmp / f"{role}-{len(list(tmp.glob(role + '*.log')))}.log").open("wb") as log:
        return subprocess.Popen(
            [sys.executable, str(ROOT / "tests" / "redis_fixture.py"), role, url, run, *extra],
            env=env, stdout=log, stderr=subprocess.STDOUT)


def _wait_for(predicate: Callable[[], bool], what: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


def _lines(path: Path) -> list[str]:
    return path.read_text().split() if path.exists() else []


@pytest.mark.slow
@requires_redis
def test_sigkill_redis_and_learner_loses_nothing_trains_nothing_twice(tmp_path: Path) -> None:
    """appendfsync always: with everysec, Redis may reply before writing while a slow fsync
    runs, so a crash can lose acknowledged writes and this test would be flaky by design."""
    n, run = 80, "crash"
    produced, trained = tmp_path / "produced.txt", tmp_path / "trained.txt"
    status, hang = tmp_path / "status.txt", tmp_path / "hang-now"
    server = RedisServer(tmp_path / "data", appendonly=True, appendfsync="always").start()
    procs: list[subprocess.Popen[bytes]] = []
    try:
        procs.append(_spawn(tmp_path, "producer", server.url, run, "--n", str(n),
                            "--out", str(produced)))
        procs.append(_spawn(tmp_path, "learner", server.url, run, "--target", str(n),
                            "--out", str(trained), "--status", str(status),
                            "--hang-file", str(hang)))
        _wait_for(lambda: len(_lines(trained)) >= 8, "the first learner steps")
        assert procs[0].poll() is None, "the producer finished before the crash: raise n"
        server.kill()  # redis-server dies mid-run ...
        time.sleep(0.2)
        server.start()  # ... and comes back on the same port and data directory
        hang.touch()  # the learner now claims a batch and dies before acknowledging it
        _wait_for(lambda: "hang" in (status.read_text() if status.exists() else ""), "hang")
        procs[1].send_signal(signal.SIGKILL)
        procs[1].wait()
        hung = status.read_text().split("hang ")[1].split()
        assert not set(hung) & set(_lines(trained))
        hang.unlink()
        procs.append(_spawn(tmp_path, "learner", server.url, run, "--target", str(n),
                            "--out", str(trained), "--status", str(status), "--recover"))
        for proc in (procs[0], procs[2]):
            assert _exit_code(proc, 60) == 0, _logs(tmp_path)
        assert f"recovered {len(hung)}" in status.read_text()
        counts = Counter(_lines(trained))
        assert [gid for gid, k in counts.items() if k > 1] == []  # none trained twice
        assert set(counts) == set(_lines(produced)) == {f"g{i:04d}" for i in range(n)}  # none lost
        s = open_store(server.url, run).stats()
        assert (s.accepted, s.trained, s.ready, s.claimed, s.bytes) == (n, n, 0, 0, 0)
        assert s.evicted == {} and set(s.refused) <= {"full", "duplicate"}
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        server.stop()


def _exit_code(proc: subprocess.Popen[bytes], timeout_s: float) -> int | None:
    try:
        return proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        return None


def _logs(tmp: Path) -> str:
    return "\n".join(f"--- {p.name}\n{p.read_text()[-2000:]}" for p in sorted(tmp.glob("*.log")))
