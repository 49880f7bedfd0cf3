"""What a replay store takes and holds: a group's encoded record and the facts its rules read.

A group crosses two process boundaries on its way to training: the reward service puts it
into the replay actor, and the learner claims it from there. Sent as a model, each hop
pickles and unpickles its ~145 models and ~400 arrays (~1 ms a group), and a Redis store
then encodes it for Redis and decodes it back on claim. Sent as a record, the producer
encodes it once, Ray carries the bytes (one copy each way), the store writes, holds and
reads them without looking inside, and the learner decodes them once (``Claim.groups``).
``bench/replay.py`` measures both paths.

A store reads only ``group_id`` (duplicates), ``min_version`` (staleness), ``producer``
(reservations given back when a producer dies) and the payload's length (``capacity_bytes``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from replay import codec
from rollout.trajectory import Group


@dataclass(frozen=True)
class GroupRecord:
    """One group as replay holds it."""

    group_id: str
    min_version: int
    """Oldest weights version in the group (``Group.min_version``): what staleness reads."""
    producer: str | None
    """The rollout worker that reserved its place (its first trajectory's ``producer``)."""
    payload: bytes = field(repr=False)
    """The group's record (``replay/codec.py``), uncompressed."""

    @classmethod
    def of(cls, group: Group) -> "GroupRecord":
        """Encode ``group`` (in the producer's process, where it was made)."""
        return cls(group.group_id, group.min_version(), group.trajectories[0].producer,
                   codec.encode_group(group))

    @property
    def nbytes(self) -> int:
        """What the group counts toward ``capacity_bytes``."""
        return len(self.payload)


def as_record(item: Group | GroupRecord) -> GroupRecord:
    """A record as it is; a group encoded here (a producer in the store's own process)."""
    return item if isinstance(item, GroupRecord) else GroupRecord.of(item)
