"""The driver: set up a run, drive it to its step budget, stop it cleanly, report.

Stages: (1) resolve the policy (bootstrap + SFT, cached), (2) start Ray and the actors,
(3) evaluate held-out tasks, (4) train: async (rollout actors run free, admission-controlled)
or sync (collect, then train), (5) final checkpoint, evaluation and plots. A background
actor's failure is re-raised here instead of hanging the loop; Ctrl-C still checkpoints.

``resume=True`` continues the run in the same run directory after a crash: the learner loads
the last checkpoint (weights, optimizer, step, version), the replay store (same run id, so
the same Redis keys) delivers again what was claimed but not checkpointed and drops the
reservations of producers that died, and training goes on to the step budget.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from cluster.config import RunConfig
from cluster.evaluation import EVALS_FILE
from cluster.requirements import check_requirements
from cluster.run_sync import RunSync
from cluster.supervision import Supervisor, resume_replay
from cluster.survival import ComponentDied, LearnerDied, collect, dead_callee

__all__ = ["ComponentDied", "LearnerDied", "NothingToResumeError", "RunResult", "prepare_run_dir", "train"]


@dataclass
class RunResult:
    run_dir: Path
    steps: int
    checkpoint: str | None
    interrupted: bool = False
    eval: dict[str, Any] = field(default_factory=dict)
    timings: dict[str, float] = field(default_factory=dict)
    replay: dict[str, Any] = field(default_factory=dict)
    """Replay's counters at the end (``ReplayStats``): every group it accepted was trained,
    evicted with a reason, refused or is still held."""


class NothingToResumeError(FileNotFoundError):
    """``--resume`` found no checkpointed run in the run directory."""


RUN_STATE_FILES = ("state.json", "metrics.jsonl", "trained_groups.jsonl", "eval_before.json", "live.json",
                   "live_sessions.jsonl", EVALS_FILE)
"""What a fresh start in a used run directory begins again (checkpoints stay on disk)."""


def prepare_run_dir(cfg: RunConfig, resume: bool = False,
                    say: Callable[[str], None] = print) -> tuple[Path, str]:
    """The run directory and run id; a resumed run keeps the id (its Redis keys use it). With
    ``cluster.storage`` a resumed run's files come from storage, a new run's go there."""
    from storage.places import local_dir

    run_dir = (local_dir(cfg.output_dir, "output_dir") / cfg.name).resolve()
    ident = run_dir / "run.json"
    sync = RunSync(cfg, run_dir)
    if resume:
        sync.pull_for_resume()
        if not (run_dir / "state.json").exists() or not ident.exists():
            raise NothingToResumeError(
                f"--resume: {run_dir} holds no checkpointed run (no state.json/run.json); the run "
                "must have saved a checkpoint (learner.checkpoint_every) before it stopped, and "
                "output_dir and name must match it")
        return run_dir, json.loads(ident.read_text())["run_id"]
    run_dir.mkdir(parents=True, exist_ok=True)
    if (run_dir / "state.json").exists():
        say(f"note: {run_dir} holds an earlier run; starting over (turnrl train --resume continues it)")
    for name in RUN_STATE_FILES:
        (run_dir / name).unlink(missing_ok=True)
    sync.forget(RUN_STATE_FILES)
    (run_dir / "config.json").write_text(cfg.model_dump_json(indent=2, by_alias=True))
    run_id = f"{cfg.name}-{uuid.uuid4().hex[:8]}"
    ident.write_text(json.dumps({"run_id": run_id}))
    sync.push("config.json", "run.json")
    return run_dir, run_id


def _train_loop(cfg: RunConfig, actors: Any, monitor: Any, heldout: list[Any], result: RunResult,
                on_stage: Callable[[str], None]) -> int:
    rollouts_run = cfg.train.async_ and cfg.train.source != "live"  # live: served sessions only
    last: dict[str, Any] = {}
    rollout_refs: list[Any] = []  # the supervisor watches this list as the loops start
    supervisor = Supervisor(cfg, actors, rollout_refs, monitor, on_stage)
    supervisor.mark(last)  # rates count from here: not the held-out evaluation before
    rollout_refs += [w.run.remote() for w in actors.rollouts] if rollouts_run else []
    per_worker = -(-cfg.learner.batch_groups // len(actors.rollouts))
    sync = RunSync(cfg, result.run_dir)
    step = result.steps
    while step < cfg.train.steps:
        step += 1
        if not cfg.train.async_:
            t0 = time.perf_counter()
            settle_weights(actors)  # generate with the learner's newest weights, its batch acknowledged
            collect(actors.rollouts, per_worker, supervisor.revive, actors)
            gen_s = time.perf_counter() - t0
        metrics = supervisor.train_step()
        if metrics is None:  # the learner died and was restarted from its last checkpoint
            step = result.steps = supervisor.restarted_at
            continue
        if not cfg.train.async_:
            metrics["time/generate_s"] = gen_s
        metrics["rollout/lost_groups"] = float(supervisor.revive.lost)
        metrics |= supervisor.rates(last)
        # the last step's weights are evaluated once, after the loop (the final report)
        if heldout and cfg.eval.every_steps and step % cfg.eval.every_steps == 0 and step < cfg.train.steps:
            scores = _evaluate(actors, heldout, cfg, record=(result.run_dir, step))
            metrics["eval/success"] = sum(scores.values()) / max(len(scores), 1)
            supervisor.mark(last)  # the next step's rates leave the evaluation out
        monitor.update(metrics)
        sync.push("metrics.jsonl")
        result.steps = step  # kept current so an interrupted run reports how far it got
    return step


def settle_weights(actors: Any) -> None:
    """Wait until the weight sync's push in flight has ended: every engine serves the
    learner's newest version and its batch is acknowledged."""
    import ray

    ray.get(actors.weights.settle.remote())


def train(cfg: RunConfig, on_stage: Callable[[str], None] = print, resume: bool = False) -> RunResult:
    """Run a whole job (or continue a crashed one with ``resume``); returns where its outputs
    are. Actors never outlive the call."""

    from cluster.actors import init_ray, start_actors
    from envs.registry import make_task_source
    from learner.bootstrap import ensure_policy_apart

    t_start = time.time()
    run_dir, run_id = prepare_run_dir(cfg, resume, on_stage)
    source = make_task_source(cfg.env)
    check_requirements(cfg, source)
    on_stage(f"[1/5] policy: {cfg.policy.path}")
    policy = ensure_policy_apart(cfg.policy, cfg.env, show_progress=cfg.progress == "bar",
                                 history_turns=cfg.rollout.history_turns, chat_format=cfg.rollout.chat_format)
    if cfg.learner.lora is not None:  # a target naming no layer of the policy fails before Ray starts
        from learner.lora_check import check_policy  # in a child process: the driver keeps no torch

        check_policy(policy, cfg.learner.lora)
    on_stage(f"[2/5] ray + actors (run {run_id}, dir {run_dir})")
    init_ray(cfg)
    sync = RunSync(cfg, run_dir)
    actors = start_actors(cfg, sync.policy(policy), str(run_dir), run_id, resume=resume, storage_url=sync.url)
    if actors.live_url:
        on_stage(f"live endpoint: {actors.live_url} (OpenAI-compatible; model {cfg.live.model_name!r})")
    result = RunResult(run_dir, 0, None, timings={"setup_s": time.time() - t_start})
    try:
        if resume:
            result.steps = resume_replay(actors, run_dir, on_stage)
        _run_stages(cfg, actors, source.tasks("heldout")[: cfg.eval.num_tasks], result, on_stage)
    finally:
        _stop_gateway(actors)
        result.replay = _final_replay_stats(actors)
        actors.release()
        (run_dir / "live.json").unlink(missing_ok=True)  # the endpoint is gone with the run
    result.timings["total_s"] = time.time() - t_start
    (run_dir / "result.json").write_text(json.dumps(
        {"steps": result.steps, "checkpoint": result.checkpoint, "interrupted": result.interrupted,
         "eval": result.eval, "timings": result.timings, "replay": result.replay}, indent=2))
    sync.push("result.json", "metrics.jsonl")
    return result


def _final_replay_stats(actors: Any) -> dict[str, Any]:
    """Best effort (the run may be ending because replay died): its counters, or {}."""
    import dataclasses

    import ray

    try:
        return dataclasses.asdict(ray.get(actors.replay.stats.remote(), timeout=30))
    except Exception:  # noqa: BLE001 - an account of the end, never a reason to fail it
        return {}


def _stop_gateway(actors: Any) -> None:
    """Let the live endpoint finish the requests it is answering (it stops accepting new ones)
    before the engines under it go away."""
    import ray

    if actors.gateway is None:
        return
    try:
        ray.get(actors.gateway.stop.remote(), timeout=30)
    except Exception:  # noqa: BLE001 - killed next anyway; a dead gateway has nothing to drain
        pass


def _run_stages(cfg: RunConfig, actors: Any, heldout: list[Any], result: RunResult,
                on_stage: Callable[[str], None]) -> None:
    from cluster.progress import RunMonitor
    from cluster.reporting import final_report

    before = _evaluate_before(cfg, actors, heldout, result.run_dir, on_stage)
    on_stage(f"[4/5] training {cfg.train.steps} steps ({'async' if cfg.train.async_ else 'sync'})")
    monitor = RunMonitor(result.run_dir, cfg.train.steps, cfg.progress, initial=result.steps)
    t_train = time.time()
    try:
        result.steps = _train_loop(cfg, actors, monitor, heldout, result, on_stage)
    except KeyboardInterrupt:
        result.interrupted = True
        on_stage("interrupted: stopping rollouts and saving a checkpoint ...")
    finally:
        monitor.close()
        for w in actors.rollouts:
            w.stop.remote()
        # A step still waiting for a batch (the loop failed under it) would hold the
        # checkpoint queued behind it for learner.claim_timeout_s.
        actors.learner.interrupt()
        result.timings["train_s"] = time.time() - t_train
        result.checkpoint = _final_checkpoint(actors, on_stage)
        if result.checkpoint is not None:  # a step the learner ended as the driver stopped counts
            result.steps = actors.learner.get("get_step")
    if heldout and not result.interrupted:
        on_stage("[5/5] held-out evaluation after training")
        after = _evaluate(actors, heldout, cfg, bar=True, record=(result.run_dir, result.steps))
        result.eval = final_report(cfg, result.run_dir, before, after, on_stage)


def _evaluate_before(cfg: RunConfig, actors: Any, heldout: list[Any], run_dir: Path,
                     on_stage: Callable[[str], None]) -> dict[str, float]:
    """Held-out success of the starting policy; a resumed run reuses its first measurement."""
    saved = run_dir / "eval_before.json"
    if not heldout:
        return {}
    if saved.exists():
        on_stage("[3/5] held-out evaluation before training: from the run's start (eval_before.json)")
        return json.loads(saved.read_text())
    on_stage(f"[3/5] held-out evaluation before training ({len(heldout)} tasks)")
    before = _evaluate(actors, heldout, cfg, bar=True, record=(run_dir, 0))
    saved.write_text(json.dumps(before))
    RunSync(cfg, run_dir).push("eval_before.json")
    return before


def _final_checkpoint(actors: Any, on_stage: Callable[[str], None]) -> str | None:
    """Save a checkpoint if the learner is alive; never mask the error that stopped the run."""

    try:
        path = actors.learner.get("save_checkpoint")
    except Exception as exc:  # noqa: BLE001 - the learner itself may be what failed
        callee = dead_callee(exc, actors)
        why = f"the {callee} it saves through died" if callee else f"the learner is unavailable ({type(exc).__name__})"
        on_stage(f"no final checkpoint: {why}; the last periodic checkpoint (learner.checkpoint_every) "
                 "is in checkpoints/")
        return None
    on_stage(f"checkpoint: {path}")
    return path


def _evaluate(actors: Any, tasks: list[Any], cfg: RunConfig, bar: bool = False,
              record: tuple[Path, int] | None = None) -> dict[str, float]:
    """Held-out success per task; ``bar``: a progress bar when the run shows bars (not for
    the evaluations between steps, which would break the training bar). Once the engines
    serve the learner's newest weights. ``record``: (run dir, step) keeps the rows
    (``cluster.evaluation.EVALS_FILE``)."""
    from cluster.evaluation import evaluate

    settle_weights(actors)
    return evaluate(actors.rollouts, tasks, cfg.eval, show_progress=bar and cfg.progress == "bar", record=record)
