"""CPU affinity of a whole process: every thread it has, torch's pools included.

Linux keeps affinity per thread, so pinning only the calling thread leaves the others (torch's
OpenMP pool, gRPC threads) where they were; threads started later inherit the affinity of the
thread that starts them. The driver pins actors with it (``cluster.actors.pin``) and an engine
actor pins itself when it starts, so a restarted one lands on its cores again.
"""

from __future__ import annotations

import os


def pin_process(cores: list[int], key: str) -> None:
    """Restrict every thread of this process to ``cores``; ``key`` names the setting in the
    error when this node lacks one of them."""
    have = sorted(os.sched_getaffinity(0))
    if not set(cores) <= set(range(os.cpu_count() or 1)):
        raise ValueError(f"{key}={cores}: this node's cores are 0..{(os.cpu_count() or 1) - 1} "
                         f"(this process may use {have})")
    for tid in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(tid), cores)
        except ProcessLookupError:  # the thread ended meanwhile
            pass
