"""Generative judge: an LLM prompted with a per-turn rubric; its score parsed, retried once.

Owns the prompt, the parser, the retry rule and the judge backends (docs/rewards.md,
"Generative judge"). A judgement is parsed from the last ``Score: <number>`` in the reply; a reply with
none, or a number outside [score_min, score_max], is unparseable. Unparseable replies get
``retries`` more attempts, each with a format reminder; after that the turn's reward is missing
(None) and flagged, and every raw reply is kept. Scores are rescaled to [0, 1].

Backends are callables ``list[str] -> list[str]`` (prompts in, replies out): ``HFJudge`` runs
any Hugging Face causal LM greedily; ``callable`` imports ``package.module:name`` and calls it
per prompt (an API client, a rule-based grader), passing the run's chat format
(``rollout.chat_format``) as ``chat_format=`` to a function that declares that parameter.
Episodes are decoded keeping the format's own special tokens (``rollout.chat.decode_action``).
"""

from __future__ import annotations

import importlib
import inspect
import re
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from envs.formats import DEFAULT_FORMAT
from rewards.config import JudgeConfig
from rollout.chat import decode_action
from rollout.trajectory import Trajectory

Backend = Callable[[list[str]], list[str]]
SCORE_RE = re.compile(r"score\s*[:=]\s*(-?\d+(?:\.\d+)?)", re.IGNORECASE)


@dataclass
class Judgement:
    """The judge's verdict on one turn."""

    score: float | None
    """Rescaled to [0, 1]; None when no attempt parsed."""
    raw: list[str] = field(default_factory=list)
    """Every reply, in order (the first, then each retry)."""
    error: str | None = None
    """Why ``score`` is None: ``unparseable`` or the backend's exception."""

    def as_dict(self) -> dict[str, Any]:
        """The JSON form a trajectory keeps (``reward_details["prm"]``, ``live.prejudged``)."""
        return {"score": self.score, "raw": list(self.raw), "error": self.error}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Judgement":
        return cls(d["score"], list(d["raw"]), d["error"])


def parse_score(text: str, lo: float, hi: float) -> float | None:
    """The last ``Score: x`` in ``text`` rescaled to [0, 1], or None (absent, out of range)."""
    found = SCORE_RE.findall(text)
    if not found:
        return None
    value = float(found[-1])
    if not lo <= value <= hi:
        return None
    return (value - lo) / (hi - lo)


def judge_prompt(cfg: JudgeConfig, context: str, turn_text: str, turn: int,
                 followed: str | None = None) -> str:
    """The rubric, the episode so far (tail), the judged turn, what followed it (hindsight
    judges, when anything did), and the reply format."""
    if len(context) > cfg.max_context_chars:
        context = "..." + context[-cfg.max_context_chars:]
    after = ""
    if followed:
        after = f"### What followed step {turn + 1}\n{followed[: cfg.max_context_chars]}\n\n"
    return (
        f"{cfg.rubric}\n\n### Episode so far\n{context}\n\n### Step {turn + 1} to grade\n"
        f"{turn_text}\n\n{after}### Your grade\nReply with one line: Score: <number from "
        f"{cfg.score_min:g} to {cfg.score_max:g}>."
    )


def reminder(cfg: JudgeConfig, prompt: str) -> str:
    """The prompt again with a format reminder (the retry)."""
    return (f"{prompt}\nYour previous reply had no readable score. Answer with exactly "
            f"'Score: N', N a number from {cfg.score_min:g} to {cfg.score_max:g}.")


def judge_turns(backend: Backend, prompts: Sequence[str], cfg: JudgeConfig) -> list[Judgement]:
    """Judge every prompt: one batched call, then retries for the unparseable ones."""
    out = [Judgement(score=None) for _ in prompts]
    pending = list(range(len(prompts)))
    for attempt in range(cfg.retries + 1):
        asked = [prompts[i] if attempt == 0 else reminder(cfg, prompts[i]) for i in pending]
        try:
            replies = backend(asked)
            if len(replies) != len(asked):
                raise ValueError(f"backend returned {len(replies)} replies for {len(asked)} prompts")
        except Exception as exc:  # noqa: BLE001 - a failed judge leaves the reward missing
            for i in pending:
                out[i].error = f"judge backend: {type(exc).__name__}: {exc}"
            return out
        still = []
        for i, reply in zip(pending, replies):
            out[i].raw.append(reply)
            out[i].score = parse_score(reply, cfg.score_min, cfg.score_max)
            if out[i].score is None:
                still.append(i)
        pending = still
        if not pending:
            break
    for i in pending:
        out[i].error = f"unparseable after {cfg.retries + 1} attempts"
    return out


def episode_prompts(traj: Trajectory, tokenizer: Any, cfg: JudgeConfig,
                    turns: Sequence[int] | None = None, chat_format: str = DEFAULT_FORMAT) -> list[str]:
    """One prompt per judged turn (``turns``, default all), the context decoded from the
    rollout's own tokens; a hindsight judge also reads the turn's observation. A turn without
    its text is decoded keeping ``chat_format``'s markers (Mistral's ``[TOOL_CALLS]``)."""
    wanted = range(len(traj.turns)) if turns is None else turns
    prompts = {}
    context_ids = list(traj.prompt_ids)
    for t, turn in enumerate(traj.turns):
        if t in wanted:
            context = tokenizer.decode(context_ids, skip_special_tokens=True)
            text = turn.text or decode_action(tokenizer, turn.action_ids, chat_format)
            followed = tokenizer.decode(turn.observation_ids, skip_special_tokens=True).strip() \
                if cfg.hindsight else None
            prompts[t] = judge_prompt(cfg, context, text, t, followed)
        context_ids += turn.action_ids + turn.observation_ids
    return [prompts[t] for t in wanted]


class HFJudge:
    """Greedy generation with any Hugging Face causal LM (chat template when it has one)."""

    def __init__(self, path: str, max_new_tokens: int) -> None:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from storage.places import local_model

        self.torch = torch
        path = local_model(path, "rewards.prm.path")  # a missing path is an error, never a hub id
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        self.tokenizer.padding_side = "left"  # generation continues from the right edge
        if self.tokenizer.pad_token_id is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        self.model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        self.max_new_tokens = max_new_tokens

    def _render(self, prompt: str) -> str:
        if getattr(self.tokenizer, "chat_template", None):
            return self.tokenizer.apply_chat_template(
                [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=False)
        return prompt

    def __call__(self, prompts: list[str]) -> list[str]:
        enc = self.tokenizer([self._render(p) for p in prompts], return_tensors="pt",
                             padding=True, add_special_tokens=False)
        with self.torch.inference_mode():
            out = self.model.generate(**enc, max_new_tokens=self.max_new_tokens, do_sample=False,
                                      pad_token_id=self.tokenizer.pad_token_id)
        new = out[:, enc["input_ids"].shape[1]:]
        return self.tokenizer.batch_decode(new, skip_special_tokens=True)


def load_callable(spec: str, chat_format: str = DEFAULT_FORMAT) -> Backend:
    """``package.module:name`` -> a batch backend calling it once per prompt (with
    ``chat_format=`` when the function takes it: a grader that reads tool calls)."""
    module_name, _, attr = spec.partition(":")
    try:
        fn = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"judge function {spec!r} cannot be imported: {exc}") from None
    try:
        takes_format = "chat_format" in inspect.signature(fn).parameters
    except (TypeError, ValueError):  # a builtin or C callable without a signature: prompt only
        takes_format = False
    if takes_format:
        return lambda prompts: [str(fn(p, chat_format=chat_format)) for p in prompts]
    return lambda prompts: [str(fn(p)) for p in prompts]


def make_backend(cfg: JudgeConfig, chat_format: str = DEFAULT_FORMAT) -> Backend:
    """The backend ``cfg.backend`` names."""
    if cfg.backend == "hf":
        return HFJudge(cfg.path, cfg.max_new_tokens)
    return load_callable(cfg.function, chat_format)


class JudgeWorker:
    """A judge backend plus the policy tokenizer that renders episodes for it (one actor);
    ``chat_format``: the policy's (``rollout.chat_format``), in which its turns are read."""

    def __init__(self, cfg: JudgeConfig, policy_path: str, backend: Backend | None = None,
                 torch_threads: int | None = None, chat_format: str = DEFAULT_FORMAT) -> None:
        from transformers import AutoTokenizer

        if torch_threads is not None:
            import torch

            torch.set_num_threads(torch_threads)
        from storage import node_copy

        self.cfg, self.chat_format = cfg, chat_format
        self.tokenizer = AutoTokenizer.from_pretrained(node_copy(policy_path))
        self.backend = backend if backend is not None else make_backend(cfg, chat_format)

    def judge(self, trajs: Sequence[Trajectory], turns: Sequence[Sequence[int] | None] | None = None
              ) -> list[list[Judgement]]:
        """Judgements per judged turn of each trajectory (``turns[i]``: the turn indices of
        trajectory i, None for all; all of the batch in one backend call)."""
        turns = turns or [None] * len(trajs)
        prompts = [episode_prompts(t, self.tokenizer, self.cfg, ts, self.chat_format)
                   for t, ts in zip(trajs, turns)]
        flat = judge_turns(self.backend, [p for ps in prompts for p in ps], self.cfg)
        out, k = [], 0
        for ps in prompts:
            out.append(flat[k: k + len(ps)])
            k += len(ps)
        return out


def format_judge(prompt: str, chat_format: str = DEFAULT_FORMAT) -> str:
    """A rule-based judge (``rewards.judge:format_judge``): grades the step's protocol only,
    read in the run's ``chat_format`` (the callable backend passes it).

    10 for a well-formed tool call or answer, 0 otherwise. Deterministic; a baseline and a
    self-test of the judge pipeline, not a substitute for a model judge.
    """
    from envs.toolcalls import parse_action

    step = prompt.rsplit("### Your grade", 1)[0].split(" to grade\n")[-1]
    # A hindsight prompt shows what followed the step: not part of the step (in llama3_json a
    # call message is nothing but calls, so trailing text would make it malformed).
    step = step.split("\n\n### What followed step ", 1)[0]
    parsed = parse_action(step, chat_format)
    ok = parsed.balanced and not parsed.errors and (parsed.calls or parsed.answer is not None)
    return f"The step is {'well' if ok else 'badly'} formed.\nScore: {10 if ok else 0}"
