"""The live endpoint under many clients, while the run trains: latency, errors, accounting, memory.

    .venv/bin/python bench/live_load.py [--levels 1,16,64,256] [--seconds 60]
                                        [--soak 600 --soak-sessions 64] [--out runs/live_load] [--quick]

Starts a real run (``turnrl train``: Ray, the HF engine serving the tiny warm-started agent, the
reward actor, in-process replay, the DeepSpeed learner) that trains on live traffic only
(``train.source: live``), then drives its OpenAI-compatible endpoint with ``N`` concurrent
agent loops of the official ``openai`` SDK (``AsyncOpenAI``) for ``--seconds`` at each level.
Each loop plays sessions one after another, each 2-3 requests: the question with the world's
tools, the tool's result (or a nudge) back, sometimes a follow-up. Odd sessions stream. Of every
four sessions one posts feedback and calls ``/end``, one posts feedback only (closed after
``live.close_after_feedback_s``), two do neither (closed after ``live.feedback_timeout_s``).

Per level it prints sessions/s, requests/s, TTFT and inter-chunk latency p50/p99 (streams),
request latency p50/p99 (not streamed), the errors the clients saw by kind, and the gateway's
own counts over the level (``/metrics``: requests by status, sessions closed by cause). A soak
phase (``--soak`` seconds at ``--soak-sessions``) samples every process's RSS (gateway, engine,
reward, replay, learner, driver; ``placement.json``) and prints its growth.

Then the run is stopped (SIGTERM: sessions still open close as ``run_ended``) and every session
the clients were answered is accounted for from the run's ``live_sessions.jsonl``: each answered
session has segments there whose turns equal the requests it was answered, each segment
``recorded`` into replay or counted with its reason; the clients' answered requests equal the
gateway's 200s. The bench exits 1 when any of that fails. Results: ``OUT/live_load.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import subprocess
import sys
import threading
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere

import httpx  # noqa: E402
import openai  # noqa: E402
import psutil  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402
from bench.offline_env import use_offline_env  # noqa: E402
from serving import POLICY_OVERRIDES, build_policy  # noqa: E402

TOKEN = "live-load-token"
CHAT_ROUTE = "/v1/chat/completions"
MAX_TOKENS = 24


@dataclass
class Tally:
    """What the clients saw at one level."""

    sessions: int = 0
    ok: int = 0
    http_200: int = 0
    """Requests answered in full (a stream counts at its end, as the gateway counts it)."""
    errors: Counter = field(default_factory=Counter)
    ttft: list[float] = field(default_factory=list)
    itl: list[float] = field(default_factory=list)
    latency: list[float] = field(default_factory=list)
    answered: Counter = field(default_factory=Counter)
    """session id -> requests answered in full (a complete reply or a stream that finished)."""
    samples: list[str] = field(default_factory=list)
    """The first two messages of each kind of error."""
    error_times: list[tuple[float, str]] = field(default_factory=list)
    """(time.time(), kind) of every error, for the fault phase's time to the first one."""

    def error(self, kind: str) -> None:
        self.errors[kind] += 1
        self.error_times.append((time.time(), kind))


def _error_kind(exc: BaseException) -> str:
    if isinstance(exc, openai.APIStatusError):
        return f"http_{exc.status_code}"
    if isinstance(exc, httpx.HTTPStatusError):  # the session routes (feedback, /end)
        return f"session_route_http_{exc.response.status_code}"
    if isinstance(exc, httpx.HTTPError):
        return f"session_route_{type(exc).__name__}"
    if isinstance(exc, openai.APITimeoutError):
        return "timeout"
    if isinstance(exc, openai.APIConnectionError):
        return "connection"
    if isinstance(exc, openai.APIError):
        return "stream_error_event"
    return type(exc).__name__


async def _streamed(client: openai.AsyncOpenAI, kwargs: dict[str, Any], tally: Tally) -> dict[str, Any] | None:
    """One streamed request: TTFT and inter-chunk gaps; the assembled message, None if it broke."""
    t0 = time.perf_counter()
    stream = await client.chat.completions.create(stream=True, **kwargs)
    last, content, calls, finish = None, "", {}, None
    async for chunk in stream:
        if not chunk.choices:
            continue
        now = time.perf_counter()
        if last is None:
            tally.ttft.append(now - t0)
        else:
            tally.itl.append(now - last)
        last = now
        choice = chunk.choices[0]
        content += choice.delta.content or ""
        for d in choice.delta.tool_calls or []:
            call = calls.setdefault(d.index, {"id": d.id or f"call_{d.index}", "name": "", "arguments": ""})
            call["name"] += (d.function.name or "") if d.function else ""
            call["arguments"] += (d.function.arguments or "") if d.function else ""
        finish = choice.finish_reason or finish
    if finish is None:
        tally.error("stream_truncated")
        return None
    tally.http_200 += 1  # as the gateway counts a stream: once it has ended well
    msg: dict[str, Any] = {"role": "assistant", "content": content or None}
    if calls:
        msg["tool_calls"] = [{"id": c["id"], "type": "function",
                              "function": {"name": c["name"], "arguments": c["arguments"]}}
                             for _, c in sorted(calls.items())]
    return msg


async def _plain(client: openai.AsyncOpenAI, kwargs: dict[str, Any], tally: Tally) -> dict[str, Any]:
    t0 = time.perf_counter()
    reply = await client.chat.completions.create(**kwargs)
    tally.http_200 += 1
    tally.latency.append(time.perf_counter() - t0)
    return reply.choices[0].message.model_dump(exclude_none=True)


def _next_messages(messages: list[dict[str, Any]], msg: dict[str, Any], turn: int) -> list[dict[str, Any]]:
    """The conversation after ``msg``: its tool calls answered (a canned result), else a nudge."""
    out = [*messages, msg]
    for call in msg.get("tool_calls") or []:
        out.append({"role": "tool", "tool_call_id": call["id"], "content": "No result for that query."})
    if not msg.get("tool_calls"):
        out.append({"role": "user", "content": "Search first, then answer." if turn == 0 else "Are you sure?"})
    return out


async def agent_session(client: openai.AsyncOpenAI, http: httpx.AsyncClient, sid: str, i: int, task: Any,
                        tally: Tally) -> None:
    """One session of 2-3 requests; feedback and /end as ``i`` says (module docstring)."""
    headers = {"X-Session-Id": sid}
    messages = list(task.messages)
    turns = 3 if i % 3 == 0 else 2
    try:
        for turn in range(turns):
            kwargs = dict(model="turnrl-policy", messages=messages, tools=task.tools, temperature=0.7,
                          max_tokens=MAX_TOKENS, extra_headers=headers)
            msg = await (_streamed if i % 2 else _plain)(client, kwargs, tally)
            if msg is None:
                return
            tally.answered[sid] += 1
            tally.ok += 1
            messages = _next_messages(messages, msg, turn)
        if i % 4 in (0, 1):
            res = await http.post(f"sessions/{sid}/feedback", json={"outcome": float(i % 3 == 0)})
            res.raise_for_status()
        if i % 4 == 0:
            (await http.post(f"sessions/{sid}/end")).raise_for_status()
        tally.sessions += 1
    except (openai.APIError, httpx.HTTPError) as exc:
        kind = _error_kind(exc)
        if tally.errors[kind] < 2:  # what the first two of each kind said, for the report
            tally.samples.append(f"{kind}: {exc!r} {exc.__cause__!r}"[:400])
        tally.error(kind)


async def drive(base: str, tasks: list[Any], n: int, seconds: float, tag: str,
                longer: Callable[[], bool] = lambda: False, grace: float = 240.0) -> tuple[Tally, float]:
    """``n`` loops of sessions for ``seconds`` (each finishes the session it is in), and on
    while ``longer()`` holds, ``grace`` seconds at most (a fault phase: until its recovery)."""
    tally = Tally()
    limits = httpx.Limits(max_connections=n + 8, max_keepalive_connections=n + 8)
    auth = {"Authorization": f"Bearer {TOKEN}"}
    async with httpx.AsyncClient(limits=limits, timeout=300) as raw, \
            httpx.AsyncClient(base_url=base + "/", headers=auth, timeout=300, limits=limits) as http:
        client = openai.AsyncOpenAI(base_url=base, api_key=TOKEN, http_client=raw, max_retries=0, timeout=300)
        stop = time.perf_counter() + seconds
        counter = iter(range(10**9))

        async def loop(w: int) -> None:
            while time.perf_counter() < stop or (longer() and time.perf_counter() < stop + grace):
                i = next(counter)
                await agent_session(client, http, f"{tag}-{w}-{i}", i, tasks[i % len(tasks)], tally)

        t0 = time.perf_counter()
        await asyncio.gather(*[loop(w) for w in range(n)])
        return tally, time.perf_counter() - t0


def scrape(base: str) -> dict[tuple[str, tuple], float]:
    """The gateway's ``/metrics`` samples: (name, sorted labels) -> value."""
    text = httpx.get(base.removesuffix("/v1") + "/metrics", timeout=30).text
    return {(s.name, tuple(sorted((k, v) for k, v in s.labels.items() if k != "run"))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def gateway_delta(before: dict, after: dict) -> dict[str, dict[str, float]]:
    """Chat requests by status, sessions closed by cause and per-request results (engine_failed
    ...) over a level."""
    out: dict[str, dict[str, float]] = {"requests": {}, "closed": {}, "episodes": {}}
    for (name, labels), value in after.items():
        d = dict(labels)
        diff = value - before.get((name, labels), 0.0)
        if name == "turnrl_gateway_requests_total" and d.get("route") == CHAT_ROUTE and diff:
            out["requests"][d["status"]] = diff
        elif name == "turnrl_gateway_sessions_closed_total" and diff:
            out["closed"][d["cause"]] = diff
        elif name == "turnrl_gateway_episodes_total" and diff:
            out["episodes"][d["result"]] = diff
    return out


def _pct(xs: list[float], q: int) -> float | None:
    if len(xs) < 2:
        return xs[0] if xs else None
    return statistics.quantiles(xs, n=100)[q - 1]


def summary(n: int, tally: Tally, elapsed: float, gateway: dict) -> dict[str, Any]:
    return {"sessions": n, "elapsed_s": round(elapsed, 1), "sessions_done": tally.sessions,
            "sessions_per_s": tally.sessions / elapsed, "requests_ok": tally.ok, "requests_per_s": tally.ok / elapsed,
            "http_200": tally.http_200, "errors": dict(tally.errors), "error_samples": tally.samples,
            **{f"{k}_p{q}_ms": (None if (v := _pct(getattr(tally, k), q)) is None else v * 1e3)
               for k in ("ttft", "itl", "latency") for q in (50, 99)},
            "gateway": gateway}


class Rss:
    """Samples the RSS of the run's processes (``placement.json`` and the driver) every few s."""

    def __init__(self, run_dir: Path, driver_pid: int, every: float = 5.0) -> None:
        roles = json.loads((run_dir / "placement.json").read_text())
        self.pids = {"driver": driver_pid, **{f"{role}{k or ''}": p["pid"] for role, ps in roles.items()
                                               for k, p in enumerate(ps) if p.get("pid")}}
        self.samples: list[tuple[float, dict[str, float]]] = []
        self.every, self._stop = every, threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.every):
            row = {}
            for name, pid in self.pids.items():
                try:
                    row[name] = psutil.Process(pid).memory_info().rss / 2**20
                except psutil.Error:
                    continue
            self.samples.append((time.time(), row))

    def growth(self, t0: float, t1: float, window: float = 60.0) -> dict[str, dict[str, float]]:
        """Per process: mean RSS (MB) over the window after ``t0 + window`` (warm) and the last
        window before ``t1``, and the difference."""
        out = {}
        for name in self.pids:
            early = [r[name] for t, r in self.samples if t0 + window <= t < t0 + 2 * window and name in r]
            late = [r[name] for t, r in self.samples if t1 - window <= t <= t1 and name in r]
            if early and late:
                a, b = statistics.fmean(early), statistics.fmean(late)
                out[name] = {"early_mb": round(a, 1), "late_mb": round(b, 1), "growth_mb": round(b - a, 1),
                             "growth_pct": round(100 * (b - a) / a, 2)}
        return out

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=30)


FAULTS = ("engine", "learner", "redis")


def victim_pid(run_dir: Path, component: str) -> int:
    """The process ``kill -9`` takes: engine 0 or learner rank 0 (placement.json), or the
    run's embedded redis-server (its server.json)."""
    if component == "redis":
        return int(json.loads((run_dir / "redis" / "server.json").read_text())["pid"])
    return int(json.loads((run_dir / "placement.json").read_text())[component][0]["pid"])


def metric(samples: dict, name: str, **labels: str) -> float:
    return sum(v for (n, ls), v in samples.items() if n == name and all(dict(ls).get(k) == x for k, x in labels.items()))


class Fault(threading.Thread):
    """``kill -9`` of ``component`` ``after`` seconds into the fault phase, then its recovery
    watched: engine 0 answering the gateway again after the gateway found it dead (an engine),
    or the engines serving a version two past the one served at the kill (the learner,
    redis-server: a step trained after the kill and published; the first may have been in
    flight)."""

    def __init__(self, component: str, run_dir: Path, base: str, after: float, timeout: float = 240.0) -> None:
        super().__init__(daemon=True)
        self.component, self.run_dir, self.base, self.after, self.timeout = component, run_dir, base, after, timeout
        self.killed_at: float | None = None
        self.recovered_at: float | None = None
        self.info: dict[str, Any] = {"component": component}

    def run(self) -> None:
        time.sleep(self.after)
        pid, before = victim_pid(self.run_dir, self.component), scrape(self.base)
        self.killed_at = time.time()
        os.kill(pid, signal.SIGKILL)
        version = metric(before, "turnrl_gateway_policy_version")
        self.info |= {"pid": pid, "version_at_kill": version}
        answered_at_death = None
        while time.time() < self.killed_at + self.timeout:
            time.sleep(0.25)
            now = scrape(self.base)
            if self.component != "engine":  # +2: a version in flight at the kill is not a new step
                if metric(now, "turnrl_gateway_policy_version") >= version + 2:
                    self.info["version_after"] = metric(now, "turnrl_gateway_policy_version")
                    break
                continue
            calls = {r: metric(now, "turnrl_gateway_engine_calls_total", engine="0", result=r)
                     for r in ("answered", "found_dead")}
            if answered_at_death is None:
                dead = calls["found_dead"] > metric(before, "turnrl_gateway_engine_calls_total", engine="0",
                                                    result="found_dead")
                answered_at_death = calls["answered"] if dead else None
            elif calls["answered"] > answered_at_death:
                self.info |= {"engine_version_after": metric(now, "turnrl_gateway_engine_version", engine="0"),
                              "policy_version_after": metric(now, "turnrl_gateway_policy_version")}
                break
        else:
            return
        self.recovered_at = time.time()

    def report(self, tally: Tally) -> dict[str, Any]:
        """The kill's times and what the clients saw after it."""
        self.join(timeout=self.timeout + self.after)
        after = [(t, k) for t, k in tally.error_times if self.killed_at is not None and t >= self.killed_at]
        return {**self.info, "time_to_first_error_s": round(after[0][0] - self.killed_at, 2) if after else None,
                "errors_after_kill": dict(Counter(k for _, k in after)),
                "time_to_recovery_s": None if self.recovered_at is None else round(self.recovered_at - self.killed_at, 2)}


def run_overrides(out: Path, feedback_timeout_s: float, engines: int = 1, replay: str = "inproc",
                  config: Path | None = None) -> list[str]:
    """The run the bench drives, trained on live sessions only: ``config``'s policy and world, or
    (None) the tiny agent."""
    return [*([] if config else POLICY_OVERRIDES), f"rollout.engine.count={engines}", f"replay.type={replay}", f"output_dir={out}",
            "name=live-load", "live.enabled=true", f"live.tokens=[{TOKEN}]",
            f"live.feedback_timeout_s={feedback_timeout_s}", "live.close_after_feedback_s=2",
            f"live.default_max_tokens={MAX_TOKENS}", "train.source=live", "train.steps=1000000",
            "learner.batch_groups=2", "learner.num_cpus=0.5", "learner.checkpoint_every=0", "eval.num_tasks=0",
            "progress=none"]


def start_run(out: Path, overrides: list[str], config: Path | None = None) -> tuple[subprocess.Popen, Path, str]:
    """``turnrl train [config]`` in a process of its own; returns it, its run folder and its base
    URL (a config's warm start, if not cached, is built first: up to 15 minutes)."""
    run_dir = out / "live-load"
    for name in ("live.json", "placement.json"):
        (run_dir / name).unlink(missing_ok=True)
    cmd = [str(Path(sys.executable).parent / "turnrl"), "train", *([str(config)] if config else []),
           *[a for o in overrides for a in ("--set", o)]]
    out.mkdir(parents=True, exist_ok=True)
    proc = subprocess.Popen(cmd, stdout=(out / "run.log").open("w"), stderr=subprocess.STDOUT)
    deadline = time.time() + 900
    while not ((run_dir / "live.json").exists() and (run_dir / "placement.json").exists()):
        if proc.poll() is not None or time.time() > deadline:
            proc.kill()
            raise SystemExit(f"the run never served its endpoint; see {out / 'run.log'}")
        time.sleep(1.0)
    return proc, run_dir, json.loads((run_dir / "live.json").read_text())["base_url"]


def stop_run(proc: subprocess.Popen) -> int:
    """SIGTERM, as ``ray job stop`` sends: open sessions close as ``run_ended``."""
    proc.send_signal(signal.SIGTERM)
    try:
        return proc.wait(timeout=300)
    except subprocess.TimeoutExpired:
        proc.kill()
        return -9


def account(run_dir: Path, answered: Counter) -> dict[str, Any]:
    """Every answered session against the run's record of what became of its segments."""
    segments: dict[str, list[tuple[str, int]]] = defaultdict(list)
    for line in (run_dir / "live_sessions.jsonl").read_text().splitlines():
        row = json.loads(line)
        traj = row["trajectory"]
        segments[traj["live"]["session_id"]].append((row["replay"], len(traj["turns"])))
    lost = sorted(s for s in answered if s not in segments)
    turns_differ = {s: [answered[s], sum(n for _, n in segments[s])] for s in answered
                    if s in segments and sum(n for _, n in segments[s]) != answered[s]}
    fates = Counter(status for s in answered for status, _ in segments.get(s, []))
    return {"sessions_answered": len(answered), "segments": sum(fates.values()),
            "recorded": fates.pop("accepted", 0), "counted": dict(fates), "lost": lost[:20], "lost_n": len(lost),
            "turns_differ": dict(list(turns_differ.items())[:20]), "turns_differ_n": len(turns_differ),
            "not_answered_but_recorded": len(set(segments) - set(answered))}


def trained(run_dir: Path) -> dict[str, float]:
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()] \
        if (run_dir / "metrics.jsonl").exists() else []
    return {"steps": len(rows), "live_sessions_trained": sum(r.get("live/trained_sessions", 0) for r in rows)}


def print_levels(levels: list[dict[str, Any]]) -> None:
    cols = ("sessions", "sessions_per_s", "requests_per_s", "ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "itl_p99_ms",
            "latency_p50_ms", "latency_p99_ms")
    print("\n" + "".join(f"{c.replace('_ms', ''):>15}" for c in cols) + "   errors (client) | gateway chat requests by status")
    for r in levels:
        cells = "".join(f"{'-' if r[c] is None else (f'{r[c]:.2f}' if isinstance(r[c], float) else r[c]):>15}" for c in cols)
        print(f"{cells}   {r['errors'] or '{}'} | {r['gateway']['requests']}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--levels", default="1,16,64,256", help="concurrent sessions per level, comma-separated")
    p.add_argument("--seconds", type=float, default=60.0, help="length of each level")
    p.add_argument("--soak", type=float, default=600.0, help="seconds of the memory soak (0: none)")
    p.add_argument("--soak-sessions", type=int, default=64, help="concurrent sessions during the soak")
    p.add_argument("--feedback-timeout", type=float, default=30.0, help="live.feedback_timeout_s of the run")
    p.add_argument("--fault", default="", help=f"kill -9 these, one phase each, comma-separated: {', '.join(FAULTS)}")
    p.add_argument("--fault-sessions", type=int, default=16, help="concurrent sessions during a fault phase")
    p.add_argument("--fault-seconds", type=float, default=60.0, help="length of a fault phase (the kill at 1/4)")
    p.add_argument("--engines", type=int, default=1, help="rollout.engine.count of the run (an engine fault: 2)")
    p.add_argument("--replay", choices=("inproc", "redis"), default="inproc",
                   help="replay.type (redis: embedded, a redis fault needs it)")
    p.add_argument("--config", type=Path, default=None,
                   help="a run config whose policy and world to serve (configs/smollm2_search_qa.yaml); default: the tiny agent")
    p.add_argument("--out", type=Path, default=Path("runs/live_load"))
    p.add_argument("--quick", action="store_true", help="levels 1,4 of 8 s, no soak, 30 s fault phases (the tests)")
    args = p.parse_args()
    if args.quick:  # levels given on the command line stay
        args.levels = "1,4" if args.levels == p.get_default("levels") else args.levels
        args.seconds, args.soak, args.feedback_timeout = 8.0, 0.0, 5.0
        args.fault_sessions, args.fault_seconds = 4, 30.0
    levels = [int(x) for x in args.levels.split(",") if x]
    faults = [f for f in args.fault.split(",") if f]
    if any(f not in FAULTS for f in faults) or ("engine" in faults and args.engines < 2) \
            or ("redis" in faults and args.replay != "redis"):
        p.error(f"--fault takes {', '.join(FAULTS)}; an engine fault needs --engines 2 or more, a redis "
                "fault --replay redis")
    use_offline_env()  # the run's processes inherit it
    if args.config is None:
        build_policy()  # cached; the run finds it
    from cluster.config import load_config
    from envs.registry import make_task_source

    world = load_config(str(args.config), []) if args.config else load_config(None, POLICY_OVERRIDES)
    tasks = make_task_source(world.env).tasks("train")
    out = args.out.resolve()
    overrides = run_overrides(out, args.feedback_timeout, args.engines, args.replay, args.config)
    proc, run_dir, base = start_run(out, overrides, args.config)
    print(f"run serving at {base} (load {os.getloadavg()[0]:.2f})", flush=True)
    rss = Rss(run_dir, proc.pid)
    answered: Counter = Counter()
    results, client_200 = [], 0
    try:
        phases = [(n, args.seconds, f"n{n}") for n in levels]
        phases += [(args.fault_sessions, args.fault_seconds, f"fault-{f}") for f in faults]
        phases += [(args.soak_sessions, args.soak, "soak")] if args.soak > 0 else []
        for k, (n, seconds, tag) in enumerate(phases):
            eta = sum(s for _, s, _ in phases[k:])
            print(f"[{k + 1}/{len(phases)}] {tag}: {n} concurrent sessions for {seconds:.0f} s "
                  f"(ETA {eta / 60:.1f} min; load {os.getloadavg()[0]:.2f})", flush=True)
            before, t0 = scrape(base), time.time()
            fault = Fault(tag.removeprefix("fault-"), run_dir, base, seconds / 4) if tag.startswith("fault-") else None
            if fault is not None:
                fault.start()
            tally, elapsed = asyncio.run(drive(base, tasks, n, seconds, tag, fault.is_alive if fault else lambda: False))
            results.append({"tag": tag, **summary(n, tally, elapsed, gateway_delta(before, scrape(base))),
                            "load": os.getloadavg()[0]})
            if fault is not None:
                results[-1]["fault"] = fault.report(tally)
                print(f"  {json.dumps(results[-1]['fault'])}", flush=True)
            if tag == "soak":
                results[-1]["rss"] = rss.growth(t0, time.time())
            answered.update(tally.answered)
            client_200 += tally.http_200
        time.sleep(args.feedback_timeout + 5)  # sessions left without feedback close on their own
        gateway_200 = metric(scrape(base), "turnrl_gateway_requests_total", route=CHAT_ROUTE, status="200")
    finally:
        rss.stop()
        rc = stop_run(proc)
    books = {**account(run_dir, answered), "client_200": client_200, "gateway_200": gateway_200, "run_exit": rc,
             **trained(run_dir)}
    report = {"levels": results, "accounting": books, "rss_series": rss.samples}
    (out / "live_load.json").write_text(json.dumps(report, indent=2, default=str))
    print_levels(results)
    for r in results:
        for name, g in (r.get("rss") or {}).items():
            print(f"rss {name:<10} {g['early_mb']:>8.1f} -> {g['late_mb']:>8.1f} MB ({g['growth_pct']:+.2f}%)")
    print(f"\naccounting: {json.dumps(books)}")
    good = not books["lost_n"] and not books["turns_differ_n"] and client_200 == gateway_200
    print("every answered session accounted for" if good else "ACCOUNTING FAILED", flush=True)
    return 0 if good else 1


if __name__ == "__main__":
    sys.exit(main())
