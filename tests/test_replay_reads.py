"""Payload reads (replay/redis_reads.py): long values straight off the socket, intact, also
when the reply is cut mid-value. A real redis-server; speed is bench/replay.py's business."""

from __future__ import annotations

import os
import socket
import threading

import msgpack
import pytest
import redis
from redis_fixture import make_group, new_run_id, redis_server  # noqa: F401 (fixture)
from redis.utils import HIREDIS_AVAILABLE
from test_replay_codec import V1_HEADER, v1_tree

from replay.config import ReplayConfig
from replay.redis_reads import BULK_MIN, BulkReadBuffer, reads_bulk_directly
from replay.redis_server import RedisServer
from replay.redis_store import RedisReplayStore


def open_store(url: str) -> RedisReplayStore:
    return RedisReplayStore(ReplayConfig(type="redis", url=url, retry_s=5), 2, run_id=new_run_id())


def test_long_values_come_back_intact_next_to_short_replies(redis_server: RedisServer) -> None:
    store = open_store(redis_server.url)
    client = store._r
    sizes = [BULK_MIN - 1, BULK_MIN, BULK_MIN + 1, 3 << 20]
    values = {f"{store.run_id}:v{n}": os.urandom(n - 2) + b"\r\n" for n in sizes}  # CRLF inside
    try:
        assert reads_bulk_directly(client) != HIREDIS_AVAILABLE  # hiredis needs no help
        for key, value in values.items():
            client.set(key, value)
        keys = [*values, f"{store.run_id}:missing"]
        got = client.mget(keys)
        assert got == [*values.values(), None]
        assert [type(v) for v in got[:-1]] == [bytes, bytearray, bytearray, bytearray]
        pipe = client.pipeline(transaction=False)  # replies back to back in one buffer
        for key in values:
            pipe.get(key)
            pipe.incr(f"{store.run_id}:n")
        assert pipe.execute() == [x for i, v in enumerate(values.values()) for x in (v, i + 1)]
    finally:
        store.delete_run()
        client.delete(*values, f"{store.run_id}:n")
        store.close()


def test_a_format_1_payload_held_across_the_upgrade_is_claimed(redis_server: RedisServer) -> None:
    """A group the previous build put (one packed array per field) is still in Redis after
    the upgrade: the claim reads it (0.6 MB, the direct path) and decodes it as it was."""
    store = open_store(redis_server.url)
    try:
        old, new = make_group("old", tokens=20_000), make_group("new", tokens=20_000)
        assert store.put(old).accepted and store.put(new).accepted
        store._r.set(store._gkey + b"old", V1_HEADER + msgpack.packb(v1_tree(old)))
        assert store.claim(2).groups == [old, new]
    finally:
        store.delete_run()
        store.close()


class CuttingProxy:
    """Loopback proxy in front of Redis that, once armed, passes on the first ``keep`` bytes
    of the replies to the next request holding ``trigger`` and then closes the connection:
    a reply cut off in the middle of a payload."""

    def __init__(self, upstream_port: int, trigger: bytes, keep: int) -> None:
        self.upstream_port, self.trigger, self.keep = upstream_port, trigger, keep
        self.armed, self.cuts = False, 0
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"redis://127.0.0.1:{self.listener.getsockname()[1]}/0"
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            server = socket.create_connection(("127.0.0.1", self.upstream_port))
            budget: list[int | None] = [None]  # bytes of reply left to pass on; None: all
            threading.Thread(target=self._requests, args=(client, server, budget), daemon=True).start()
            threading.Thread(target=self._replies, args=(server, client, budget), daemon=True).start()

    def _requests(self, client: socket.socket, server: socket.socket, budget: list) -> None:
        try:
            while data := client.recv(1 << 16):
                if self.armed and self.trigger in data:
                    self.armed, budget[0] = False, self.keep
                server.sendall(data)
        except OSError:
            pass

    def _replies(self, server: socket.socket, client: socket.socket, budget: list) -> None:
        try:
            while data := server.recv(1 << 16):
                if budget[0] is not None:
                    data = data[:budget[0]]
                    budget[0] -= len(data)
                client.sendall(data)
                if budget[0] == 0:
                    self.cuts += 1
                    break
        except OSError:
            pass
        for sock in (client, server):  # shutdown, not just close: the other thread's recv holds the fd
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            sock.close()

    def close(self) -> None:
        self.listener.close()


def test_a_claim_whose_payload_reply_is_cut_reads_it_again(redis_server: RedisServer) -> None:
    """The MGET reply is cut 100 kB into the first ~0.6 MB record: the client's retry sends
    MGET again on a new connection and the claim holds exactly the groups put."""
    proxy = CuttingProxy(redis_server.port, b"MGET", keep=100_000)
    store = open_store(proxy.url)
    try:
        groups = [make_group(gid, tokens=20_000) for gid in ("a", "b")]
        for group in groups:
            assert store.put(group).accepted
        proxy.armed = True
        claim = store.claim(2)
        assert proxy.cuts == 1
        assert claim.groups == groups
        store.ack(claim.claim_id, 1)
        assert store.stats().trained == 2
    finally:
        store.delete_run()
        store.close()
        proxy.close()


@pytest.mark.skipif(HIREDIS_AVAILABLE, reason="hiredis parses; BulkReadBuffer is not used")
def test_an_interrupted_long_read_keeps_every_byte_for_the_rewind() -> None:
    """redis-py rewinds to a reply's start after an interrupted read and parses it again:
    the bytes the direct path had taken from the socket must be there for it."""
    ours, theirs = socket.socketpair()
    try:
        buf = BulkReadBuffer(ours, 1 << 16, 5.0)
        value = os.urandom(BULK_MIN * 3)
        theirs.sendall(value[:1000])
        start = buf.get_pos()
        with pytest.raises(redis.exceptions.TimeoutError):
            buf.read(len(value), timeout=0.2)
        buf.rewind(start)
        theirs.sendall(value[1000:] + b"\r\n+OK\r\n")
        assert buf.read(len(value)) == value
        assert buf.readline() == b"+OK"
    finally:
        ours.close()
        theirs.close()
