"""Killing a run's components with kill -9 while it trains (tests/test_survival.py and the
sync-mode loop test): which processes to kill, and the times to a new process and to the next
logged step."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import psutil


def own_processes() -> list[psutil.Process]:
    """This test process's descendants: the Ray clusters it started (their raylets are its
    children, their workers the raylets'), never another pytest worker's (pytest -n runs
    several suites' clusters on one machine at once)."""
    return psutil.Process().children(recursive=True)


def cmdline(proc: psutil.Process) -> list[str]:
    try:
        return proc.cmdline()
    except psutil.Error:  # ended since it was listed
        return []


def _actor_pids(title: str) -> list[int]:
    """Processes of live Ray actors of class ``title`` (Ray titles them ``ray::<Class>...``)."""
    return [p.pid for p in own_processes() if (cmdline(p) or [""])[0].startswith(f"ray::{title}")]


def _wait(predicate, timeout: float, what: str) -> float:
    t0 = time.monotonic()
    while not predicate():
        if time.monotonic() - t0 > timeout:
            raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(0.05)
    return time.monotonic() - t0


def _steps_logged(run_dir: Path) -> int:
    path = run_dir / "metrics.jsonl"
    return len(path.read_text().splitlines()) if path.exists() else 0


@dataclass
class Victim:
    """What to kill -9: ``pids()`` lists the live processes of its kind (a new one appearing
    means it was restarted), ``pick(run_dir)`` the one to kill (default: the first)."""

    name: str
    pids: Callable[[], list[int]]
    pick: Callable[[Path], int] | None = None


def actor(title: str, role: str | None = None) -> Victim:
    """A Ray actor of class ``title``; with ``role``, the first actor of that role in
    placement.json."""
    pick = (lambda d: json.loads((d / "placement.json").read_text())[role][0]["pid"]) if role else None
    return Victim(title, lambda: _actor_pids(title), pick)


def redis_server(run_dir: Path) -> Victim:
    """The run's embedded redis-server, as its server.json names it."""
    def pids() -> list[int]:
        pid = json.loads((run_dir / "redis" / "server.json").read_text())["pid"]
        return [pid] if psutil.pid_exists(pid) else []
    return Victim("redis-server", pids)


def run_killing(cfg, kills: list[Victim]) -> tuple[object, dict[str, tuple[float, float]], Path, list[str]]:
    """Train ``cfg`` in a thread; after step k (k = 1, 2, ...) is logged, kill -9 the k-th
    victim, waiting for a new process of its kind and the next logged step before the next
    kill. Returns (run result, seconds from each kill to a new process and to the next logged
    step, run dir, the driver's stage messages)."""
    from cluster.driver import train

    run_dir = Path(cfg.output_dir) / cfg.name
    out: dict[str, object] = {}
    stages: list[str] = []
    recovery: dict[str, tuple[float, float]] = {}
    def on_stage(message: str) -> None:  # shown as they come (pytest -s): a hung run says how far it got
        stages.append(message)
        print(f"  [run] {message}", flush=True)

    thread = threading.Thread(target=lambda: out.update(result=train(cfg, on_stage=on_stage)))
    thread.start()
    try:
        for step, victim in enumerate(kills, start=1):
            _wait(lambda: _steps_logged(run_dir) >= step or not thread.is_alive(), 300, f"step {step}")
            assert thread.is_alive(), f"the run ended before killing {victim.name} (its error is in the log above)"
            before = victim.pids()
            assert before, f"no {victim.name} process to kill"
            pid = victim.pick(run_dir) if victim.pick else before[0]
            assert pid in before
            killed_at, t_kill = _steps_logged(run_dir), time.monotonic()
            os.kill(pid, signal.SIGKILL)
            restart_s = _wait(lambda: any(p not in before for p in victim.pids()) or not thread.is_alive(), 120,
                              f"{victim.name} to restart")
            assert thread.is_alive(), f"the run ended before {victim.name} was restarted (its error is in the log above)"
            _wait(lambda: _steps_logged(run_dir) > killed_at or not thread.is_alive(), 300, "a step")
            recovery[victim.name] = (restart_s, time.monotonic() - t_kill)
    finally:
        thread.join(timeout=600)
    assert "result" in out, "the run raised (its error is in the log above)"
    return out["result"], recovery, run_dir, stages


def run_until_killed(cfg, victim: Victim, after_step: int) -> tuple[BaseException | None, list[str]]:
    """Train ``cfg`` in a thread and kill -9 ``victim`` once step ``after_step`` is logged, for
    a run that must end because of it; returns (what the run raised, its stage messages)."""
    from cluster.driver import train

    run_dir = Path(cfg.output_dir) / cfg.name
    stages: list[str] = []
    out: dict[str, BaseException | None] = {"error": None}

    def run() -> None:
        try:
            train(cfg, on_stage=stages.append)
        except BaseException as exc:  # noqa: BLE001 - what the test checks
            out["error"] = exc

    thread = threading.Thread(target=run)
    thread.start()
    try:
        _wait(lambda: _steps_logged(run_dir) >= after_step or not thread.is_alive(), 300, f"step {after_step}")
        assert thread.is_alive(), f"the run ended before killing {victim.name}: {out['error']!r}"
        pid = victim.pick(run_dir) if victim.pick else victim.pids()[0]
        os.kill(pid, signal.SIGKILL)
    finally:
        thread.join(timeout=300)
    assert not thread.is_alive(), "the run did not end"
    return out["error"], stages


def trained_once(run_dir: Path, steps: int) -> list[str]:
    """The group ids of trained_groups.jsonl, after checking it has one line per step and no
    group or trajectory twice."""
    trained = [json.loads(line) for line in (run_dir / "trained_groups.jsonl").read_text().splitlines()]
    assert [t["step"] for t in trained] == list(range(1, steps + 1))
    ids = [g for t in trained for g in t["group_ids"]]
    assert len(ids) == len(set(ids)), "a group was trained twice"
    trajectories = [tid for t in trained for tid in t["trajectory_ids"]]
    assert len(trajectories) == len(set(trajectories)), "a trajectory was trained twice"
    return ids


def assert_replay_accounts(replay: dict, trained: list[str]) -> None:
    """Every group replay accepted (``replay``: its final ``ReplayStats`` as a dict) was
    trained once (those of trained_groups.jsonl), evicted with a counted reason, or is still
    held there."""
    assert replay["trained"] == len(trained)
    assert replay["accepted"] == len(trained) + sum(replay["evicted"].values()) + replay["ready"] + replay["claimed"]
