"""Waiting on a non-blocking store: producer backpressure and learner claims.

Stores never block (one may live in a single-threaded actor); callers wait here instead,
with the store's methods passed in as callables so the same rules serve a local store,
a Ray actor handle or a Redis client.
"""

from __future__ import annotations

import asyncio
import time
from typing import Awaitable, Callable

from replay.base import Claim, PutResult, ReplayFullError
from replay.config import ReplayConfig
from rollout.trajectory import Group

_POLL_S = 0.05
_CLAIM_POLL_S = 0.02
"""A learner waiting on a store in its own process asks again this often: every poll
interval is up to that much training time lost once the batch is there (backing off to
0.5 s cost async runs ~0.3 s a step: bench/pipeline.py)."""
_STOP_CHECK_S = 0.5
"""A learner waiting for a batch looks this often whether it was told to stop."""


def _full_error(group: Group, cfg: ReplayConfig, result: PutResult) -> ReplayFullError:
    return ReplayFullError(
        f"replay store full ({result.detail}) for {cfg.put_timeout_s:.0f}s while putting group "
        f"{group.group_id}: raise replay.capacity_groups/capacity_bytes, or lower "
        "replay.max_concurrent_groups"
    )


async def aput(put: Callable[[Group], Awaitable[PutResult]], group: Group, cfg: ReplayConfig) -> PutResult:
    """Put from async code, waiting while the store is full (``on_full: wait``)."""
    deadline = time.monotonic() + cfg.put_timeout_s
    delay = _POLL_S
    while True:
        result = await put(group)
        if result.status != "full":
            return result
        if cfg.on_full == "error" or time.monotonic() > deadline:
            raise _full_error(group, cfg, result)
        await asyncio.sleep(delay)
        delay = min(delay * 2, 1.0)


class PutCoalescer:
    """Puts from many coroutines sent as few ``put_many`` calls (a group commit): the first
    goes at once, and every group that arrives while a call is in flight goes in the next
    one, so a busy producer side makes one round trip (and one fsync on Redis) for many
    groups, and an idle one adds no wait. Refusals stay per group."""

    def __init__(self, put_many: Callable[[list[Group]], Awaitable[list[PutResult]]],
                 max_groups: int = 64) -> None:
        self._put_many, self._max = put_many, max_groups
        self._pending: list[tuple[Group, asyncio.Future]] = []
        self._sending = False

    async def __call__(self, group: Group) -> PutResult:
        fut = asyncio.get_running_loop().create_future()
        self._pending.append((group, fut))
        if not self._sending:
            self._sending = True
            asyncio.get_running_loop().create_task(self._send())
        return await fut

    async def _send(self) -> None:
        try:
            while self._pending:
                batch, self._pending = self._pending[:self._max], self._pending[self._max:]
                try:
                    results = await self._put_many([group for group, _ in batch])
                except Exception as exc:  # noqa: BLE001 - every caller in the call sees it
                    for _, fut in batch:
                        if not fut.done():
                            fut.set_exception(exc)
                    continue
                for (_, fut), result in zip(batch, results):
                    if not fut.done():
                        fut.set_result(result)
        finally:
            self._sending = False


class StoreOutlet:
    """A store's ``put_many(groups, scheduled)`` as the reward service's
    ``rewards.ports.ReplayOutlet``: scheduled puts coalesced into few calls and waiting while
    the store is full (``aput``), live offers sent alone and never waiting."""

    def __init__(self, put_many: Callable[[list[Group], bool], Awaitable[list[PutResult]]],
                 cfg: ReplayConfig) -> None:
        self.put_many, self.cfg = put_many, cfg
        # Groups scored together (one batch of the scorers) finish together: their puts go
        # to replay as one call (Redis: one transaction and one fsync instead of one each).
        self._coalesced = PutCoalescer(lambda groups: put_many(groups, True))

    async def put(self, group: Group) -> PutResult:
        return await aput(self._coalesced, group, self.cfg)

    async def offer(self, group: Group) -> PutResult:
        (result,) = await self.put_many([group], False)
        return result


def poll_claim(claim: Callable[[], Claim | None], wait_s: float) -> Claim | None:
    """``claim()`` until it gives a batch or ``wait_s`` is over, asking every 20 ms: for a
    store in this process, which no put can wake (a replay actor's ``claim_wait`` waits
    for puts instead)."""
    deadline = time.monotonic() + wait_s
    while True:
        got = claim()
        if got is not None or time.monotonic() >= deadline:
            return got
        time.sleep(_CLAIM_POLL_S)


def wait_claim(
    claim: Callable[[int, float], Claim | None],
    num_groups: int,
    timeout_s: float,
    should_stop: Callable[[], bool] = lambda: False,
) -> Claim | None:
    """``claim(num_groups, wait_s)`` in slices of at most ``_STOP_CHECK_S`` until the groups
    come; None on timeout or when told to stop (looked at between slices)."""
    deadline = time.monotonic() + timeout_s
    while not should_stop():
        left = deadline - time.monotonic()
        if left <= 0:
            return None
        got = claim(num_groups, min(left, _STOP_CHECK_S))
        if got is not None:
            return got
    return None
