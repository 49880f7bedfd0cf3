"""One batched forward pass whose rows run the prefix they all share once.

Every row of a warm-start batch, a learner micro-batch or a PRM batch opens with the same
system prompt and tool list (the demo: 75 tokens of 100-176 in SFT, of ~250 in RL). A causal
model's states for those tokens do not depend on what follows them, so running them once,
repeating their KV cache for the rows and running each row's remainder against it gives the
same outputs as the padded batch, at a fraction of the tokens. Gradients flow through both
parts: the repeat sums each row's gradient back into the single prefix, as the copies'
gradients would add up (tests/test_shared_prefix.py checks losses and gradients).

Used by SFT (``learner/sft.py``), the learner's log-probs (``rollout/next_token.py``, for
``learner/worker.py``: policy and reference) and the PRM (``rewards/prm.py``). Rows are right-padded: ``mask`` 1 on real tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

MIN_SHARED = 16  # shorter common prefixes are not worth a second forward pass


@dataclass
class SharedForward:
    """One output field of a batch run as ``prefix | suffixes``."""

    prefix: torch.Tensor | None
    """[1, P, ...]: the shared prefix's outputs (None when nothing was shared, P = 0)."""
    suffix: torch.Tensor
    """[B, L - P, ...]: each row's outputs from position ``start`` on."""
    start: int
    """P, the shared prefix's length: suffix column ``j`` is row position ``start + j``."""


def pad_rows(rows: Sequence[Sequence[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``rows`` right-padded to the longest: (ids [B, L], mask [B, L])."""
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, row in enumerate(rows):
        ids[i, : len(row)] = torch.tensor(list(row), dtype=torch.long)
        mask[i, : len(row)] = 1
    return ids, mask


def shared_length(ids: torch.Tensor, mask: torch.Tensor, cap: int | None = None) -> int:
    """Tokens every row starts with, at most ``cap`` and at most the shortest row less one
    (every row keeps a token after the prefix); 0 when under ``MIN_SHARED`` or one row."""
    if ids.size(0) < 2:
        return 0
    common = int((ids == ids[:1]).all(0).long().cumprod(0).sum())
    shared = min(common, int(mask.sum(-1).min()) - 1, cap if cap is not None else common)
    return shared if shared >= MIN_SHARED else 0


def forward_shared(model: Any, ids: torch.Tensor, mask: torch.Tensor, shared: int,
                   field: str = "logits") -> SharedForward:
    """``model`` (a Hugging Face model, or a DeepSpeed engine around one) over the rows, the
    first ``shared`` tokens (common to all rows) run once; ``field`` is the output kept
    (``logits``, or ``last_hidden_state`` of a base model)."""
    device = ids.device
    cache, prefix = None, None
    if shared:
        out = model(input_ids=ids[:1, :shared], use_cache=True)
        prefix, cache = getattr(out, field), out.past_key_values
        cache.batch_repeat_interleave(ids.size(0))
    width = ids.size(1) - shared
    pos = torch.arange(shared, shared + width, device=device).expand(ids.size(0), width)
    # Right padding keeps positions, and causal attention never lets a real token see a pad.
    out = model(input_ids=ids[:, shared:], attention_mask=mask, position_ids=pos,
                past_key_values=cache, use_cache=cache is not None)
    return SharedForward(prefix, getattr(out, field), shared)
