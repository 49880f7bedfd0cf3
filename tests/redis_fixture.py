"""Redis test helpers: a real redis-server per test module, small groups, subprocess roles.

Imported by tests/test_replay_contract.py and tests/test_replay_redis.py (not a conftest, so it
stays theirs). Tests skip with a reason when redis-server is not installed.

Run as a script it is one process of the crash test in tests/test_replay_redis.py::

    python tests/redis_fixture.py producer URL RUN_ID --n 80 --out produced.txt
    python tests/redis_fixture.py learner URL RUN_ID --target 80 --out trained.txt --status s.txt
"""

from __future__ import annotations

import argparse
import itertools
import os
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Iterator

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # when run as a script, and under a bare `pytest` binary
    sys.path.insert(0, str(ROOT))

import pytest  # noqa: E402

from replay.config import ReplayConfig  # noqa: E402
from replay.redis_server import RedisServer, find_redis_server  # noqa: E402
from replay.redis_store import RedisReplayStore  # noqa: E402
from rollout.trajectory import Group, Trajectory, Turn  # noqa: E402


def _have_redis() -> bool:
    try:
        find_redis_server()
        return True
    except RuntimeError:
        return False


HAVE_REDIS = _have_redis()
requires_redis = pytest.mark.skipif(
    not HAVE_REDIS, reason="redis-server not installed (apt-get install redis-server; "
    "`make venv` installs it in CI)")
_run_ids = itertools.count()


@pytest.fixture(scope="module")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    """A throwaway redis-server on a free loopback port: no RDB, no AOF."""
    if not HAVE_REDIS:
        pytest.skip("redis-server not installed (apt-get install redis-server)")
    with RedisServer(tmp_path_factory.mktemp("redis"), appendonly=False) as server:
        yield server


def new_run_id() -> str:
    """A run id no other test in this process uses, so tests can share one server."""
    return f"t{os.getpid()}-{next(_run_ids)}"


def make_group(group_id: str, version: int = 0, trajectories: int = 2, tokens: int = 4,
               text: str = "") -> Group:
    """A small valid group whose oldest policy version is ``version``; ASCII unless ``text``."""
    trajs = [
        Trajectory(
            trajectory_id=f"{group_id}-{i}", task_id=f"task-{group_id}", group_id=group_id,
            prompt_ids=list(range(tokens)),
            turns=[Turn(action_ids=[7] * tokens, action_logprobs=[-0.25] * tokens,
                        policy_version=version, text=text)],
        )
        for i in range(trajectories)
    ]
    return Group(group_id=group_id, task_id=f"task-{group_id}", trajectories=trajs)


# -- lost replies ----------------------------------------------------------------------
class ReplyDroppingProxy:
    """A loopback TCP proxy in front of Redis that, once armed, forwards the next request
    containing ``trigger`` (e.g. b"EVALSHA"), lets the server run it, and then closes the
    client's connection without passing the reply on: a reply lost on the wire, for real."""

    def __init__(self, upstream_port: int) -> None:
        self.upstream_port = upstream_port
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.trigger: bytes | None = None
        self.dropped = 0
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def arm(self, trigger: bytes) -> None:
        self.trigger = trigger

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return  # closed
            server = socket.create_connection(("127.0.0.1", self.upstream_port))
            cut = threading.Event()  # set: the server's replies on this pair go nowhere
            threading.Thread(target=self._requests, args=(client, server, cut), daemon=True).start()
            threading.Thread(target=self._replies, args=(server, client, cut), daemon=True).start()

    def _requests(self, client: socket.socket, server: socket.socket, cut: threading.Event) -> None:
        try:
            while data := client.recv(1 << 16):
                if self.trigger is not None and self.trigger in data:
                    self.trigger = None
                    cut.set()
                    server.sendall(data)
                    time.sleep(0.2)  # the server runs the command and replies into the void
                    self.dropped += 1
                    break
                server.sendall(data)
        except OSError:
            pass
        _close(client, server)

    @staticmethod
    def _replies(server: socket.socket, client: socket.socket, cut: threading.Event) -> None:
        try:
            while (data := server.recv(1 << 16)) and not cut.is_set():
                client.sendall(data)
        except OSError:
            pass
        if not cut.is_set():
            _close(client, server)

    def close(self) -> None:
        self.listener.close()


def _close(*socks: socket.socket) -> None:
    for sock in socks:
        try:
            sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        sock.close()


# -- crash-test roles (subprocesses) -------------------------------------------------------
# They use the production client as it is: its own retries ride out the redis-server restart.
def _open(args: argparse.Namespace) -> RedisReplayStore:
    cfg = ReplayConfig(type="redis", url=args.url, eta=1000, capacity_groups=16)
    return RedisReplayStore(cfg, 4, run_id=args.run_id)


def _producer(args: argparse.Namespace) -> None:
    store = _open(args)
    with open(args.out, "a") as out:
        for i in range(args.n):
            group = make_group(f"g{i:04d}", version=store.version())
            while (status := store.put(group).status) == "full":
                time.sleep(0.01)
            assert status == "accepted", status  # a re-sent put never reads as a duplicate
            out.write(group.group_id + "\n")
            out.flush()
            time.sleep(0.01)


def _learner(args: argparse.Namespace) -> None:
    store = _open(args)
    status = open(args.status, "a", buffering=1)
    if args.recover:
        status.write(f"recovered {store.recover()}\n")
    deadline = time.monotonic() + 60
    while store.stats().trained < args.target:
        assert time.monotonic() < deadline, "learner ran out of time"
        claim = store.claim(4)
        if claim is None:
            time.sleep(0.01)
            continue
        ids = [g.group_id for g in claim.groups]
        if args.hang_file and Path(args.hang_file).exists():
            status.write(f"hang {' '.join(ids)}\n")
            time.sleep(600)  # mid-step: the test SIGKILLs us here
        time.sleep(0.01)  # the "optimizer step"
        version = store.version() + 1
        store.ack(claim.claim_id, version)  # a re-sent ack returns the first one's reply
        store.commit(version)  # as a learner that checkpoints every step
        with open(args.out, "a") as out:  # trained only once acknowledged
            out.write("".join(f"{gid}\n" for gid in ids))
            out.flush()
            os.fsync(out.fileno())


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("role", choices=["producer", "learner"])
    parser.add_argument("url")
    parser.add_argument("run_id")
    parser.add_argument("--out", required=True)
    parser.add_argument("--n", type=int, default=0, help="producer: groups to put")
    parser.add_argument("--target", type=int, default=0, help="learner: stop once trained")
    parser.add_argument("--status", default=os.devnull)
    parser.add_argument("--hang-file", default="", help="learner: hang mid-step once it exists")
    parser.add_argument("--recover", action="store_true", help="learner: recover() at start")
    args = parser.parse_args(argv)
    (_producer if args.role == "producer" else _learner)(args)


if __name__ == "__main__":
    main()
