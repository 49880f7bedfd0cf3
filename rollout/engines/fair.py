"""Fair admission of requests to an engine shared by several LoRA runs (an engine pool).

An engine decodes whatever reaches it, first come first served: one tenant that floods it
with requests, or keeps many episodes open, would hold every batch row and starve the
others. ``FairGate`` sits in front of the engine and lets at most ``total`` requests run at
once, at most ``per_key`` of them for one key (a run's adapter). When a slot frees, it goes to
the waiting key with the fewest requests running, ties to the one that has waited longest, so
each key gets an equal share of the engine while it has work and idle shares go to whoever
has some. Pure asyncio; no engine knowledge.
"""

from __future__ import annotations

import asyncio
import itertools
from collections import deque
from contextlib import asynccontextmanager
from typing import AsyncIterator, Hashable


class FairGate:
    """At most ``total`` holders at once, ``per_key`` per key; freed slots go to the key with
    the fewest holders (then the oldest waiter)."""

    def __init__(self, total: int, per_key: int) -> None:
        if total < 1 or per_key < 1:
            raise ValueError(f"FairGate needs total >= 1 and per_key >= 1, got {total}, {per_key}")
        self.total, self.per_key = total, per_key
        self.running: dict[Hashable, int] = {}
        self._waiting: dict[Hashable, deque[tuple[int, asyncio.Future]]] = {}
        self._ticket = itertools.count()

    @property
    def busy(self) -> int:
        return sum(self.running.values())

    def waiting(self, key: Hashable | None = None) -> int:
        """Requests waiting for a slot (of ``key``, or of every key)."""
        if key is not None:
            return len(self._waiting.get(key, ()))
        return sum(len(q) for q in self._waiting.values())

    def _free_for(self, key: Hashable) -> bool:
        return self.busy < self.total and self.running.get(key, 0) < self.per_key

    async def acquire(self, key: Hashable) -> None:
        if self._free_for(key) and not self._waiting.get(key):
            self.running[key] = self.running.get(key, 0) + 1
            return
        fut = asyncio.get_running_loop().create_future()
        self._waiting.setdefault(key, deque()).append((next(self._ticket), fut))
        try:
            await fut
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled():  # granted as it was cancelled: give it back
                self.release(key)
            else:
                self._drop(key, fut)
            raise

    def release(self, key: Hashable) -> None:
        left = self.running.get(key, 0) - 1
        if left < 0:
            raise RuntimeError(f"FairGate.release({key!r}) without a holder")
        if left:
            self.running[key] = left
        else:
            del self.running[key]
        self._grant()

    def _grant(self) -> None:
        """Hand freed slots to waiters: fewest running first, then the oldest ticket."""
        while self.busy < self.total:
            ready = [k for k, q in self._waiting.items() if q and self.running.get(k, 0) < self.per_key]
            if not ready:
                return
            key = min(ready, key=lambda k: (self.running.get(k, 0), self._waiting[k][0][0]))
            _, fut = self._waiting[key].popleft()
            if not self._waiting[key]:
                del self._waiting[key]
            self.running[key] = self.running.get(key, 0) + 1
            fut.set_result(None)

    def _drop(self, key: Hashable, fut: asyncio.Future) -> None:
        queue = self._waiting.get(key)
        if queue is not None:
            self._waiting[key] = deque(item for item in queue if item[1] is not fut)
            if not self._waiting[key]:
                del self._waiting[key]

    @asynccontextmanager
    async def slot(self, key: Hashable) -> AsyncIterator[None]:
        await self.acquire(key)
        try:
            yield
        finally:
            self.release(key)
