"""The replay interface every backend implements, and the records it returns.

Protocol, one training step::

    granted = store.reserve(n)            # producer: admission (may be 0)
    store.put(group)                      # producer: a finished group (or store.release(1))
    claim = store.claim(B)                # learner: B groups, or None if not yet available
                                          # (claim(B, live=(lo, hi)): lo..hi of them live)
    ...optimizer step...
    store.ack(claim.claim_id, version)    # learner: trained; publishes the new version
    ...every N steps: checkpoint...
    store.commit(version)                 # learner: the checkpoint holds it; forget the groups

Live groups (sessions served through the gateway) are put *unscheduled*: they hold no
reservation, are bounded on their own by ``live_capacity_groups`` (refused ``live_full``, never
waited for) and wait in their own queue, so the learner chooses how many of each batch are
live. Every method is non-blocking so a store can live inside a single-threaded actor; waiting and
backpressure live in ``replay.client``. Exactly-once training across crashes is two-phase: an
acknowledged group is *retained* until a checkpoint that includes its update is durable
(``commit``). After a crash, ``recover(checkpoint_version)`` delivers again every claim never
acknowledged and every claim acknowledged after the checkpoint the learner resumes from (its
update died with the learner), so the resumed learner trains each group once. Group ids make
redelivery idempotent: a group put twice is refused as a duplicate.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import Counter
from dataclasses import dataclass, field
from functools import cached_property
from typing import Literal

from replay import codec
from replay.record import GroupRecord
from rollout.trajectory import Group

PutStatus = Literal["accepted", "full", "live_full", "stale", "duplicate"]
LiveShare = tuple[int, int]
"""(fewest, most) live groups in one claim."""


def check_live_share(num_groups: int, live: LiveShare | None) -> LiveShare:
    """The claim's live bounds, validated; ``None`` means no live groups."""
    if num_groups < 1:
        raise ValueError(f"claim(num_groups={num_groups}): claim at least one group")
    lo, hi = live or (0, 0)
    if not 0 <= lo <= hi <= num_groups:
        raise ValueError(f"claim(live={live}): need 0 <= fewest <= most <= num_groups={num_groups}")
    return lo, hi


class ReplayFullError(RuntimeError):
    """The store stayed full for longer than the producer may wait."""


@dataclass
class PutResult:
    status: PutStatus
    detail: str = ""

    @property
    def accepted(self) -> bool:
        return self.status == "accepted"


@dataclass
class Claim:
    """Groups handed to the learner, to be acknowledged after its optimizer step.

    The store hands back the groups' records as it holds them; they are decoded where they
    are used, on the first read of ``groups`` (the learner's process, not the replay actor's:
    see replay/record.py)."""

    claim_id: str
    payloads: list[bytes | bytearray] = field(repr=False)
    """The claimed groups' records (replay/codec.py), oldest first."""
    staleness: list[int]
    """Learner version minus each group's oldest policy version, at claim time."""

    @cached_property
    def groups(self) -> list[Group]:
        return codec.decode_groups(self.payloads)


@dataclass
class ReplayStats:
    """Counters a dashboard or a test reads; nothing is dropped without a count here."""

    version: int = 0
    ready: int = 0
    claimed: int = 0
    running: int = 0
    bytes: int = 0
    accepted: int = 0
    """Groups accepted from producers (scheduled puts; the admission rule counts these)."""
    live_ready: int = 0
    """Live groups waiting to be claimed (also counted in ``ready``)."""
    live_held: int = 0
    """Live groups held, ready or claimed (bounded by ``live_capacity_groups``)."""
    live_accepted: int = 0
    """Live groups accepted (unscheduled puts)."""
    live_trained: int = 0
    """Live groups acknowledged by the learner."""
    trained: int = 0
    """Groups acknowledged (a rewind by ``recover`` subtracts the ones it redelivers)."""
    retained: int = 0
    """Acknowledged groups kept until a checkpoint covers them (``commit``); not in ``bytes``."""
    refused: dict[str, int] = field(default_factory=dict)
    """Puts refused, by reason (full, live_full, stale, duplicate)."""
    evicted: dict[str, int] = field(default_factory=dict)
    """Groups removed without training, by reason (stale)."""
    staleness_hist: dict[int, int] = field(default_factory=dict)
    """Claimed groups by staleness."""

    def count(self, table: Literal["refused", "evicted"], reason: str, n: int = 1) -> None:
        counter = Counter(getattr(self, table))
        counter[reason] += n
        setattr(self, table, dict(counter))


class ReplayStore(ABC):
    """A bounded, staleness-aware queue of complete groups."""

    @abstractmethod
    def reserve(self, n: int) -> int:
        """Ask to start ``n`` groups; returns how many are admitted (0..n)."""

    @abstractmethod
    def release(self, n: int) -> None:
        """Give back ``n`` reservations that will not produce a group (failed episodes)."""

    @abstractmethod
    def put(self, group: Group | GroupRecord, scheduled: bool = True) -> PutResult:
        """Offer a finished group, as its record (a producer in another process encodes it
        there: ``GroupRecord.of``) or as a model (encoded here). A scheduled group (a
        producer's) consumes one reservation when there is one; an unscheduled one (live
        traffic) takes none and is refused ``live_full`` past ``live_capacity_groups``."""

    def put_many(self, groups: list[Group | GroupRecord], scheduled: bool = True) -> list[PutResult]:
        """``put`` of each group, in order, each accepted or refused on its own; a store may
        send them together (Redis: one pipeline, one round trip)."""
        return [self.put(group, scheduled) for group in groups]

    @abstractmethod
    def claim(self, num_groups: int, live: LiveShare | None = None) -> Claim | None:
        """Claim ``num_groups`` fresh groups, oldest first: as many live ones as are ready
        within ``live=(fewest, most)`` (none by default), the rest scheduled; None while
        either kind is short.

        Groups that became stale are evicted (counted) on the way.
        """

    @abstractmethod
    def live_room(self) -> int:
        """How many more live groups a put would accept now (0 when it would be refused)."""

    @abstractmethod
    def ack(self, claim_id: str, new_version: int, commit: bool = False) -> None:
        """The claim was trained on; the learner now publishes ``new_version``.

        ``commit``: and ``commit(new_version)`` in the same operation, for a learner that keeps
        no checkpoint to roll back to (one round trip a step instead of two)."""

    @abstractmethod
    def commit(self, version: int) -> int:
        """A checkpoint of ``version`` is durable: forget the groups acknowledged at or before
        it; returns groups forgotten."""

    @abstractmethod
    def recover(self, checkpoint_version: int | None = None) -> int:
        """Redeliver after a learner crash; returns groups requeued.

        Every unacknowledged claim goes back to the head of the ready queue in claim order.
        With ``checkpoint_version`` (the version the learner resumes from), claims acknowledged
        after it go back too, ahead of those, and the store's version becomes it (a fresh
        in-process store starts there); claims acknowledged at or before it are committed.
        """

    @abstractmethod
    def stats(self) -> ReplayStats:
        """A snapshot of the counters."""

    def size(self) -> int:
        """Groups ready to be claimed."""
        return self.stats().ready

    def version(self) -> int:
        """The learner's last acknowledged version."""
        return self.stats().version

    def close(self) -> None:
        """Release connections or servers held by the store."""
