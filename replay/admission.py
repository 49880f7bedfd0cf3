"""Admission control and staleness: pure rules shared by every backend.

AReaL's rule bounds how far generation may run ahead of the learner, so that stale samples
are never generated in the first place::

    capacity = min(max_concurrent - running, (eta + version + 1) * B - (accepted - evicted + running))

``version`` is the learner's published weights version, ``B`` the groups per training batch,
``accepted`` the groups accepted into replay so far, ``evicted`` those of them removed
untrained (stale) and ``running`` the groups in generation. AReaL trains every sample it
accepts; a store that evicts must give an evicted group's place back, or the pipeline runs
one group short of each batch from then on: after one eviction the demo's learner waited
~1.4 s every step for the batch's last group, 62 steps long.
"""

from __future__ import annotations


def admission_capacity(
    *, max_concurrent: int, running: int, eta: int, version: int, batch_groups: int, accepted: int,
    evicted: int,
) -> int:
    """How many more groups producers may start now (never negative)."""
    by_concurrency = max_concurrent - running
    by_staleness = (eta + version + 1) * batch_groups - (accepted - evicted + running)
    return max(0, min(by_concurrency, by_staleness))


def staleness(learner_version: int, group_version: int) -> int:
    """Versions between the learner and the oldest weights that produced a group."""
    return max(0, learner_version - group_version)


def is_stale(learner_version: int, group_version: int, eta: int) -> bool:
    """True when a group may no longer be trained on."""
    return staleness(learner_version, group_version) > eta
