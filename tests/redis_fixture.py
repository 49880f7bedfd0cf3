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
import sys
import time
from pathlib import Path
from typing import Callable, Iterator, TypeVar

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # when run as a script, and under a bare `pytest` binary
    sys.path.insert(0, str(ROOT))

import pytest  # noqa: E402
import redis  # noqa: E402

from replay.config import ReplayConfig  # noqa: E402
from replay.redis_server import RedisServer, find_redis_server  # noqa: E402
from replay.redis_store import RedisReplayStore, ReplayConnectionError  # noqa: E402
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


# -- crash-test roles (subprocesses) -------------------------------------------------------
T = TypeVar("T")
_DOWN = (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError, ReplayConnectionError)


def retry(fn: Callable[[], T], timeout_s: float = 30.0) -> T:
    """Call ``fn`` until Redis answers (it may be down or replaying its AOF)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return fn()
        except _DOWN:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def _open(args: argparse.Namespace) -> RedisReplayStore:
    cfg = ReplayConfig(type="redis", url=args.url, eta=1000, capacity_groups=16)
    return retry(lambda: RedisReplayStore(cfg, 4, run_id=args.run_id))


def _producer(args: argparse.Namespace) -> None:
    store = _open(args)
    with open(args.out, "a") as out:
        for i in range(args.n):
            group = make_group(f"g{i:04d}", version=retry(store.version))
            # A put whose reply was lost may have landed: the retry then says "duplicate".
            while (status := retry(lambda: store.put(group).status)) == "full":
                time.sleep(0.01)
            assert status in ("accepted", "duplicate"), status
            out.write(group.group_id + "\n")
            out.flush()
            time.sleep(0.01)


def _ack(store: RedisReplayStore, claim_id: str, version: int) -> None:
    try:
        retry(lambda: store.ack(claim_id, version))
    except KeyError:
        pass  # the first ack ran but its reply was lost; nobody else recovers our claims
    retry(lambda: store.commit(version))  # as a learner that checkpoints every step (idempotent)


def _learner(args: argparse.Namespace) -> None:
    store = _open(args)
    status = open(args.status, "a", buffering=1)
    if args.recover:
        status.write(f"recovered {retry(store.recover)}\n")
    deadline = time.monotonic() + 60
    while retry(store.stats).trained < args.target:
        assert time.monotonic() < deadline, "learner ran out of time"
        try:
            claim = store.claim(4)
        except _DOWN:
            # The claim may have run with its reply lost; we hold no other claim, so requeue.
            retry(store.recover)
            continue
        if claim is None:
            time.sleep(0.01)
            continue
        ids = [g.group_id for g in claim.groups]
        if args.hang_file and Path(args.hang_file).exists():
            status.write(f"hang {' '.join(ids)}\n")
            time.sleep(600)  # mid-step: the test SIGKILLs us here
        time.sleep(0.01)  # the "optimizer step"
        _ack(store, claim.claim_id, retry(store.version) + 1)
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
