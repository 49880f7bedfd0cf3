"""What the driver does when one of a run's processes dies, and how it names which one.

Restarted inside the run: rollout actors (``RolloutReviver``: their reservations given back,
their loop started again), the learner (from its last checkpoint, ``cluster.supervision.restart_learner``),
the weight sync (the learner publishes its current weights to the new one) and the replay
host of Redis replay (the groups are in Redis; callers' calls wait for it and are re-sent).
Engines, environment actors and the reward front are restarted by Ray alone; their callers
handle the calls that failed.

Naming: a call on actor A that fails with ``RayActorError`` means A's process died, unless
the error is also a ``RayTaskError``: then A ran, and raised the ``RayActorError`` of a call
*it* made into actor B (Ray's exception class carries both). ``dead_callee`` finds B, so a
learner whose replay host died is never restarted as if it had died itself. The replay host
and the weight sync are also watched directly: each holds a ``vigil`` call from the driver that
fails the moment its process dies (``Vigils``), whether or not anyone was calling it.
"""

from __future__ import annotations

import time
from typing import Any, Callable

SERVICE_RESTART_TIMEOUT_S = 120.0
"""How long a restarted replay host or weight sync may take to answer again."""
WAITING_NOTE_S = 30.0
"""How often a long wait for a restarted actor says so in the run's log."""


class LearnerDied(RuntimeError):
    """A learner rank's process is gone (killed, its node lost), as opposed to an error the
    learner raised: the run restarts the learner from its last checkpoint."""


class ComponentDied(RuntimeError):
    """A component the run cannot restart (or whose restarts are used up) died: the run ends
    with this error, naming it."""


def actor_names(actors: Any) -> dict[str, str]:
    """Actor id (hex) -> the component's name in messages, for every actor of the run."""
    named = [("replay host", actors.replay), ("weight sync", actors.weights), ("reward front", actors.reward),
             *[(f"engine {i}", e) for i, e in enumerate(actors.engines)],
             *[(f"rollout worker {i}", w) for i, w in enumerate(actors.rollouts)],
             *[(f"environment actor {i}", h) for i, h in enumerate(actors.envs)],
             *[(f"learner rank {i}", r) for i, r in enumerate(actors.learner.ranks)],
             *([("live gateway", actors.gateway)] if actors.gateway is not None else [])]
    return {handle._actor_id.hex(): name for name, handle in named}


def dead_callee(exc: BaseException, actors: Any) -> str | None:
    """The component whose death made an actor's call fail, when the actor itself lives (it
    raised a ``RayActorError`` of a call it made); None when the called actor itself died."""
    import ray

    if not isinstance(exc, ray.exceptions.RayTaskError):
        return None
    cause = getattr(exc, "cause", None)
    if not isinstance(cause, ray.exceptions.RayActorError):
        return None
    return actor_names(actors).get(cause.actor_id or "", f"actor {cause.actor_id}")


def wait_restarted(actor: Any, timeout_s: float, method: str = "stats",
                   waiting: Callable[[float], None] | None = None) -> None:
    """Until ``actor`` answers ``method`` again, at most ``timeout_s``: while Ray restarts it, a
    call fails at once with ActorUnavailableError (then it is asked again) or waits for the
    new process (a node with its resources may still be joining, and the process has to start:
    the wait goes on with the same call). ``waiting(seconds so far)`` is called every
    ``WAITING_NOTE_S`` meanwhile, so a long restart shows in the run's log."""
    import ray

    start = time.monotonic()
    deadline, note = start + timeout_s, start + WAITING_NOTE_S
    ref = None
    while True:
        ref = getattr(actor, method).remote() if ref is None else ref
        now = time.monotonic()
        try:
            ray.get(ref, timeout=max(min(deadline, note) - now, 0.1))
            return
        except ray.exceptions.ActorUnavailableError:
            ref = None
            time.sleep(0.2)
        except ray.exceptions.GetTimeoutError:
            pass  # queued until the new process runs: keep waiting on it
        now = time.monotonic()
        if now >= deadline:
            raise TimeoutError(f"not restarted within {timeout_s:.0f}s")
        if now >= note:
            note = now + WAITING_NOTE_S
            if waiting is not None:
                waiting(now - start)


class Vigils:
    """One ``vigil`` call on the replay host and on the weight sync that never returns
    while it lives (made without retries, so it fails when the process dies). ``watch`` waits
    on them beside the learner's step; ``revive`` handles a death: a restartable service is
    waited for and set up again, anything else ends the run naming it."""

    SERVICES = {"replay": "replay host", "weights": "weight sync"}

    def __init__(self, cfg: Any, actors: Any, on_stage: Callable[[str], None]) -> None:
        self.cfg, self.actors, self.on_stage = cfg, actors, on_stage
        self.restarts = dict.fromkeys(self.SERVICES, 0)
        self.refs: dict[Any, str] = {self._start(s): s for s in self.SERVICES}
        # Engines are watched only where they are not restarted: on the broadcast transport the
        # learner's next send would otherwise wait out the group's timeout before failing.
        if cfg.rollout.weights.transport == "broadcast":
            self.refs |= {e.vigil.options(max_task_retries=0).remote(): f"engine {i}"
                          for i, e in enumerate(actors.engines)}

    def _start(self, service: str) -> Any:
        return getattr(self.actors, service).vigil.options(max_task_retries=0).remote()

    def revive(self, ref: Any) -> None:
        """``ref`` (a vigil) returned: its service died. Restart it, or raise ComponentDied."""
        import ray

        service = self.refs.pop(ref)
        name = self.SERVICES.get(service, service)
        try:
            ray.get(ref)
        except ray.exceptions.RayActorError as exc:
            cause = type(exc).__name__
        else:
            raise RuntimeError(f"the {name}'s vigil returned; it never should")
        if service not in self.SERVICES:
            raise ComponentDied(f"{name} died ({cause}): {_BROADCAST_ENGINE}")
        limit = self.cfg.cluster.service_max_restarts
        if service == "replay" and self.cfg.replay.type != "redis":
            raise ComponentDied(
                f"replay host died ({cause}): in-process replay (replay.type=memory) held its groups in "
                "that process, so it is not restarted and the run stops; `turnrl train --resume` continues "
                "from the last checkpoint, and replay.type=redis survives a host restart")
        if self.restarts[service] >= limit:
            raise ComponentDied(f"{name} died ({cause}); cluster.service_max_restarts={limit} restarts used up")
        self.restarts[service] += 1
        t0 = time.monotonic()
        try:
            wait_restarted(getattr(self.actors, service), SERVICE_RESTART_TIMEOUT_S,
                           "stats" if service == "replay" else "version")
        except (ray.exceptions.RayActorError, TimeoutError) as exc:
            raise ComponentDied(f"{name} died ({cause}) and was not restarted ({type(exc).__name__}: {exc})") from exc
        self._after(service, name, cause, time.monotonic() - t0)
        self.refs[self._start(service)] = service

    def died(self, exc: BaseException, timeout_s: float = 30.0) -> None:
        """A call the driver made itself failed with ``exc`` (a ``RayActorError``): the callee
        is dead. A watched service is revived as its vigil would have it (or the run ends
        naming it, as there); any other component of the run ends it, named."""
        import ray

        dead = getattr(exc, "actor_id", None)
        name = actor_names(self.actors).get(dead or "", f"actor {dead}")
        for ref, service in list(self.refs.items()):
            if self.SERVICES.get(service, service) == name:  # a service, or a watched engine
                ray.wait([ref], timeout=timeout_s)  # its vigil fails as soon as Ray sees the death
                self.revive(ref)
                return
        raise ComponentDied(f"{name} died ({type(exc).__name__}) under the driver's call") from exc

    def _after(self, service: str, name: str, cause: str, restart_s: float) -> None:
        import ray

        from cluster.actors import after_restart

        if service == "weights":
            try:
                version = ray.get(self.actors.learner.leader.republish.options(concurrency_group="control").remote())
                what = f"the learner published version {version} to it again"
            except ray.exceptions.RayActorError:
                # The learner died too, before this was seen: its own restart (the step's watch
                # raises LearnerDied next) publishes its checkpoint's weights to the new sync.
                what = "the learner died meanwhile; restarted, it publishes to it"
        else:
            what = "its groups were in Redis"
        after_restart(self.cfg, self.actors)
        self.on_stage(f"{name} died ({cause}): restarted in {restart_s:.1f}s; {what} "
                      f"(restart {self.restarts[service]} of {self.cfg.cluster.service_max_restarts})")


_BROADCAST_ENGINE = ("engines on the broadcast weight transport are not restarted: a new process cannot join "
                     "the group its peers formed with the learner (rollout.weights.transport=object_store or "
                     "file restarts them)")


def dead_engines(actors: Any, timeout_s: float = 10.0) -> list[int]:
    """Indexes of the run's engines whose process is gone for good (asked after a step
    failed: an engine on the broadcast weight transport is never restarted, and the learner's
    broadcast to it is what fails)."""
    import ray

    dead = []
    for i, engine in enumerate(actors.engines):
        try:
            ray.get(engine.version.remote(), timeout=timeout_s)
        except ray.exceptions.ActorDiedError:
            dead.append(i)
        except Exception:  # noqa: BLE001 - restarting or busy: not a death this names
            pass
    return dead


def name_engine_death(cfg: Any, actors: Any, exc: BaseException) -> ComponentDied | None:
    """The error that ends the run when a learner step failed because an engine died (None
    when every engine lives)."""
    dead = dead_engines(actors)
    if not dead:
        return None
    why = (_BROADCAST_ENGINE if cfg.rollout.weights.transport == "broadcast"
           else f"rollout.engine.max_restarts={cfg.rollout.engine.max_restarts} restarts used up")
    names = ", ".join(f"engine {i}" for i in dead)
    return ComponentDied(f"{names} died and the learner's step failed ({type(exc).__name__}): {why}")


def watch(refs: list[Any], rollout_refs: list[Any], actors: Any,
          revive: Callable[[int, Exception], bool] | None = None, vigils: Vigils | None = None) -> Any:
    """Wait for ``refs`` (one call on every learner rank) and return the first's result; a
    rank that fails raises at once (the others would wait for it in a collective), as does a
    rollout actor's loop that ends first, unless its actor died and ``revive(index, error)``
    restarts its loop (replacing ``rollout_refs[index]``). A vigil that returns has its
    service revived (or the run ends naming it)."""
    import ray

    pending = list(refs)
    while pending:
        watched = [*pending, *rollout_refs, *(vigils.refs if vigils else [])]
        ready = ray.wait(watched, num_returns=1)[0][0]
        if vigils is not None and ready in vigils.refs:
            vigils.revive(ready)
        elif ready in pending:
            _learner_answer(ready, refs.index(ready), actors)
            pending.remove(ready)
        else:
            _rollout_ended(ready, rollout_refs.index(ready), actors, revive)
    return ray.get(refs[0])


def _learner_answer(ref: Any, rank: int, actors: Any) -> None:
    """Raise what a rank's step raised, as LearnerDied when its process died and as
    ComponentDied when a component it called died."""
    import ray

    try:
        ray.get(ref)
    except ray.exceptions.RayActorError as exc:
        callee = dead_callee(exc, actors)
        if callee is None:
            raise LearnerDied(f"learner rank {rank} died ({type(exc).__name__})") from exc
        raise ComponentDied(f"{callee} died (learner rank {rank}'s call into it failed: "
                            f"{type(exc.cause).__name__})") from exc


def _rollout_ended(ref: Any, idx: int, actors: Any, revive: Callable[[int, Exception], bool] | None) -> None:
    """A rollout actor's loop ended before the step: revive it if its process died, else
    raise (naming the component whose death failed it, if that is what happened)."""
    import ray

    try:
        ray.get(ref)
    except ray.exceptions.RayActorError as exc:
        callee = dead_callee(exc, actors)
        if callee is not None:
            raise ComponentDied(f"{callee} died (rollout worker {idx}'s call into it failed: "
                                f"{type(exc.cause).__name__})") from exc
        if revive is not None and revive(idx, exc):
            return
        raise RuntimeError(f"rollout worker {idx} died: {exc}") from exc
    except Exception as exc:
        raise RuntimeError(f"rollout worker {idx} failed: {exc}") from exc
    raise RuntimeError(f"rollout worker {idx} stopped producing unexpectedly")


def collect(rollouts: list[Any], per_worker: int, revive: "RolloutReviver", actors: Any) -> None:
    """A sync step's generation: ``per_worker`` groups from every rollout actor; one that dies
    is restarted by ``revive`` and asked again (what it had generated is lost and counted)."""
    import ray

    refs = {i: w.collect.remote(per_worker) for i, w in enumerate(rollouts)}
    while refs:
        idx, ref = next(iter(refs.items()))
        try:
            ray.get(ref)
        except ray.exceptions.RayActorError as exc:
            callee = dead_callee(exc, actors)
            if callee is not None:
                raise ComponentDied(f"{callee} died (rollout worker {idx}'s call into it failed)") from exc
            if not revive(idx, exc):
                raise RuntimeError(f"rollout worker {idx} died: {exc}") from exc
            refs[idx] = rollouts[idx].collect.remote(per_worker)
            continue
        del refs[idx]


class RolloutReviver:
    """What ``watch`` (async) and ``collect`` (sync) do when a rollout actor dies: give back
    the reservations of the groups it had in flight (they are lost, and counted in ``lost``),
    wait for the actor Ray restarts and, in an async run, start its loop again; at most
    ``rollout.max_restarts`` times per actor."""

    def __init__(self, cfg: Any, actors: Any, rollout_refs: list[Any], on_stage: Callable[[str], None]):
        self.cfg, self.actors, self.refs, self.on_stage = cfg, actors, rollout_refs, on_stage
        self.restarts = [0] * len(actors.rollouts)
        self.lost = 0

    def __call__(self, idx: int, exc: Exception) -> bool:
        import ray

        from cluster.actors import after_restart, producer_id

        if self.restarts[idx] >= self.cfg.rollout.max_restarts:
            return False
        self.restarts[idx] += 1
        t0 = time.monotonic()
        lost = ray.get(self.actors.replay.release_producer.remote(producer_id(idx)))
        limit = self.cfg.rollout.restart_timeout_s
        try:
            wait_restarted(self.actors.rollouts[idx], limit, waiting=lambda s: self.on_stage(
                f"rollout worker {idx} died ({type(exc).__name__}): Ray is restarting it ({s:.0f}s so far, up to "
                f"rollout.restart_timeout_s={limit:.0f}; a node with its resources may still be joining)"))
        except TimeoutError as timeout:
            raise RuntimeError(f"rollout worker {idx} died and was {timeout} (rollout.restart_timeout_s): no node "
                               f"with its resources {self.cfg.rollout.resources or '{}'} took it back") from exc
        if self.refs:  # async: its generation loop; a sync step asks the actor again itself
            self.refs[idx] = self.actors.rollouts[idx].run.remote()
        after_restart(self.cfg, self.actors)
        self.lost += lost
        self.on_stage(f"rollout worker {idx} died ({type(exc).__name__}): restarted in "
                      f"{time.monotonic() - t0:.1f}s; {lost} groups it had in flight lost, their reservations released")
        return True
