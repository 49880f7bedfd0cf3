"""Supervised warm start on demonstrations, tokenized exactly as rollouts are.

Each demonstration is laid out with the rollout's own token path (``rollout.chat``): prompt,
then per assistant message its action tokens (trained) and the observation tokens that follow
(attended, no loss). So SFT and RL see identical token sequences for identical episodes. With
a history window the demonstration is cut into the same per-context rows the learner trains.
"""

from __future__ import annotations

import math
import random
from typing import Any

import torch

from envs.base import Task, TaskSource
from envs.formats import DEFAULT_FORMAT
from envs.toolcalls import format_answer
from learner.batching import padding_cuts
from learner.config import SFTConfig
from rollout import chat
from rollout.next_token import next_token_logprobs
from rollout.shared_prefix import pad_rows, shared_length
from rollout.trajectory import Trajectory, Turn, window_start


def demo_trajectory(tokenizer: Any, task: Task, demo: list[dict[str, Any]],
                    history_turns: int | None = None, chat_format: str = DEFAULT_FORMAT) -> Trajectory:
    """``demo`` as the trajectory a rollout that took its actions would record (behaviour
    log-probs 0), each turn's context windowed as ``rollout.history_turns`` windows it, written
    in the policy's ``rollout.chat_format``."""
    traj = Trajectory(trajectory_id=f"demo:{task.task_id}", task_id=task.task_id, group_id="demo",
                      prompt_ids=chat.prompt_ids(tokenizer, task.messages, task.tools, chat_format))
    i = 0
    while i < len(demo):
        if demo[i]["role"] != "assistant":
            raise ValueError(f"demonstration for {task.task_id}: expected an assistant message at {i}")
        act = chat.action_ids(tokenizer, demo[i]["content"], chat_format)
        j = i + 1
        while j < len(demo) and demo[j]["role"] != "assistant":
            j += 1
        obs = chat.observation_ids(tokenizer, demo[i + 1 : j], True, chat_format) if j > i + 1 else []
        traj.turns.append(Turn(action_ids=act, action_logprobs=[0.0] * len(act), policy_version=0,
                               observation_ids=obs,
                               context_start=window_start(len(traj.turns), history_turns)))
        i = j
    return traj


def demo_rows(tokenizer: Any, task: Task, demo: list[dict[str, Any]], history_turns: int | None = None,
              chat_format: str = DEFAULT_FORMAT) -> list[tuple[list[int], list[int]]]:
    """(token ids, action mask) of each training row of one demonstration: one row, or one
    per context with a history window, exactly as the learner lays out rollouts."""
    traj = demo_trajectory(tokenizer, task, demo, history_turns, chat_format)
    rows = [traj.row(seg) for seg in traj.segments()]
    return [(ids, [int(t >= 0) for t in owner]) for ids, owner in rows]


def guess_count(num_demos: int, fraction: float) -> int:
    """How many of ``num_demos`` demonstrations guess: ``fraction`` of them, rounded."""
    return round(fraction * num_demos)


def guesses(tasks: list[Task], fraction: float, seed: int) -> dict[int, str]:
    """Task index -> the answer its demonstration guesses, for a seeded ``fraction`` of the
    tasks: the gold answer of another task, so a guess has the form of an answer but says
    nothing about this task's question."""
    if fraction == 0:
        return {}
    pool = sorted({t.gold_answers[0] for t in tasks if t.gold_answers})
    rng = random.Random(seed + 1)
    out = {}
    for i in rng.sample(range(len(tasks)), guess_count(len(tasks), fraction)):
        others = [a for a in pool if a not in (tasks[i].gold_answers or [])]
        if not others:
            raise ValueError(
                f"policy.sft.guess_fraction: no wrong answer to guess for {tasks[i].task_id} (the "
                "training tasks need gold answers other than its own); set guess_fraction to 0 "
                "for this environment"
            )
        out[i] = rng.choice(others)
    return out


def demonstrations(source: TaskSource, cfg: SFTConfig) -> list[tuple[Task, list[dict[str, Any]]]]:
    """The first ``num_demos`` training tasks with their demonstrations; a seeded
    ``guess_fraction`` of them answer at once, without tools, with a guess."""
    tasks = source.tasks("train")[: cfg.num_demos]
    guessed = guesses(tasks, cfg.guess_fraction, cfg.seed)
    return [(t, [{"role": "assistant", "content": format_answer(guessed[i])}] if i in guessed
             else source.demonstration(t)) for i, t in enumerate(tasks)]


def _lr_at(step: int, total: int, peak: float) -> float:
    warm = max(1, total // 20)
    if step < warm:
        return peak * (step + 1) / warm
    progress = (step - warm) / max(1, total - warm)
    return peak * 0.5 * (1 + math.cos(math.pi * progress))


def target_weights(rows: list[tuple[list[int], list[int]]], width: int, context_weight: float) -> torch.Tensor:
    """[B, width - 1] loss weight of each row's next-token target: 1 on action tokens,
    ``context_weight`` on the rest, 0 past the row's end."""
    weight = torch.zeros(len(rows), width - 1)
    for i, (ids, actions) in enumerate(rows):
        weight[i, : len(ids) - 1] = torch.tensor([1.0 if a else context_weight for a in actions[1:]])
    return weight


def _batch_loss(model: Any, batch: list[tuple[list[int], list[int]]], pad: int,
                context_weight: float, parts: int = 2) -> torch.Tensor:
    """Weighted mean next-token NLL over ``batch``'s tokens.

    Two cuts of padding, neither changing the loss: the system prompt and tool list every row
    opens with run once (``rollout.shared_prefix``: about half of a demo row's tokens), and the
    rows, sorted by length, run in at most ``parts`` forward passes cut where they pad least,
    each padded to its own longest (a batch mixes one-turn guesses with three-turn searches,
    100 against 170 tokens)."""
    rows = sorted(batch, key=lambda r: len(r[0]))
    total, count = 0.0, 0.0
    for start, stop in padding_cuts([len(r[0]) for r in rows], parts):
        part = rows[start:stop]
        ids, mask = pad_rows([r[0] for r in part], pad)
        logp, _ = next_token_logprobs(model, ids, mask, shared_length(ids, mask))
        weight = target_weights(part, ids.size(1), context_weight)
        total = total - (logp * weight).sum()
        count += float(weight.sum())
    return total / count


def run_sft(model: Any, tokenizer: Any, source: TaskSource, cfg: SFTConfig, show_progress: bool = True,
            history_turns: int | None = None, chat_format: str = DEFAULT_FORMAT) -> dict[str, float]:
    """Fine-tune ``model`` in place on demonstrations of training tasks, windowed and written as
    the rollouts will be (``history_turns``, ``chat_format``); returns final stats. A batch samples
    ``batch_size`` demonstrations and trains all their rows."""
    from tqdm import tqdm

    rng = random.Random(cfg.seed)
    demos = demonstrations(source, cfg)
    data = [demo_rows(tokenizer, t, demo, history_turns, chat_format) for t, demo in demos]
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.0)
    model.train()
    pad = tokenizer.pad_token_id
    bar = tqdm(range(cfg.steps), desc="sft", unit="step", disable=not show_progress, dynamic_ncols=True)
    ema = None
    for step in bar:
        batch = [row for rows in rng.sample(data, min(cfg.batch_size, len(data))) for row in rows]
        loss = _batch_loss(model, batch, pad, cfg.context_loss_weight)
        for group in opt.param_groups:
            group["lr"] = _lr_at(step, cfg.steps, cfg.lr)
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        ema = loss.item() if ema is None else 0.9 * ema + 0.1 * loss.item()
        bar.set_postfix(loss=f"{ema:.3f}")
    model.eval()
    return {"sft_loss": float(ema or 0.0), "sft_demos": float(len(data)),
            "sft_guess_demos": float(guess_count(len(demos), cfg.guess_fraction))}
