"""The reward side's outlet into replay, as a protocol.

``rewards/`` sits upstream of ``replay/`` (DEVELOPERS.md): the reward service scores a group and
hands it on, but never imports the store, its results or its waiting rules. Whoever builds the
service (``cluster/``, or a test) passes an object with these coroutines;
``replay.client.StoreOutlet`` is the one the project ships, over any store's ``put_many``.
"""

from __future__ import annotations

from typing import Protocol

from rollout.trajectory import Group


class PutOutcome(Protocol):
    """What replay said about one group (``replay.base.PutResult``)."""

    status: str
    """``accepted``, ``duplicate``, ``full``, ... (the store's vocabulary; counted by status)."""


class ReplayOutlet(Protocol):
    async def put(self, group: Group) -> PutOutcome:
        """A scheduled group (it holds a producer's reservation): waits while the store is
        full, as the replay config says."""
        ...

    async def offer(self, group: Group) -> PutOutcome:
        """An unscheduled (live) group: a full store refuses it at once."""
        ...
