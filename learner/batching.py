"""Trajectories plus per-turn advantages -> right-padded token tensors for the loss.

A trajectory is one row, or, when its turns were sampled from a history window, one row per
context (``Trajectory.segments``). Positions are shifted once here: entry ``j`` of every
per-token tensor describes the token at ``input_ids[:, j + 1]`` (the one predicted from
position ``j``). Turn advantages are broadcast to their turn's action tokens only; prompt,
observation and context-turn tokens keep attention but get mask 0.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

import numpy as np
import torch

from rollout.trajectory import Trajectory


@dataclass
class TokenBatch:
    input_ids: torch.Tensor       # [N, L] long
    attention_mask: torch.Tensor  # [N, L] long
    loss_mask: torch.Tensor       # [N, L-1] float, 1 on trained action tokens
    behaviour: torch.Tensor       # [N, L-1] behaviour log-probs (0 where mask 0)
    advantages: torch.Tensor      # [N, L-1]
    turn_ids: torch.Tensor        # [N, L-1] long, unique per (row, turn), -1 where mask 0
    clip_low: torch.Tensor | None = None   # [N, L-1] per-token clip epsilon
    clip_high: torch.Tensor | None = None
    row_traj: torch.Tensor | None = None   # [N] long, index of the trajectory each row is from

    @property
    def num_tokens(self) -> float:
        return float(self.loss_mask.sum())

    def rows(self, start: int, stop: int) -> "TokenBatch":
        """Rows ``start:stop`` with trailing all-padding columns trimmed."""
        width = int(self.attention_mask[start:stop].sum(-1).max())
        out = {}
        for f in fields(self):
            val = getattr(self, f.name)
            if val is None or val.dim() == 1:
                out[f.name] = None if val is None else val[start:stop]
                continue
            cols = width if f.name in ("input_ids", "attention_mask") else width - 1
            out[f.name] = val[start:stop, :cols]
        return TokenBatch(**out)

    def select(self, order: torch.Tensor) -> "TokenBatch":
        """The rows in ``order`` (a permutation of row indices)."""
        return TokenBatch(**{f.name: None if (v := getattr(self, f.name)) is None else v[order]
                             for f in fields(self)})

    def to(self, device: torch.device) -> "TokenBatch":
        """Every tensor on ``device``."""
        moved = {f.name: getattr(self, f.name) for f in fields(self)}
        return TokenBatch(**{k: None if v is None else v.to(device) for k, v in moved.items()})


def rank_shares(start: int, stop: int, world: int) -> list[np.ndarray]:
    """Rows ``start:stop`` split into ``world`` contiguous shares, one per rank."""
    return np.array_split(np.arange(start, stop), world)


def rank_micro_batches(start: int, stop: int, rank: int, world: int, size: int) -> list[tuple[int, int] | None]:
    """Rank ``rank``'s micro-batches of rows ``start:stop``: the rows split into ``world``
    contiguous shares, each cut into micro-batches of at most ``size`` rows. Every rank gets
    as many entries as the longest share has micro-batches (at least one), because under ZeRO
    every forward and backward is a collective; a rank with fewer real micro-batches gets
    None entries, which it runs as zero-weight steps."""
    shares = rank_shares(start, stop, world)
    count = max(max(-(-len(s) // size) for s in shares), 1)
    mine = shares[rank]
    spans: list[tuple[int, int] | None] = [(int(mine[i]), int(mine[min(i + size, len(mine)) - 1]) + 1)
                                          for i in range(0, len(mine), size)]
    return spans + [None] * (count - len(spans))


def by_length(tb: TokenBatch, parts: list[tuple[int, int]], world: int) -> TokenBatch:
    """``tb`` with the rows of each rank's share of each mini-batch ``parts`` sorted longest
    first. Every optimizer step, on every rank, trains the same rows as before, so the
    update is the same sum; but the micro-batches cut from a share (``rank_micro_batches``)
    now hold rows of like lengths, and ``rows`` trims each to its own longest. A batch's
    rows differ by whole turns (a 3-turn episode beside 2-turn ones), so in arrival order
    nearly every micro-batch carries one long row and pads the rest to it."""
    lengths = tb.attention_mask.sum(-1).tolist()
    order: list[int] = []
    for start, stop in parts:
        for share in rank_shares(start, stop, world):
            order += sorted(share.tolist(), key=lambda i: -lengths[i])
    return tb.select(torch.tensor(order, dtype=torch.long))


def padding_cuts(lengths: list[int], parts: int) -> list[tuple[int, int]]:
    """Spans ``(start, stop)`` cutting ``lengths`` (sorted ascending) into at most ``parts``
    contiguous groups with the fewest padded tokens, each group padded to its longest: the
    sum over groups of rows x longest row (a dynamic programme; equal halves pad a batch of
    six short rows and ten long ones as two long groups)."""
    n = len(lengths)
    if n == 0:
        return []
    inf = float("inf")
    # cost[m][j]: fewest padded tokens for the first j rows in m groups; cut[m][j]: last start
    cost = [[inf] * (n + 1) for _ in range(parts + 1)]
    cut = [[0] * (n + 1) for _ in range(parts + 1)]
    cost[0][0] = 0
    for m in range(1, parts + 1):
        for j in range(1, n + 1):
            for i in range(j):
                c = cost[m - 1][i] + (j - i) * lengths[j - 1]
                if c < cost[m][j]:
                    cost[m][j], cut[m][j] = c, i
    m = min(range(1, parts + 1), key=lambda k: (cost[k][n], k))  # fewest groups among ties
    spans, j = [], n
    while j > 0:
        spans.append((cut[m][j], j))
        j, m = cut[m][j], m - 1
    return spans[::-1]


def _row_values(owner: np.ndarray, values: np.ndarray, offset: int, fill: float) -> torch.Tensor:
    """Per token: the value of the trained turn that owns it (``values[offset + turn]``), else
    ``fill``. Only owned tokens index ``values``: a trajectory with no turns (an episode that
    failed before its first action) owns none, and may sit past the last turn's value."""
    out = np.full(len(owner), fill, dtype=np.float64)
    mine = owner >= 0
    out[mine] = values[offset + owner[mine]]
    return torch.from_numpy(out)


def build_token_batch(
    trajs: list[Trajectory],
    turn_adv: np.ndarray,
    turn_mask: np.ndarray,
    pad_id: int,
    clip_low: np.ndarray | None = None,
    clip_high: np.ndarray | None = None,
) -> TokenBatch:
    """``turn_*`` arrays have one entry per turn, trajectories concatenated in order. Each
    trajectory gives one row per ``Trajectory.segments()`` entry: one row unless its turns
    were sampled from a history window."""
    rows: list[tuple[np.ndarray, np.ndarray, Trajectory, int]] = []
    offset, row_traj = 0, []
    for k, traj in enumerate(trajs):
        segs = traj.segments()
        rows += [(ids.array, owner.array, traj, offset) for ids, owner in map(traj.row, segs)]
        row_traj += [k] * len(segs)
        offset += len(traj.turns)
    n, width = len(rows), max(len(ids) for ids, *_ in rows)
    ids_t = torch.full((n, width), pad_id, dtype=torch.long)
    att = torch.zeros((n, width), dtype=torch.long)
    per_tok = {k: torch.zeros((n, width)) for k in ("mask", "beh", "adv", "tid", "lo", "hi")}
    has_clip = clip_low is not None and clip_high is not None
    tids, mask_values = np.arange(offset, dtype=float), turn_mask.astype(float)
    for i, (ids, owner, traj, off) in enumerate(rows):
        length = len(ids)
        ids_t[i, :length] = torch.tensor(ids)  # a copy: the row is read-only
        att[i, :length] = 1
        per_tok["mask"][i, :length] = _row_values(owner, mask_values, off, 0.0)
        per_tok["adv"][i, :length] = _row_values(owner, turn_adv, off, 0.0)
        per_tok["tid"][i, :length] = _row_values(owner, tids, off, -1.0)
        trained = np.unique(owner[owner >= 0])  # a row's trained actions, in token order
        if len(trained):
            beh = np.concatenate([traj.turns[t].action_logprobs.array for t in trained])
            per_tok["beh"][i, :length][torch.from_numpy(owner >= 0)] = torch.from_numpy(beh).float()
        if has_clip:
            per_tok["lo"][i, :length] = _row_values(owner, clip_low, off, 0.0)
            per_tok["hi"][i, :length] = _row_values(owner, clip_high, off, 0.0)
    mask = per_tok["mask"][:, 1:]
    tid = torch.where(mask > 0, per_tok["tid"][:, 1:], torch.full_like(mask, -1.0)).long()
    return TokenBatch(
        input_ids=ids_t, attention_mask=att, loss_mask=mask, behaviour=per_tok["beh"][:, 1:],
        advantages=per_tok["adv"][:, 1:], turn_ids=tid,
        clip_low=per_tok["lo"][:, 1:] if has_clip else None,
        clip_high=per_tok["hi"][:, 1:] if has_clip else None,
        row_traj=torch.tensor(row_traj, dtype=torch.long),
    )


def micro_share(loss: Any, mb: TokenBatch, rows: int, tokens: float) -> float:
    """``mb``'s weight in its optimizer step of ``rows`` rows and ``tokens`` trained tokens: its
    share of the tokens under PPO's token mean (one mean over every token of the step), else of
    the rows (losses that average rows)."""
    if loss.type == "ppo" and loss.agg == "token-mean":
        return mb.num_tokens / max(tokens, 1.0)
    return mb.input_ids.size(0) / rows
