"""Labelled turns for PRM training, played through a real environment.

Each task's demonstration (the gold actions) is replayed through a fresh episode, and before
each gold step a wrong step is inserted with probability ``bad_step_rate``: another task's
action at the same position (a wrong query, command or answer), the previous action again,
or text with no call. The environment labels every step (``StepResult.info["label"]``: a
search that retrieved a new supporting document, a call matching the gold trace, a household
action that shortened the plan, a correct answer), so the labels are the environment's, not
ours. Episodes are laid out with the rollout's own token path (``rollout.chat``) and stored as
ordinary trajectories with ``labels``, exactly as ``rollout.episode`` records them.

Everything is in the policy's chat format (``rollout.chat_format``): the demonstrations are
rewritten into it (``envs.formats.demo_text``), wrong steps are parsed and rendered by it, and
the environment parses each step with it, so a Llama 3.1 or Mistral PRM learns from its own
family's calls.
"""

from __future__ import annotations

import asyncio
import random
import uuid
from typing import Any, Sequence

from envs.base import Task, TaskSource
from envs.formats import DEFAULT_FORMAT, demo_text
from envs.toolcalls import ToolCall, format_call, parse_action
from rollout import chat
from rollout.trajectory import Trajectory, Turn

NO_CALL_TEXTS = (
    "Let me think about this step by step.",
    "I am not sure what to do next.",
    "I will look that up.",
)
BAD_KINDS = ("swap", "repeat", "malformed", "no_call")
"""Wrong steps: another task's action here, the previous action again, this step's action
with a broken call (unknown tool, no arguments, cut JSON, unclosed answer), or prose."""


def gold_actions(source: TaskSource, task: Task, chat_format: str = DEFAULT_FORMAT) -> list[str]:
    """The assistant messages of the task's demonstration, in order, as ``chat_format`` writes them."""
    return [demo_text(m["content"], chat_format) for m in source.demonstration(task) if m["role"] == "assistant"]


def cut_json(text: str) -> str:
    """``text`` without its last two ``}``: a call's JSON cut short after its arguments (the
    call and arguments objects both end there, whatever the format writes around them)."""
    for _ in range(2):
        at = text.rfind("}")
        if at < 0:
            break
        text = text[:at] + text[at + 1:]
    return text


def malformed(action: str, rng: random.Random, chat_format: str = DEFAULT_FORMAT) -> str:
    """``action`` (in ``chat_format``) broken the ways models break calls; the environment
    marks it invalid."""
    parsed = parse_action(action, chat_format)
    if not parsed.calls:  # an answer: drop its closing tag, so no answer is given
        return action.replace("</answer>", "")
    call = parsed.calls[0]
    kind = rng.choice(("tool", "args", "json"))
    if kind == "tool":
        return format_call(ToolCall(name=call.name + "_v2", arguments=call.arguments), chat_format)
    if kind == "args":
        return format_call(ToolCall(name=call.name, arguments={}), chat_format)
    return cut_json(format_call(call, chat_format))


def _bad_step(rng: random.Random, gold: str, done: list[str], pool: list[list[str]],
              index: int, chat_format: str = DEFAULT_FORMAT) -> str:
    """One wrong action for position ``index`` (kind drawn uniformly from ``BAD_KINDS``)."""
    kind = rng.choice(BAD_KINDS)
    if kind == "repeat" and done:
        return done[-1]
    if kind == "malformed":
        return malformed(gold, rng, chat_format)
    if kind in ("swap", "repeat") and pool:
        other = rng.choice(pool)
        return other[min(index, len(other) - 1)]
    return rng.choice(NO_CALL_TEXTS)


async def play_labelled(
    source: TaskSource,
    task: Task,
    tokenizer: Any,
    actions: Sequence[str],
    *,
    group_id: str = "prm",
    chat_format: str = DEFAULT_FORMAT,
) -> Trajectory:
    """Play ``actions`` (written in ``chat_format``) in a fresh episode of ``task``; one turn
    and one label per step. Stops at the first step that ends the episode. Token layout
    matches a rollout's in that format.
    """
    env = source.make_env()
    env.chat_format = chat_format
    obs = await env.reset(task)
    traj = Trajectory(
        trajectory_id=uuid.uuid4().hex, task_id=task.task_id, group_id=group_id,
        prompt_ids=chat.prompt_ids(tokenizer, task.messages, task.tools, chat_format),
        gold_answers=task.gold_answers, gold_tool_calls=task.gold_tool_calls,
    )
    labels: list[int] = []
    anchor = obs.anchor
    for text in actions:
        step = await env.step(text)
        ids = chat.text_ids(tokenizer, text)
        turn = Turn(action_ids=ids, action_logprobs=[0.0] * len(ids), policy_version=0,
                    anchor_observation=anchor, tool_calls=parse_action(text, chat_format).calls,
                    invalid_action=step.invalid_action, rewards={"env": float(step.reward)},
                    text=text)
        if "label" not in step.info:
            raise ValueError(
                f"environment {type(env).__name__} gives no step labels (StepResult.info['label']); "
                "train the PRM from labelled trajectories instead (turnrl prm train --episodes)")
        labels.append(int(step.info["label"]))
        traj.turns.append(turn)
        if step.done:
            traj.answer = step.answer
            traj.finish_reason = "answer" if step.answer is not None else "max_turns"
            break
        turn.observation_ids = chat.observation_ids(tokenizer, step.observation.messages, True, chat_format)
        anchor = step.observation.anchor
    env.close()
    traj.labels = labels
    return traj


def perturbed_actions(
    gold: list[str], pool: list[list[str]], max_turns: int, rate: float, rng: random.Random,
    chat_format: str = DEFAULT_FORMAT,
) -> list[str]:
    """Gold steps with wrong steps inserted before some, never beyond ``max_turns``."""
    out: list[str] = []
    for i, action in enumerate(gold):
        spare = max_turns - len(out) - (len(gold) - i)
        if spare > 0 and rng.random() < rate:
            out.append(_bad_step(rng, action, out, pool, i, chat_format))
        out.append(action)
    return out


def labelled_episodes(
    source: TaskSource,
    tasks: Sequence[Task],
    tokenizer: Any,
    *,
    bad_step_rate: float,
    seed: int,
    chat_format: str = DEFAULT_FORMAT,
) -> list[Trajectory]:
    """One labelled episode per task (tasks whose demonstration fails are skipped), in the
    policy's ``chat_format``."""
    rng = random.Random(seed)
    demos: list[tuple[Task, list[str]]] = []
    for task in tasks:
        try:
            demos.append((task, gold_actions(source, task, chat_format)))
        except ValueError:  # a task the source cannot demonstrate carries no labels
            continue
    pool = [actions for _, actions in demos]
    max_turns = source.make_env().max_turns
    plans = [(task, perturbed_actions(actions, [p for p in pool if p is not actions],
                                      max_turns, bad_step_rate, rng, chat_format))
             for task, actions in demos]

    async def play_all() -> list[Trajectory]:
        return [await play_labelled(source, task, tokenizer, plan, chat_format=chat_format)
                for task, plan in plans]

    return asyncio.run(play_all())


def turn_labels(traj: Trajectory) -> list[int]:
    """``traj.labels`` checked against the turns (one label per turn)."""
    labels = traj.labels
    if not isinstance(labels, list) or len(labels) != len(traj.turns):
        raise ValueError(
            f"trajectory {traj.trajectory_id} has {len(traj.turns)} turns but labels "
            f"{labels!r}: PRM training needs one environment label per turn"
        )
    return [int(x) for x in labels]
