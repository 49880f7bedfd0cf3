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
"""A learner waiting for a batch asks again this often: a claim that finds nothing costs one
call (~1 ms), while every poll interval is up to that much training time lost once the batch
is there (backing off to 0.5 s cost async runs ~0.3 s a step: bench/pipeline.py)."""


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


def wait_claim(
    claim: Callable[[int], Claim | None],
    num_groups: int,
    timeout_s: float,
    should_stop: Callable[[], bool] = lambda: False,
) -> Claim | None:
    """Poll until ``num_groups`` are claimable; None on timeout or when told to stop."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and not should_stop():
        got = claim(num_groups)
        if got is not None:
            return got
        time.sleep(_CLAIM_POLL_S)
    return None
