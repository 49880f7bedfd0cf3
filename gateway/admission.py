"""How much the gateway takes on at once, so that overload is answered, never queued forever.

Each request holds a slot from its parse to its last byte (a stream's end). Past
``live.max_concurrent`` slots in all, or ``live.max_concurrent_per_token`` for the bearer token
it came with, it is answered 429 at once -- OpenAI's rate-limit body, ``Retry-After`` set --
before any engine work: the engines' queues stay as deep as the operator allowed, and a client
learns to back off in bounded time instead of waiting on a hang.
"""

from __future__ import annotations

from collections import Counter

from gateway.errors import GatewayError


class Busy(GatewayError):
    """All slots (the gateway's, or the token's share) are taken (HTTP 429)."""

    status = 429
    kind = "requests"
    code = "rate_limit_exceeded"

    def __init__(self, what: str, limit: int, retry_after_s: int) -> None:
        super().__init__(None, f"{what} are already being served (the limit is {limit}); retry after "
                               f"{retry_after_s} s")
        self.retry_after_s = retry_after_s


class Admission:
    """Slots per gateway and per token; ``take`` or 429, ``give`` when the request is done."""

    def __init__(self, total: int, per_token: int | None, retry_after_s: int) -> None:
        self.total, self.per_token, self.retry_after_s = total, per_token, retry_after_s
        self.busy = 0
        self._by_token: Counter[str] = Counter()
        self.refused = 0

    def take(self, token: str) -> None:
        """One slot for a request that came with ``token`` ("" without authentication)."""
        if self.busy >= self.total:
            self.refused += 1
            raise Busy(f"{self.busy} requests", self.total, self.retry_after_s)
        if self.per_token is not None and self._by_token[token] >= self.per_token:
            self.refused += 1
            raise Busy(f"{self._by_token[token]} requests of this token", self.per_token, self.retry_after_s)
        self.busy += 1
        self._by_token[token] += 1

    def give(self, token: str) -> None:
        self.busy -= 1
        self._by_token[token] -= 1
        if self._by_token[token] <= 0:
            del self._by_token[token]
