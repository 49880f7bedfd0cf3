"""CPU affinity of a whole process (every thread it has, torch's pools included), and the
thread policy every TurnRL process runs with.

Linux keeps affinity per thread, so pinning only the calling thread leaves the others (torch's
OpenMP pool, gRPC threads) where they were; threads started later inherit the affinity of the
thread that starts them. The driver pins actors with it (``cluster.actors.pin``) and an engine
actor pins itself when it starts, so a restarted one lands on its cores again.

The thread policy: torch's OpenMP workers sleep at once when a parallel region ends instead of
spinning for the next one (libgomp's default spins ~300k times at every barrier; Intel's
OpenMP for 200 ms). Spinning wakes a worker faster on an idle machine (a tiny-model SFT step
~25% faster alone) and is ruinous on a busy one: the spinning worker holds a core the thread
with the real work needs. On a loaded 2-core machine that step burnt 1.6-2.5 s of CPU spinning
against 0.3 s passive and ran 4-15x slower (docs/results/contention.md). OpenMP reads the policy once, when torch first loads it, so each
process's entry applies it before importing torch (``apply_thread_policy``), and processes
started from it (Ray workers through the runtime env, vLLM's engine processes) inherit it.
"""

from __future__ import annotations

import os
import sys


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


# libgomp (torch's CPU wheels) and Intel's OpenMP (vLLM with libiomp5 preloaded) both read
# OMP_WAIT_POLICY; Intel's spins KMP_BLOCKTIME ms after a region whatever the policy says.
THREAD_POLICY = {"OMP_WAIT_POLICY": "PASSIVE", "KMP_BLOCKTIME": "0"}


def thread_policy_env() -> dict[str, str]:
    """The policy's variables as this process has them (an operator's own values win), for the
    environment of processes it starts: Ray's runtime env, a job's env."""
    return {key: os.environ.get(key, value) for key, value in THREAD_POLICY.items()}


def openmp_loaded() -> bool:
    """Whether an OpenMP runtime is already mapped into this process (then it has read its
    settings and changing the environment no longer reaches it)."""
    try:
        with open("/proc/self/maps") as maps:
            return any("libgomp" in line or "libiomp" in line or "libomp" in line for line in maps)
    except OSError:  # not Linux: torch imported is the nearest sign
        return "torch" in sys.modules


def apply_thread_policy() -> bool:
    """Put the thread policy into this process's environment; call it first thing in a
    process's entry, before torch is imported. Returns whether it reaches this process's own
    OpenMP runtime (False: torch was imported earlier, so only processes started from here get
    it)."""
    reaches = not openmp_loaded()
    for key, value in THREAD_POLICY.items():
        os.environ.setdefault(key, value)
    return reaches
