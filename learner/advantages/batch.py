"""The flat turn batch every estimator reads, and the result every estimator returns.

One row per turn. Rows of one trajectory may sit anywhere in the batch, but each
(rollout, turn index) appears once; estimators order turns by ``turn_index``. Codes are
int64 so that estimators can group with numpy instead of Python dictionaries of strings.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:  # rollout is upstream of learner; imported lazily to keep start-up light
    from rollout.trajectory import Trajectory


def anchor_hash(text: str) -> int:
    """Stable int64 code of an anchor observation's exact text (blake2b, 8 bytes).

    Python's ``hash`` is salted per process, so it cannot be used: the same text must get
    the same code on every worker and in every run.
    """
    digest = hashlib.blake2b(text.encode("utf-8"), digest_size=8).digest()
    return int.from_bytes(digest, "little", signed=True)


@dataclass(frozen=True)
class TurnBatch:
    """Turns of a batch of trajectories, one row each (shapes ``[N]``).

    ``rewards`` holds per-source turn rewards (``"ig"``, ``"prm"``, ``"match"``, ``"env"``,
    ...); NaN marks a reward that is missing (its scorer failed). ``mask`` False excludes a
    turn: it enters no normalisation pool and gets advantage 0.0. ``invalid`` marks turns
    whose action was malformed (GiGPO/HGPO charge a penalty for them); optional.
    """

    group_id: np.ndarray
    """int64 codes; the G rollouts of one task share a code."""
    rollout_id: np.ndarray
    """int64 codes, unique per trajectory across the batch."""
    turn_index: np.ndarray
    """int64, 0-based position of the turn in its trajectory."""
    outcome: np.ndarray
    """float64, the rollout's outcome reward repeated on each of its turns (NaN = missing)."""
    rewards: dict[str, np.ndarray]
    """Per-source float64 turn rewards; NaN = missing."""
    anchor: np.ndarray | None
    """int64 ``anchor_hash`` of each turn's anchor observation, or None when unknown."""
    mask: np.ndarray
    """bool, False = turn excluded."""
    invalid: np.ndarray | None = field(default=None)
    """bool, True where the action was invalid; None = no turn was flagged."""

    def __post_init__(self) -> None:
        # Coerce once here so estimators can rely on dtypes (callers may pass lists).
        coerce = {"group_id": np.int64, "rollout_id": np.int64, "turn_index": np.int64,
                  "outcome": np.float64, "mask": np.bool_}
        for name, dtype in coerce.items():
            object.__setattr__(self, name, np.asarray(getattr(self, name), dtype=dtype))
        n = len(self.group_id)
        object.__setattr__(self, "rewards", {
            k: np.asarray(v, dtype=np.float64) for k, v in self.rewards.items()})
        if self.anchor is not None:
            object.__setattr__(self, "anchor", np.asarray(self.anchor, dtype=np.int64))
        if self.invalid is not None:
            object.__setattr__(self, "invalid", np.asarray(self.invalid, dtype=np.bool_))
        arrays = {"rollout_id": self.rollout_id, "turn_index": self.turn_index,
                  "outcome": self.outcome, "mask": self.mask, "anchor": self.anchor,
                  "invalid": self.invalid, **{f"rewards[{k!r}]": v for k, v in self.rewards.items()}}
        for name, arr in arrays.items():
            if arr is not None and arr.shape != (n,):
                raise ValueError(f"TurnBatch.{name} has shape {arr.shape}; expected ({n},) "
                                 "like group_id (one row per turn)")
        self._check_structure()

    def _check_structure(self) -> None:
        if len(self.group_id) == 0:
            return
        if (self.turn_index < 0).any():
            raise ValueError("TurnBatch.turn_index must be >= 0 (0-based turn numbers)")
        pairs = np.stack([self.rollout_id, self.turn_index], axis=1)
        if len(np.unique(pairs, axis=0)) != len(pairs):
            raise ValueError("TurnBatch has two rows with the same (rollout_id, turn_index); "
                             "each turn of a trajectory must appear once")
        ids, first, inv = np.unique(self.rollout_id, return_index=True, return_inverse=True)
        if (self.group_id != self.group_id[first][inv]).any():
            raise ValueError("a rollout_id spans two group_ids; every turn of a trajectory "
                             "must carry its trajectory's group")
        # The outcome is a property of the rollout; disagreeing copies mean a packing bug.
        ref = self.outcome[first][inv]
        same = (self.outcome == ref) | (np.isnan(self.outcome) & np.isnan(ref))
        if not same.all():
            bad = int(self.rollout_id[np.flatnonzero(~same)[0]])
            raise ValueError(f"rollout {bad} has different outcome values on its turns; "
                             "repeat the rollout's outcome on every turn")

    def __len__(self) -> int:
        return len(self.group_id)


@dataclass
class AdvantageResult:
    """What an estimator returns, one entry per turn row (shapes ``[N]``)."""

    advantages: np.ndarray
    """float64; 0.0 on masked rows. The learner broadcasts it to the turn's action tokens."""
    clip_low: np.ndarray | None = None
    """Per-turn PPO clip epsilon below 1 (a2tgpo), else None (use the loss config)."""
    clip_high: np.ndarray | None = None
    """Per-turn PPO clip epsilon above 1 (a2tgpo), else None."""
    mask: np.ndarray | None = None
    """bool, the turns the estimator actually used: the batch mask minus turns whose needed
    reward was missing. The learner should drop the other turns' tokens from the loss."""


def _codes(values: list[str]) -> np.ndarray:
    """Dense int64 codes in order of first appearance."""
    table: dict[str, int] = {}
    return np.asarray([table.setdefault(v, len(table)) for v in values], dtype=np.int64)


def constrained_turns(trajs: list[Trajectory]) -> np.ndarray:
    """Per turn, in ``turn_batch_from_trajectories``' order: sampled under a grammar (a live
    turn in ``LiveOrigin.constrained``)."""
    return np.asarray([traj.live is not None and t in traj.live.constrained
                       for traj in trajs for t in range(len(traj.turns))], dtype=bool)


def turn_batch_from_trajectories(trajs: list[Trajectory], sources: Iterable[str] = ()) -> TurnBatch:
    """Flatten trajectories into a TurnBatch, turns in chronological order.

    ``rollout_id`` is the trajectory's position in ``trajs``; ``group_id`` codes follow
    ``traj.group_id``. Every reward source seen on any turn, and each of ``sources``, becomes
    a column (NaN where a turn lacks it or its value is None): a batch can legitimately carry
    none of a source's values, e.g. IG, which only non-final turns get, in a batch of
    rollouts that all answered in their first turn. ``anchor`` is None when no turn has a non-empty
    ``anchor_observation`` (an environment that gives none must not make every step look
    identical to GiGPO/HGPO). All rows start unmasked.
    """
    groups: list[str] = []
    rollout, turn_idx, outcome, anchors, invalid = [], [], [], [], []
    reward_rows: list[dict[str, float | None]] = []
    for r, traj in enumerate(trajs):
        out = np.nan if traj.outcome is None else float(traj.outcome)
        for t, turn in enumerate(traj.turns):
            groups.append(traj.group_id)
            rollout.append(r)
            turn_idx.append(t)
            outcome.append(out)
            anchors.append(turn.anchor_observation)
            invalid.append(turn.invalid_action)
            reward_rows.append(turn.rewards)
    sources = sorted({k for row in reward_rows for k in row} | set(sources))
    rewards = {
        s: np.asarray([np.nan if row.get(s) is None else float(row[s]) for row in reward_rows],
                      dtype=np.float64)
        for s in sources
    }
    has_anchor = any(a != "" for a in anchors)
    return TurnBatch(
        group_id=_codes(groups),
        rollout_id=np.asarray(rollout, dtype=np.int64),
        turn_index=np.asarray(turn_idx, dtype=np.int64),
        outcome=np.asarray(outcome, dtype=np.float64),
        rewards=rewards,
        anchor=np.asarray([anchor_hash(a) for a in anchors], dtype=np.int64) if has_anchor else None,
        mask=np.ones(len(rollout), dtype=np.bool_),
        invalid=np.asarray(invalid, dtype=np.bool_) if any(invalid) else None,
    )
