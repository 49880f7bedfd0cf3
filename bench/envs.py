"""Environment throughput with a scripted policy, and the sandbox's cost per tool call.

    .venv/bin/python bench/envs.py [--quick] [--tasks N] [--calls N]

For each built-in environment, the scripted expert (each task's demonstration, built before
timing starts) plays N training tasks through a fresh environment instance per episode, and
every ``step`` is timed on its own. It prints steps/s, p50/p99 ms per step and the expert's
success rate (which must be 1.0: the bench doubles as a check of the demonstrations).

Tool overhead: the same tool calls run in the sandbox (a fresh limited ``python -I -S``
process per call, as tool_use does) and in-process (the tool source exec'd once, the function
called directly), interleaved call by call so both see the same machine load; the difference
is the overhead per call, and their ratio is printed.

Targets (the environments' design goal): under 5 ms per search step, under 20 ms per sandboxed
tool call (p50).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere

from envs.base import Task, TaskSource  # noqa: E402
from envs.config import HouseholdConfig, SearchQAConfig, ToolUseConfig  # noqa: E402
from envs.registry import make_task_source  # noqa: E402
from envs.tool_use.sandbox import Limits, run_tool  # noqa: E402

TARGET_MS = {"search_qa": 5.0, "sandboxed tool call": 20.0}


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def play(source: TaskSource, task: Task, actions: list[str]) -> tuple[list[float], bool]:
    """Step times (s) of one scripted episode and whether it succeeded."""
    env = source.make_env()
    await env.reset(task)
    times, answer = [], None
    for action in actions:
        t0 = time.perf_counter()
        result = await env.step(action)
        times.append(time.perf_counter() - t0)
        if result.done:
            answer = result.answer
            break
    env.close()
    return times, source.success(task, answer)


def bench_env(name: str, source: TaskSource, n_tasks: int) -> dict[str, Any]:
    tasks = source.tasks("train")[:n_tasks]
    scripts = [[m["content"] for m in source.demonstration(t) if m["role"] == "assistant"]
               for t in tasks]
    t0 = time.perf_counter()
    step_times, wins = [], 0
    for task, actions in zip(tasks, scripts):
        times, ok = asyncio.run(play(source, task, actions))
        step_times += times
        wins += ok
    wall = time.perf_counter() - t0
    ms = [t * 1000 for t in step_times]
    return {"env": name, "episodes": len(tasks), "steps": len(ms),
            "steps_per_s": len(ms) / sum(step_times), "episodes_per_s": len(tasks) / wall,
            "p50_ms": statistics.median(ms), "p99_ms": percentile(ms, 0.99),
            "expert_success": wins / len(tasks)}


def tool_calls(source: TaskSource, n_calls: int) -> list[tuple[str, str, dict[str, Any]]]:
    """(source, name, arguments) of the gold calls of training tasks, up to ``n_calls``."""
    out = []
    for task in source.tasks("train"):
        functions = task.metadata["functions"]
        out += [(functions[c.name], c.name, c.arguments) for c in task.gold_tool_calls or []]
        if len(out) >= n_calls:
            return out[:n_calls]
    return out


def bench_tool_overhead(source: TaskSource, n_calls: int) -> dict[str, float]:
    limits = Limits()
    sandboxed, direct = [], []
    for code, name, args in tool_calls(source, n_calls):
        t0 = time.perf_counter()
        outcome = run_tool([code], name, args, limits)
        t1 = time.perf_counter()
        namespace: dict[str, Any] = {}
        exec(compile(code, "<tool source>", "exec"), namespace)  # noqa: S102 - trusted built-ins
        t2 = time.perf_counter()
        expected = namespace[name](**args)
        t3 = time.perf_counter()
        if not outcome.ok or outcome.result != expected:
            raise RuntimeError(f"{name}{args}: sandbox gave {outcome}, in-process {expected!r}")
        sandboxed.append((t1 - t0) * 1000)
        direct.append((t3 - t2) * 1000)
    p50_s, p50_d = statistics.median(sandboxed), statistics.median(direct)
    return {"calls": len(sandboxed), "sandbox_p50_ms": p50_s, "sandbox_p99_ms": percentile(sandboxed, 0.99),
            "direct_p50_ms": p50_d, "overhead_p50_ms": p50_s - p50_d,
            "ratio": p50_s / max(p50_d, 1e-6)}


def verdict(value: float, target: float) -> str:
    return f"{'ok' if value < target else 'OVER'} (target < {target:g} ms)"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="30 tasks and 30 tool calls")
    parser.add_argument("--tasks", type=int, default=300, help="scripted episodes per environment")
    parser.add_argument("--calls", type=int, default=200, help="tool calls for the overhead measurement")
    args = parser.parse_args(argv)
    n_tasks, n_calls = (30, 30) if args.quick else (args.tasks, args.calls)
    sources = {"search_qa": make_task_source(SearchQAConfig()),
               "tool_use": make_task_source(ToolUseConfig()),
               "household": make_task_source(HouseholdConfig())}
    print(f"{'env':<10} {'episodes':>8} {'steps':>6} {'steps/s':>9} {'p50 ms':>8} {'p99 ms':>8} "
          f"{'expert success':>14}")
    rows = []
    for name, source in sources.items():
        row = bench_env(name, source, n_tasks)
        rows.append(row)
        print(f"{name:<10} {row['episodes']:>8} {row['steps']:>6} {row['steps_per_s']:>9.1f} "
              f"{row['p50_ms']:>8.2f} {row['p99_ms']:>8.2f} {row['expert_success']:>14.2f}")
    tools = bench_tool_overhead(sources["tool_use"], n_calls)
    print(f"\ntool calls ({tools['calls']}, interleaved): sandbox p50 {tools['sandbox_p50_ms']:.1f} ms "
          f"(p99 {tools['sandbox_p99_ms']:.1f}), in-process p50 {tools['direct_p50_ms']:.4f} ms; "
          f"overhead {tools['overhead_p50_ms']:.1f} ms per call, sandbox/in-process ratio "
          f"{tools['ratio']:.0f}x")
    search = next(r for r in rows if r["env"] == "search_qa")
    print(f"search step p50 {search['p50_ms']:.2f} ms: {verdict(search['p50_ms'], TARGET_MS['search_qa'])}")
    print(f"sandboxed tool call p50 {tools['sandbox_p50_ms']:.1f} ms: "
          f"{verdict(tools['sandbox_p50_ms'], TARGET_MS['sandboxed tool call'])}")
    return 0 if all(r["expert_success"] == 1.0 for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
