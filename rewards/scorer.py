"""The model scorer: IG with the behaviour policy's weights and the PRM, batched over many
trajectories. Plain Python; ``cluster.reward_service`` runs a pool of these as Ray actors.

Weights (IG): the learner's weight sync (``learner.weights.WeightSync``) pushes every new
version to the scorers (``update_weights``) before the engines get it, so a trajectory never
carries a version its scorer has not been given. The scorer keeps the last ``ig.keep_versions``
versions as handles (an object-store handle keeps the tensors in Ray's object store until
loaded). A trajectory is scored with the version that
generated its final turn when that version is still held, else with the newest held; every
IG value records the version used (``reward_versions["ig"]``) and a turn whose behaviour
version differs is counted (``ig_version_mismatch``). The PRM is its own model: it does not
follow the policy, and records its own version (``turnrl_prm.json``).

A failure never becomes a number: the batch is retried one trajectory at a time and the
trajectory that still fails gets ``None`` values with the error text.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from typing import Any, Callable, Sequence

import torch

from rewards.combine import SourceResult, failed, ig_gold, ig_without_gold, process_result
from rewards.config import PRMConfig, RewardsConfig
from rollout.engines.transport import InMemoryWeights, WeightHandle, check_fits, shapes_of
from rollout.trajectory import Trajectory


def _fetch(handle: WeightHandle) -> dict[str, torch.Tensor]:
    """A handle's state dict; the scorer runs on a thread with no event loop (a Ray actor's,
    or the reward service's ``to_thread``)."""
    return dict(asyncio.run(handle.load()))


def _behaviour_version(traj: Trajectory) -> int:
    return traj.turns[-1].policy_version if traj.turns else 0


def _isolating(fn: Callable[[list[Trajectory]], list[SourceResult]], trajs: list[Trajectory],
               source: str) -> list[SourceResult]:
    """``fn`` on the batch; if it raises, one trajectory at a time so one bad row fails alone."""
    try:
        return fn(trajs)
    except Exception:  # noqa: BLE001 - find which trajectory fails, below
        pass
    out = []
    for traj in trajs:
        try:
            out += fn([traj])
        except Exception as exc:  # noqa: BLE001 - recorded as a flagged missing reward
            out.append(failed(range(len(traj.turns)), f"{source} scorer: {type(exc).__name__}: {exc}"))
    return out


def ig_source_result(res: Any) -> SourceResult:
    """An ``IGResult`` as the reward service's per-source result: IG_t on turns 0..T-2."""
    values = {t: g for t, g in enumerate(res.ig)}
    return SourceResult(values=values, versions={t: res.version for t in values},
                        extra={"values": res.values, "version": res.version})


class ModelScorer:
    """Holds the IG policy copy and/or the PRM; ``score`` fills both for a batch."""

    def __init__(self, cfg: RewardsConfig, policy_path: str, *, torch_threads: int | None = None,
                 initial_version: int = 0) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        if torch_threads is not None:
            torch.set_num_threads(torch_threads)
        from storage import node_copy

        self.cfg = cfg
        policy_path = node_copy(policy_path)  # a stored policy (cluster.storage): this node's copy
        self.tokenizer = AutoTokenizer.from_pretrained(policy_path)
        self.counts = {"ig_version_mismatch": 0, "ig_values": 0, "weight_loads": 0,
                       "prm_values": 0, "scored": 0}
        self.ig = None
        if cfg.ig is not None:
            from rewards.ig_scorer import IGScorer

            model = AutoModelForCausalLM.from_pretrained(
                policy_path, dtype=torch.float32, attn_implementation="sdpa")
            # ``initial_version``: which published version the weights at ``policy_path`` are
            # (0 for a run's start; a checkpoint's step when scoring offline).
            self.ig = IGScorer(model, self.tokenizer, cfg.ig, version=initial_version)
            initial = {k: v.detach().clone() for k, v in model.state_dict().items()}
            self._held: OrderedDict[int, WeightHandle] = OrderedDict({initial_version: InMemoryWeights(initial)})
        self.prm = None
        if isinstance(cfg.prm, PRMConfig):
            from rewards.prm import ProcessRewardModel, retokenizer

            try:
                self.prm = ProcessRewardModel.load(cfg.prm.path, cfg.prm.head,
                                                   cfg.prm.good_token, cfg.prm.bad_token)
            except OSError as exc:
                raise ValueError(f"rewards.prm.path {cfg.prm.path!r} could not be loaded ({exc}); "
                                 "train one with `turnrl prm train CONFIG`") from None
            self._convert = retokenizer(self.tokenizer, self.prm.tokenizer)

    # -- weights ---------------------------------------------------------------------------
    def update_weights(self, version: int, handle: WeightHandle) -> int:
        """The weight sync's push: hold ``version`` (its tensors are fetched only when a
        trajectory needs them), the oldest beyond ``ig.keep_versions`` let go; returns the
        newest version held."""
        if self.ig is None:
            return version
        if version > max(self._held):
            self._held[version] = handle
            while len(self._held) > self.cfg.ig.keep_versions:
                self._held.popitem(last=False)
        return max(self._held)

    def _load(self, version: int) -> None:
        if self.ig.version == version:
            return
        state = _fetch(self._held[version])
        model = self.ig.model
        check_fits(shapes_of(model.state_dict()), shapes_of(state), version,
                   bool(model.config.tie_word_embeddings), "the IG model")
        model.load_state_dict(state, strict=False)
        self.ig.version = version
        self.counts["weight_loads"] += 1

    # -- sources ---------------------------------------------------------------------------
    def _ig_batch(self, trajs: list[Trajectory]) -> list[SourceResult]:
        out = [ig_source_result(res) for res in self.ig.score(trajs)]
        for traj, res in zip(trajs, out):
            self.counts["ig_values"] += len(res.values)
            self.counts["ig_version_mismatch"] += sum(
                traj.turns[t].policy_version != v for t, v in res.versions.items())
        return out

    def score_ig(self, trajs: Sequence[Trajectory]) -> list[SourceResult]:
        """IG per trajectory, each with its behaviour version when held (grouped by version
        so each version's weights are loaded once per batch)."""
        newest = max(self._held)
        out: dict[int, SourceResult] = {}
        by_version: dict[int, list[int]] = {}
        for i, traj in enumerate(trajs):
            if ig_gold(traj) is None:
                out[i] = ig_without_gold(traj)
                continue
            want = _behaviour_version(traj)
            by_version.setdefault(want if want in self._held else newest, []).append(i)
        for version, idx in sorted(by_version.items()):
            batch = [trajs[i] for i in idx]
            try:
                self._load(version)
            except Exception as exc:  # noqa: BLE001 - weights that cannot load fail the values
                res = [failed(range(len(t.turns) - 1), f"IG weights v{version}: {exc}") for t in batch]
            else:
                res = _isolating(self._ig_batch, batch, "ig")
            out.update(zip(idx, res))
        return [out[i] for i in range(len(trajs))]

    def _prm_batch(self, trajs: list[Trajectory]) -> list[SourceResult]:
        from rewards.prm import prm_input

        items = [prm_input(t, self._convert) for t in trajs]
        probs = self.prm.score(items, self.cfg.prm.token_budget)
        self.counts["prm_values"] += sum(len(p) for p in probs)
        return [process_result(p, self.cfg.prm, self.prm.version) for p in probs]

    def score_prm(self, trajs: Sequence[Trajectory]) -> list[SourceResult]:
        return _isolating(self._prm_batch, list(trajs), "prm")

    def score(self, trajs: Sequence[Trajectory]) -> list[dict[str, SourceResult]]:
        """Results per trajectory, keyed by source (``ig``, ``prm``) for what is configured."""
        trajs = list(trajs)
        out: list[dict[str, SourceResult]] = [{} for _ in trajs]
        live = [i for i, t in enumerate(trajs) if t.turns]
        for source, fn in (("ig", self.score_ig if self.ig else None),
                           ("prm", self.score_prm if self.prm else None)):
            if fn is None or not live:
                continue
            for i, res in zip(live, fn([trajs[i] for i in live])):
                out[i][source] = res
        self.counts["scored"] += len(trajs)
        return out

    def stats(self) -> dict[str, Any]:
        held = list(self._held) if self.ig is not None else []
        return {**self.counts, "ig_version": self.ig.version if self.ig else None,
                "ig_held_versions": held}
