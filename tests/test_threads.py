"""The thread policy (rollout.cores): torch's OpenMP workers sleep when a parallel region ends
instead of spinning, in a process whose entry applied it, and it reaches processes started
from there; applied after torch loaded OpenMP, it says it came too late."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# 100 small matmuls on 2 threads with 5 ms of idle Python between them (a tiny model's step is
# full of such gaps): the work itself takes ~0.04 s of CPU; spinning workers add ~5 ms a gap.
SCRIPT = """
import sys, time
sys.path.insert(0, {root!r})
from rollout.cores import apply_thread_policy
if {apply}:
    assert apply_thread_policy() is True  # before torch: it reaches this process
import torch
if {apply}:
    assert apply_thread_policy() is False  # OpenMP is loaded now: too late for this process
torch.set_num_threads(2)
x = torch.randn(256, 256)
for _ in range(5):
    x @ x
cpu = time.process_time()
for _ in range(100):
    x @ x
    time.sleep(0.005)
print(time.process_time() - cpu)
"""


def _cpu_seconds(apply: bool, env: dict[str, str]) -> float:
    out = subprocess.run([sys.executable, "-c", SCRIPT.format(root=str(ROOT), apply=apply)],
                         capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    return float(out.stdout.split()[-1])


def test_openmp_workers_sleep_between_regions_under_the_policy() -> None:
    # Without LD_PRELOAD too: vLLM's CPU platform adds torch's libgomp to this process's
    # LD_PRELOAD (after an earlier vLLM test in the session), and a child that preloads OpenMP
    # has it loaded before its first line, so the policy could not reach it first.
    base = {k: v for k, v in os.environ.items()
            if k not in ("OMP_WAIT_POLICY", "KMP_BLOCKTIME", "GOMP_SPINCOUNT", "LD_PRELOAD")}
    policy = _cpu_seconds(True, base)
    # libgomp's default (OMP_WAIT_POLICY unset; "" reads as unset): spin ~300k times a barrier
    spinning = _cpu_seconds(False, {**base, "OMP_WAIT_POLICY": ""})
    # measured on 2 cores: ~0.04 s under the policy, 0.6-0.8 s spinning
    assert policy < 0.25, f"{policy:.3f} s of CPU under the policy (spinning: {spinning:.3f} s)"
    assert policy < spinning / 2, f"policy {policy:.3f} s against {spinning:.3f} s spinning"


def test_the_policy_is_in_the_environment_of_what_this_process_starts() -> None:
    from rollout.cores import THREAD_POLICY, thread_policy_env

    # conftest applied it before torch loaded; children inherit it, Ray gets thread_policy_env()
    assert {k: os.environ[k] for k in THREAD_POLICY} == {"OMP_WAIT_POLICY": "PASSIVE", "KMP_BLOCKTIME": "0"}
    assert thread_policy_env() == THREAD_POLICY
