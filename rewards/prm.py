"""Process reward model: a score per turn, read at the turn's last action token.

Owns loading a PRM from any Hugging Face path, laying a trajectory out for it and the batched
forward passes (docs/rewards.md, "PRM"). Two heads, both reduced to one logit z per
turn with P(good) = sigmoid(z):

- ``reward_tokens``: a causal LM; z = logit(good_token) - logit(bad_token) at the marker,
  which is the two-way softmax P(good) = softmax([l_good, l_bad])[0]. Only the two rows of
  the output embedding are applied, so no [B, L, vocab] logits are built.
- ``classification``: ``AutoModelForTokenClassification`` with one label; z is its output.

The model is causal, so one forward over the whole trajectory scores every turn: the marker
of turn t sees the prompt, turns 1..t-1 with their observations, and turn t's action, never
what came after. The rows of a batch run their longest common prefix (the system prompt and
tool list) once and share its KV cache. Logit soft-capping models (Gemma 2) are out of scope
for ``reward_tokens``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from rollout.shared_prefix import forward_shared, pad_rows, shared_length
from rollout.trajectory import Trajectory

PRM_META = "turnrl_prm.json"
Convert = Callable[[list[int]], list[int]]


@dataclass
class PRMInput:
    """One trajectory as the PRM reads it."""

    ids: list[int]
    markers: list[int]
    """Position of each turn's last action token in ``ids``; -1 for a turn with no action."""


def prm_input(traj: Trajectory, convert: Convert | None = None) -> PRMInput:
    """The trajectory's exact token ids (re-encoded per segment by ``convert`` when the PRM's
    tokenizer differs from the policy's) and each turn's marker position."""
    conv = convert or (lambda ids: list(ids))
    ids = conv(traj.prompt_ids)
    markers = []
    for turn in traj.turns:
        action = conv(turn.action_ids)
        ids += action
        markers.append(len(ids) - 1 if action else -1)
        ids += conv(turn.observation_ids)
    return PRMInput(ids, markers)


def retokenizer(source_tok: Any, target_tok: Any) -> Convert | None:
    """None when both tokenizers share a vocabulary, else decode-then-encode per segment."""
    if source_tok.get_vocab() == target_tok.get_vocab():
        return None

    def convert(ids: list[int]) -> list[int]:
        text = source_tok.decode(ids, skip_special_tokens=False)
        return target_tok(text, add_special_tokens=False)["input_ids"]

    return convert


def single_token(tokenizer: Any, text: str, role: str) -> int:
    """The id of ``text``, which must be exactly one token of ``tokenizer``."""
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    if len(ids) != 1:
        raise ValueError(
            f"prm.{role} {text!r} is {len(ids)} tokens for this tokenizer; pick a string that "
            "is a single token (e.g. '+'/'-' or ' good'/' bad')"
        )
    return ids[0]


def pack(items: Sequence[PRMInput], token_budget: int) -> list[list[int]]:
    """Indices into ``items``, longest first, so rows x longest row <= token_budget."""
    order = sorted(range(len(items)), key=lambda i: len(items[i].ids), reverse=True)
    batches: list[list[int]] = []
    for i in order:
        if batches and (len(batches[-1]) + 1) * len(items[batches[-1][0]].ids) <= token_budget:
            batches[-1].append(i)
        else:
            batches.append([i])
    return batches


class ProcessRewardModel:
    """A loaded PRM (model + tokenizer + head) that turns PRM inputs into turn logits."""

    def __init__(self, model: Any, tokenizer: Any, head: str, good_token: str = "+",
                 bad_token: str = "-", version: int = 0) -> None:
        if head not in ("reward_tokens", "classification"):
            raise ValueError(f"unknown PRM head {head!r}; known: classification, reward_tokens")
        self.model, self.tokenizer, self.head, self.version = model, tokenizer, head, version
        self.good_token, self.bad_token = good_token, bad_token
        if head == "reward_tokens":
            self.good_id = single_token(tokenizer, good_token, "good_token")
            self.bad_id = single_token(tokenizer, bad_token, "bad_token")
        pad = tokenizer.pad_token_id
        self.pad_id = pad if pad is not None else (tokenizer.eos_token_id or 0)

    @classmethod
    def load(cls, path: str, head: str, good_token: str = "+", bad_token: str = "-",
             dtype: torch.dtype = torch.float32) -> "ProcessRewardModel":
        """Load from a folder ``prm train`` wrote, or start from any HF causal LM path."""
        from transformers import (AutoModelForCausalLM, AutoModelForTokenClassification,
                                  AutoTokenizer)

        from storage.places import local_model

        path = local_model(path, "rewards.prm.path")  # a missing path is an error, never a hub id
        meta = read_meta(path)
        if meta and meta.get("head") != head:
            raise ValueError(f"the PRM at {path} has head {meta.get('head')!r} but prm.head is "
                             f"{head!r}: set prm.head to match, or retrain")
        tokenizer = AutoTokenizer.from_pretrained(path)
        if head == "reward_tokens":
            model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
        else:
            model = AutoModelForTokenClassification.from_pretrained(path, num_labels=1, dtype=dtype)
            if model.config.pad_token_id is None:
                model.config.pad_token_id = tokenizer.pad_token_id
        return cls(model.eval(), tokenizer, head, good_token, bad_token,
                   int(meta.get("version", 0)) if meta else 0)

    def _hidden(self, items: Sequence[PRMInput]) -> torch.Tensor:
        """Final hidden states at every marker of ``items``, in order ([N, H]).

        Rows run their longest common prefix (the system prompt and tool list, often half the
        tokens) once (``rollout.shared_prefix``). Gradients flow through both parts.
        """
        at = [(i, m) for i, it in enumerate(items) for m in it.markers if m >= 0]
        device = next(self.model.parameters()).device
        ids, mask = (t.to(device) for t in pad_rows([it.ids for it in items], self.pad_id))
        # The prefix stops at the first marker, so every marker's state is in the suffixes.
        shared = shared_length(ids, mask, cap=min((m for _, m in at), default=None))
        fwd = forward_shared(self.model.base_model, ids, mask, shared, field="last_hidden_state")
        rows = torch.tensor([i for i, _ in at], device=device)
        return fwd.suffix[rows, torch.tensor([m - fwd.start for _, m in at], device=device)]

    def logits(self, items: Sequence[PRMInput]) -> list[torch.Tensor]:
        """z per turn for each item (one batched forward); differentiable."""
        picked = self._hidden(items)
        if self.head == "reward_tokens":
            out = self.model.get_output_embeddings()
            z = picked.float() @ (out.weight[self.good_id] - out.weight[self.bad_id]).float()
            if getattr(out, "bias", None) is not None:
                z = z + (out.bias[self.good_id] - out.bias[self.bad_id]).float()
        else:  # the token-classification head (``score`` in Llama/Qwen, ``classifier`` in BERTs)
            head = getattr(self.model, "score", None) or self.model.classifier
            z = head(picked)[:, 0].float()
        result, k = [], 0
        for it in items:
            n = sum(1 for m in it.markers if m >= 0)
            result.append(z[k: k + n])
            k += n
        return result

    @torch.inference_mode()
    def score(self, items: Sequence[PRMInput], token_budget: int) -> list[list[float | None]]:
        """P(good) per turn of each item; None for a turn with no action token."""
        out: list[list[float | None]] = [[] for _ in items]
        for batch in pack(items, token_budget):
            for i, z in zip(batch, self.logits([items[i] for i in batch])):
                probs = iter(torch.sigmoid(z).tolist())
                out[i] = [next(probs) if m >= 0 else None for m in items[i].markers]
        return out

    def save(self, out_dir: str | Path, meta: dict[str, Any]) -> None:
        """Model, tokenizer and ``turnrl_prm.json`` (head, tokens, version, metrics)."""
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        self.model.save_pretrained(out)
        self.tokenizer.save_pretrained(out)
        info = {"head": self.head, "good_token": self.good_token, "bad_token": self.bad_token,
                "version": self.version, **meta}
        tmp = out / (PRM_META + ".tmp")
        tmp.write_text(json.dumps(info, indent=2))
        tmp.replace(out / PRM_META)


def read_meta(path: str | Path) -> dict[str, Any] | None:
    """``turnrl_prm.json`` of a local PRM folder, or None (hub ids, untrained models)."""
    meta = Path(path) / PRM_META
    return json.loads(meta.read_text()) if meta.exists() else None
