"""One multi-turn episode: engine and environment alternate, tokens are appended, never rebuilt.

The next prompt is always the kept ids (prompt, sampled actions, earlier observations) plus the
template's delta for the new messages (``rollout.chat.observation_ids``), also with templates
that re-render history (Qwen3's drops earlier ``<think>`` blocks): the learner trains on exactly
the tokens the engine saw and sampled.

Each action is sampled from the opening prompt plus the episode so far, or, with
``history_turns=k``, plus only the last k turns: contexts stay bounded however long the
episode runs, and each turn records where its context began (``Turn.context_start``).

An exception from the environment (or the engine) ends only this episode: the trajectory comes
back with ``finish_reason="error"`` and the error text, and the run goes on.
"""

from __future__ import annotations

import time
import traceback
import uuid
from dataclasses import dataclass, replace

from envs.formats import DEFAULT_FORMAT
from envs.base import Environment, Task
from rollout import chat
from rollout.config import RolloutConfig
from rollout.engines.base import SamplingParams
from rollout.engines.client import EngineClient
from rollout.trajectory import Trajectory, Turn, window_start

_MIN_TURN_BUDGET = 4


def sampling_params(cfg: RolloutConfig, temperature: float | None = None) -> SamplingParams:
    """The run's sampling settings for one action (``temperature`` overrides, e.g. for
    evaluation)."""
    return SamplingParams(temperature=cfg.temperature if temperature is None else temperature,
                          top_p=cfg.top_p, max_new_tokens=cfg.max_new_tokens)


async def run_episode(
    engine: EngineClient,
    env: Environment,
    task: Task,
    params: SamplingParams,
    *,
    group_id: str,
    max_context_tokens: int,
    history_turns: int | None = None,
    chat_format: str = DEFAULT_FORMAT,
) -> Trajectory:
    """Play ``task`` to the end (answer, turn limit, context limit or error). Each action
    sees the prompt and the last ``history_turns`` turns (None: all). ``chat_format``: the
    policy's (``envs.formats``): how its prompt shows tools and how its actions are read."""
    tok = engine.tokenizer
    traj = Trajectory(
        trajectory_id=uuid.uuid4().hex, task_id=task.task_id, group_id=group_id, prompt_ids=[],
        gold_answers=task.gold_answers, gold_tool_calls=task.gold_tool_calls,
    )
    timings = {"generate": 0.0, "env": 0.0}
    try:
        env.chat_format = chat_format
        obs = await env.reset(task)
        # An environment that shows its opening observation only on reset (an external server's)
        # returns it as messages; the built-in ones put it in task.messages and return none.
        traj.prompt_ids = chat.prompt_ids(tok, [*task.messages, *obs.messages], task.tools, chat_format)
        window = _Window(max_context_tokens, history_turns, chat_format)
        await _play(engine, env, traj, obs.anchor, params, window, timings)
    except Exception as exc:  # noqa: BLE001 - one broken episode must not stop the run
        traj.finish_reason = "error"
        traj.error = f"{type(exc).__name__}: {exc}\n{traceback.format_exc(limit=3)}"
    finally:
        env.close()
    traj.timings = timings
    return traj


@dataclass(frozen=True)
class _Window:
    max_tokens: int
    history_turns: int | None
    chat_format: str = DEFAULT_FORMAT


async def _play(engine: EngineClient, env: Environment, traj: Trajectory, anchor: str,
                params: SamplingParams, window: _Window, timings: dict[str, float]) -> None:
    tok = engine.tokenizer
    for t in range(env.max_turns):
        start = window_start(t, window.history_turns)
        context = traj.context_ids(start, t)
        budget = min(params.max_new_tokens, window.max_tokens - len(context))
        if budget < _MIN_TURN_BUDGET:
            traj.finish_reason = "max_tokens"
            return
        t0 = time.perf_counter()
        # One session per episode: its turns go to one engine, whose prefix cache holds the
        # context so far (each turn prefills only its new tokens)
        comp = await engine.generate(context, replace(params, max_new_tokens=budget),
                                     session_id=traj.trajectory_id)
        t1 = time.perf_counter()
        text = chat.decode_action(tok, comp.token_ids, window.chat_format)
        step = await env.step(text)
        timings["generate"] += t1 - t0
        timings["env"] += time.perf_counter() - t1
        turn = Turn.sampled(
            comp, anchor_observation=anchor, tool_calls=step.tool_calls, invalid_action=step.invalid_action,
            rewards={"env": float(step.reward)}, text=text, context_start=start,
        )
        if "label" in step.info:
            traj.labels = [*(traj.labels or []), int(step.info["label"])]
        traj.turns.append(turn)
        if step.done:
            traj.answer = step.answer
            if "env_metrics" in step.info:  # the environment's own scores of the episode (a rubric's)
                traj.metadata = {**traj.metadata, "env_metrics": step.info["env_metrics"]}
            traj.finish_reason = "answer" if step.answer is not None else "max_turns"
            return
        turn.observation_ids = chat.observation_ids(tok, step.observation.messages, comp.finish_reason == "stop",
                                                    window.chat_format)
        anchor = step.observation.anchor
    traj.finish_reason = "max_turns"

