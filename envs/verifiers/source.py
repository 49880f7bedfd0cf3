"""A verifiers environment as a TurnRL task source (``env.type: verifiers``).

The environment comes from its own loader (``verifiers.load_environment(id, **args)``; the
classic API of verifiers 0.3: ``SingleTurnEnv``, ``MultiTurnEnv``, ``ToolEnv`` and their
subclasses). Its ``dataset`` rows are the train tasks and its ``eval_dataset`` rows the held-out
ones (with no ``eval_dataset``, a seeded share of the dataset is set aside; a train row with a
held-out row's prompt is dropped). A row's prompt messages are the task's, its ``answer`` the
gold answer (for IG), its tools the environment's ``tool_defs`` (or the row's
``info["tool_defs"]``).

An episode is the environment's own ``rollout`` of the row, run beside TurnRL's episode loop:
each model request it makes is answered with the policy's sampled reply (``envs.verifiers.
client``), and what the environment adds before its next request (tool results, its
``env_response``) is the turn's observation. When the rollout ends, its rubric scores it:
the reward is the episode's outcome (``scores_outcome``), a success at ``success_at`` (the
environment's ``pass_threshold`` by default), each reward function's score goes into the
trajectory (``metadata["env_metrics"]``) and ``turnrl eval`` averages them. Calls the
environment cannot parse are its own to report (``ToolEnv`` answers with the error); an
environment that raises, hangs past ``step_timeout_s`` or rewrites earlier messages fails that
episode with the cause.
"""

from __future__ import annotations

import asyncio
import json
import random
from dataclasses import dataclass
from typing import Any

from envs.base import Environment, Observation, SplitTaskSource, StepResult, Task, step_observation
from envs.config import VerifiersConfig
from envs.formats import get_format

_CLOSING: set[asyncio.Task[Any]] = set()
"""Rollouts cancelled by ``close`` (kept referenced until they finish)."""


def _bridge() -> Any:
    """``envs.verifiers.client`` (which imports verifiers), or ValueError saying what to install."""
    try:
        import verifiers
    except ImportError as exc:
        raise ValueError("env.type verifiers needs the verifiers package: pip install 'verifiers>=0.3,<0.4'") from exc
    try:
        from envs.verifiers import client
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"env.type verifiers plays environments of verifiers' classic API (0.3: vf.Client, "
                         f"vf.load_environment); verifiers {verifiers.__version__} lacks it ({exc})") from exc
    return client


def _prompt_key(row: dict[str, Any]) -> str:
    return json.dumps(row.get("prompt"), sort_keys=True, default=str)


class VerifiersSource(SplitTaskSource):
    """The environment's dataset rows as tasks, its rollouts as episodes."""

    scores_outcome = True

    def __init__(self, cfg: VerifiersConfig) -> None:
        self.bridge, self.cfg = _bridge(), cfg
        self.env = self.bridge.load(cfg.id, cfg.args)
        if self.env.requires_group_rollouts:
            raise ValueError(f"env.id {cfg.id!r}: its rubric has group reward functions, which score a group's "
                             "rollouts together; TurnRL scores each episode alone (and takes group-relative "
                             "advantages itself): give the rubric per-rollout reward functions")
        if (getattr(self.env, "max_turns", None) or -1) <= 0:
            self.env.max_turns = cfg.max_turns  # it stops (and is scored) at the run's limit
        self.max_turns = self.env.max_turns
        self.success_at = self.env.pass_threshold if cfg.success_at is None else cfg.success_at
        train, heldout = self._rows()
        self.splits = {"train": [self._task("train", r) for r in train],
                       "heldout": [self._task("heldout", r) for r in heldout]}

    def _rows(self) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        """Train and held-out rows: the two datasets, or one split with ``heldout_fraction``."""
        cfg, train_ds, eval_ds = self.cfg, self.env.build_dataset(), self.env.build_eval_dataset()
        if train_ds is not None and eval_ds is not None:
            train, heldout = list(train_ds), list(eval_ds)
        else:
            rows = list(train_ds if train_ds is not None else eval_ds)
            order = random.Random(cfg.seed).sample(range(len(rows)), len(rows))
            cut = max(1, round(len(rows) * cfg.heldout_fraction)) if len(rows) > 1 else 0
            heldout, train = [rows[i] for i in order[:cut]], [rows[i] for i in order[cut:]]
        heldout = heldout[:cfg.num_heldout_tasks]
        seen = {_prompt_key(r) for r in heldout}
        train = [r for r in train if _prompt_key(r) not in seen][:cfg.num_train_tasks]
        if not train:
            raise ValueError(f"env.id {cfg.id!r}: no train rows (the dataset is empty, or every row is a held-out one)")
        return train, heldout

    def _task(self, split: str, row: dict[str, Any]) -> Task:
        prompt = row.get("prompt")
        if not isinstance(prompt, list):
            raise ValueError(f"env.id {self.cfg.id!r}: row {row.get('example_id')} has a {type(prompt).__name__} "
                             "prompt; TurnRL plays chat environments (a list of messages)")
        info = row.get("info")
        info = json.loads(info) if isinstance(info, str) and info else info or {}
        defs = info.get("tool_defs") if isinstance(info, dict) and "tool_defs" in info else self.env.tool_defs or []
        answer = row.get("answer")
        return Task(task_id=f"{split}-{row['example_id']}", messages=[self.bridge.plain(m) for m in prompt],
                    tools=[self.bridge.openai_tool(t) for t in defs],
                    gold_answers=[answer] if isinstance(answer, str) and answer.strip() else None,
                    metadata={"row": row})

    def make_env(self) -> Environment:
        return VerifiersEpisode(self)

    def success(self, task: Task, answer: str | None) -> bool:
        return False  # an episode's success is its rubric reward (``success_at``), never an answer match

    def demonstration(self, task: Task) -> list[dict[str, Any]]:
        raise ValueError("a verifiers environment has no demonstrations: set policy.sft.enabled=false, or warm-start "
                         "with policy.sft.env on an environment that has them")

    def corpus_text(self) -> list[str]:
        return [m["content"] for t in self.splits["train"] for m in t.messages] + \
               [a for t in self.splits["train"] for a in t.gold_answers or []]

    def provides(self) -> set[str]:
        tasks = [*self.splits["train"], *self.splits["heldout"]]
        return {"anchor", "gold_answers"} if all(t.gold_answers for t in tasks) else {"anchor"}


@dataclass
class _Ended:
    """The environment's rollout finished (its scored state) or raised."""

    state: Any = None
    error: BaseException | None = None


class VerifiersEpisode(Environment):
    """One rollout of the environment, driven a turn at a time."""

    def __init__(self, source: VerifiersSource) -> None:
        self.source, self.bridge, self.cfg = source, source.bridge, source.cfg
        self.max_turns = source.max_turns
        self._inbox: asyncio.Queue | None = None
        self._rollout: asyncio.Task[None] | None = None
        self._request: Any = None
        self._seen: list[dict[str, Any]] = []
        self._names: dict[str, str] = {}
        self.turn = 0

    async def _run(self, row: dict[str, Any], inbox: asyncio.Queue) -> None:
        try:
            state = await self.bridge.play(self.source.env, row, inbox)
        except Exception as exc:  # noqa: BLE001 - the environment's failure fails this episode (step raises it)
            await inbox.put(_Ended(error=exc))
        else:
            await inbox.put(_Ended(state=state))

    async def _next(self, what: str) -> Any:
        assert self._inbox is not None
        try:
            return await asyncio.wait_for(self._inbox.get(), self.cfg.step_timeout_s)
        except TimeoutError:
            raise TimeoutError(f"verifiers environment {self.cfg.id!r} did not {what} within "
                               f"{self.cfg.step_timeout_s:g} s (env.step_timeout_s)") from None

    def _failed(self, ended: _Ended, when: str) -> RuntimeError:
        err = ended.error
        return RuntimeError(f"verifiers environment {self.cfg.id!r} {when}: "
                            + (f"{type(err).__name__}: {err}" if err is not None else
                               f"its rollout ended ({ended.state.get('stop_condition')})"))

    async def reset(self, task: Task) -> Observation:
        self.close()
        self._inbox, self.turn, self._names = asyncio.Queue(), 0, {}
        self._rollout = asyncio.get_running_loop().create_task(self._run(task.metadata["row"], self._inbox))
        first = await self._next("ask for the first turn")
        if isinstance(first, _Ended):
            raise self._failed(first, "ended before asking the model")
        shown = [self.bridge.plain(m) for m in first.messages]
        if shown[:len(task.messages)] != task.messages:
            raise RuntimeError(f"verifiers environment {self.cfg.id!r} asked its first turn with other messages than "
                               "its dataset row's prompt: an environment that rewrites the prompt is not supported")
        offered = sorted(t["function"]["name"] for t in first.tools)
        if offered != sorted(t["function"]["name"] for t in task.tools):
            raise RuntimeError(f"verifiers environment {self.cfg.id!r} offers tools {offered} to this rollout, not "
                               "its tool_defs: tools chosen while a rollout runs are not supported")
        self._request, self._seen = first, shown
        extra = shown[len(task.messages):]
        return Observation(messages=extra, anchor=(extra or task.messages)[-1]["content"])

    async def step(self, action: str) -> StepResult:
        if self._request is None:
            raise RuntimeError("step() with no turn pending: call reset(task) first")
        self.turn += 1
        split = get_format(self.chat_format).split(action)
        response, names = self.bridge.reply(split, self.turn)
        self._names.update(names)
        self._request.reply.set_result(response)
        self._request = None
        got = await self._next("answer the turn")
        calls, invalid = split.valid_calls(), bool(split.errors)
        if isinstance(got, _Ended):
            return self._last(got, calls, invalid)
        shown = [self.bridge.plain(m, self._names) for m in got.messages]
        n = len(self._seen)
        if shown[:n] != self._seen or len(shown) <= n or shown[n]["role"] != "assistant":
            raise RuntimeError(f"verifiers environment {self.cfg.id!r} rebuilt the conversation between turns: TurnRL "
                               "appends each turn to the tokens the policy saw, so environments that rewrite earlier "
                               "messages (their own get_prompt_messages) are not supported")
        self._seen, self._request = shown, got
        return StepResult(observation=step_observation(shown[n + 1:], False), reward=0.0, done=False,
                          invalid_action=invalid, tool_calls=calls, info={"turn": self.turn})

    def _last(self, ended: _Ended, calls: list[Any], invalid: bool) -> StepResult:
        """The step that ended the rollout: its rubric's reward and scores."""
        if ended.error is not None:
            raise self._failed(ended, "failed") from ended.error
        state = ended.state
        metrics = {k: float(v) for k, v in (state.get("metrics") or {}).items() if isinstance(v, int | float)}
        try:
            answer = self.source.env.parser.parse_answer(state.get("completion") or [])
        except Exception:  # noqa: BLE001 - an answer the parser cannot read is no answer
            answer = None
        info = {"turn": self.turn, "env_metrics": metrics, "stop_condition": state.get("stop_condition")}
        if state.get("error") is not None:  # the environment ended it on purpose (a vf.Error): still scored
            info["env_error"] = f"{type(state['error']).__name__}: {state['error']}"
        return StepResult(observation=Observation(messages=[], anchor=""), reward=float(state.get("reward") or 0.0),
                          done=True, invalid_action=invalid, tool_calls=calls,
                          answer=answer if isinstance(answer, str) else None, info=info)

    def close(self) -> None:
        rollout, self._rollout, self._request = self._rollout, None, None
        if rollout is not None and not rollout.done():
            rollout.cancel()  # its pending model call raises CancelledError; the environment's cleanup runs
            _CLOSING.add(rollout)
            rollout.add_done_callback(_CLOSING.discard)
