"""IGPO scorer: runs the behaviour policy over every turn boundary of finished rollouts.

Owns the forward passes behind ``rewards.ig`` (docs/rewards.md, "IG (IGPO)"). For a trajectory with
T turns there are T boundaries b = 0..T-1; boundary b's context is the rollout's exact token ids
``prompt_ids + sum_{t<=b}(action_ids + observation_ids)`` (never re-rendered text), followed by
the answer template's ids. Only live rows exist (one per real boundary, never per dead slot),
and ``lm_head`` is applied only at the positions that predict gold tokens, so no
[B, L, vocab] logits are ever built. Two batched paths, packed under ``cfg.token_budget``:

- ``share_prefix`` (default): one row per trajectory. Pass 1 runs its longest context
  (prompt + turns 1..T-1) once, keeping the KV cache; pass 2 appends T copies of the template,
  copy b placed at positions L_b.. and masked (custom 4D mask) to see only the first L_b context
  tokens and its own earlier template tokens. Each context token is computed once, not T times.
- one row per boundary (``share_prefix=False``): right-padded rows, one base-model forward.

``score_per_turn`` is the plain reference: one full forward with full logits per boundary.
Assumes logits = lm_head(final hidden state) and a model that honours custom 4D masks and
explicit position ids with a dynamic KV cache (Llama/Qwen/Mistral families). Models with
sliding-window or hybrid caches, or logit soft-capping, are out of scope: use the per-row path
after checking it against ``score_per_turn``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from rewards.combine import ig_gold
from rewards.config import IGConfig
from rewards.ig import AnswerTemplate, IGResult, build_template, information_gain
from rollout.trajectory import Trajectory


@dataclass
class _Row:
    """One boundary: context + template, and where the gold tokens are."""

    traj: int
    boundary: int
    ids: list[int]
    predict_at: list[int]
    """Positions whose next-token distribution scores a gold token (gold position - 1)."""
    targets: list[int]
    """The gold token ids those positions must predict."""


@dataclass
class _Shared:
    """One trajectory in the shared-prefix path."""

    traj: int
    context: list[int]
    """Longest scored context: prompt + turns 1..T-1."""
    lengths: list[int]
    """L_b, the context length of boundary b = 0..T-1 (a prefix of ``context``)."""
    template: AnswerTemplate

    @property
    def width(self) -> int:
        return len(self.context) + len(self.lengths) * len(self.template.ids)


def _template_block(
    items: list[_Shared], n_ctx: int, pad_id: int, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Input ids, position ids and additive 4D mask of the template pass.

    Row i holds T_i template copies; copy b sits at positions L_b.. and may attend to context
    keys [0, L_b) and to its own copy causally. Keys are [context cache (n_ctx) | templates].
    """
    n_q = max(len(it.lengths) * len(it.template.ids) for it in items)
    blocked = torch.finfo(dtype).min
    ids = torch.full((len(items), n_q), pad_id, dtype=torch.long)
    pos = torch.zeros((len(items), n_q), dtype=torch.long)
    mask = torch.full((len(items), 1, n_q, n_ctx + n_q), blocked, dtype=dtype)
    mask[:, 0, :, 0] = 0.0  # padding queries see key 0, so no row is fully masked (no NaN)
    for i, it in enumerate(items):
        m = len(it.template.ids)
        causal = torch.triu(torch.full((m, m), blocked, dtype=dtype), diagonal=1)
        for b, n in enumerate(it.lengths):
            q = slice(b * m, (b + 1) * m)
            ids[i, q] = torch.tensor(it.template.ids)
            pos[i, q] = torch.arange(n, n + m)
            mask[i, 0, q, :n] = 0.0
            mask[i, 0, q, n:n_ctx] = blocked  # later context and padding stay hidden
            mask[i, 0, q, n_ctx + b * m : n_ctx + (b + 1) * m] = causal
    return ids, pos, mask


def boundary_contexts(traj: Trajectory) -> list[list[int]]:
    """Token ids after 0, 1, ..., T-1 turns: the contexts of v_0..v_{T-1} (empty if T = 0)."""
    if not traj.prompt_ids:
        raise ValueError(f"trajectory {traj.trajectory_id} has no prompt_ids; IG needs a prompt")
    if not traj.turns:
        return []
    ids = list(traj.prompt_ids)
    contexts = [list(ids)]
    for turn in traj.turns[:-1]:  # the final turn's context is never scored
        ids += turn.action_ids + turn.observation_ids
        contexts.append(list(ids))
    return contexts


class IGRows:
    """What every IG scorer shares: answer templates, one row per turn boundary, results.
    Subclasses say how a row's gold log-probs are computed (a model copy here, an engine's
    prompt log-probs in ``rewards.ig_engine``)."""

    def __init__(self, tokenizer, cfg: IGConfig) -> None:
        self.tokenizer = tokenizer
        self.cfg = cfg
        self._templates: dict[str, AnswerTemplate] = {}

    def template(self, gold: str) -> AnswerTemplate:
        """Answer template for ``gold`` (cached: all boundaries of a task share it)."""
        if gold not in self._templates:
            self._templates[gold] = build_template(
                self.tokenizer, self.cfg.prefix, gold, self.cfg.suffix
            )
        return self._templates[gold]

    def _gold(self, traj: Trajectory) -> str:
        gold = ig_gold(traj)
        if gold is None:  # the reward service flags these before they reach a scorer
            raise ValueError(
                f"trajectory {traj.trajectory_id} has no gold_answers; IG needs the task's "
                "gold answer (its first alias)"
            )
        return gold

    def rows(self, trajectories: Sequence[Trajectory]) -> list[_Row]:
        """One row per boundary of every trajectory (validates all before any compute)."""
        rows: list[_Row] = []
        for i, traj in enumerate(trajectories):
            tpl = self.template(self._gold(traj))
            for b, ctx in enumerate(boundary_contexts(traj)):
                n = len(ctx)
                rows.append(
                    _Row(
                        traj=i,
                        boundary=b,
                        ids=ctx + tpl.ids,
                        predict_at=[n + k - 1 for k in tpl.gold_positions],
                        targets=[tpl.ids[k] for k in tpl.gold_positions],
                    )
                )
        return rows

    def results(
        self,
        trajectories: Sequence[Trajectory],
        values: dict[tuple[int, int], float],
        versions: Sequence[int],
    ) -> list[IGResult]:
        """IG results from per-boundary values; ``versions[i]``: the weights trajectory i
        was scored with."""
        results = []
        for i, traj in enumerate(trajectories):
            v = [values[(i, b)] for b in range(len(traj.turns))]
            results.append(
                IGResult(
                    trajectory_id=traj.trajectory_id,
                    values=v,
                    ig=information_gain(v, self.cfg.mode),
                    version=versions[i],
                    mode=self.cfg.mode,
                    gold_token_count=len(self.template(self._gold(traj)).gold_positions),
                )
            )
        return results


class IGScorer(IGRows):
    """Information-gain scorer around a causal LM and its fast tokenizer.

    The model must hold the behaviour policy's weights; ``version`` records which (pass the
    version on ``score`` when the weights changed since construction).
    """

    def __init__(self, model, tokenizer, cfg: IGConfig, *, version: int = 0) -> None:
        attn = getattr(model.config, "_attn_implementation", "sdpa")
        if cfg.share_prefix and attn not in ("sdpa", "eager"):
            # Other kernels (flash-attention) ignore a custom 4D mask: results would be wrong.
            raise ValueError(
                f"IG share_prefix needs attn_implementation 'sdpa' or 'eager', the model uses "
                f"{attn!r}: load it with attn_implementation='sdpa' or set ig.share_prefix=false"
            )
        super().__init__(tokenizer, cfg)
        self.model = model.eval()
        self.version = version
        pad = tokenizer.pad_token_id
        self.pad_id = pad if pad is not None else (tokenizer.eos_token_id or 0)

    def batches(self, rows: list[_Row]) -> list[list[_Row]]:
        """Greedy packing, longest first, so rows x longest row <= token_budget.

        Sorting by length keeps padding small. A single row longer than the budget still
        gets a batch of its own (it must be scored; the budget bounds the batching only).
        """
        batches: list[list[_Row]] = []
        current: list[_Row] = []
        for row in sorted(rows, key=lambda r: len(r.ids), reverse=True):
            width = len(current[0].ids) if current else len(row.ids)
            if current and (len(current) + 1) * width > self.cfg.token_budget:
                batches.append(current)
                current = []
            current.append(row)
        if current:
            batches.append(current)
        return batches

    # -- forward passes --------------------------------------------------------------------
    @torch.inference_mode()
    def _score_batch(self, batch: list[_Row]) -> list[float]:
        """Mean gold log-prob of each row, one forward of the base model for the batch."""
        device = self.model.get_output_embeddings().weight.device
        width = max(len(r.ids) for r in batch)
        input_ids = torch.full((len(batch), width), self.pad_id, dtype=torch.long)
        for i, r in enumerate(batch):
            input_ids[i, : len(r.ids)] = torch.tensor(r.ids)
        # Right padding, no mask: real tokens keep positions 0..n-1 and causal attention never
        # lets them see the pads, so each row matches its unpadded forward, and SDPA runs its
        # fused causal kernel (a padding mask would materialise the full score matrix).
        hidden = self.model.base_model(input_ids=input_ids.to(device)).last_hidden_state
        row_idx = torch.tensor([i for i, r in enumerate(batch) for _ in r.predict_at])
        pos_idx = torch.tensor([p for r in batch for p in r.predict_at])
        targets = torch.tensor([t for r in batch for t in r.targets], device=device)
        picked = hidden[row_idx.to(device), pos_idx.to(device)]  # [N, H]: only gold positions
        logits = self.model.get_output_embeddings()(picked).float()
        token_lp = torch.log_softmax(logits, dim=-1).gather(1, targets[:, None])[:, 0]
        out, start = [], 0
        for r in batch:
            out.append(token_lp[start : start + len(r.targets)].double().mean().item())
            start += len(r.targets)
        return out

    @torch.inference_mode()
    def _score_row_full(self, row: _Row) -> float:
        """Reference: full forward with full logits on one unpadded row."""
        device = self.model.get_output_embeddings().weight.device
        ids = torch.tensor([row.ids], device=device)
        logp = torch.log_softmax(self.model(input_ids=ids).logits[0].float(), dim=-1)
        token_lp = logp[row.predict_at, row.targets]
        return token_lp.double().mean().item()

    # -- shared-prefix path -----------------------------------------------------------------
    def shared_items(self, trajectories: Sequence[Trajectory]) -> list[_Shared]:
        """One item per trajectory with turns (validates all before any compute)."""
        items = []
        for i, traj in enumerate(trajectories):
            tpl = self.template(self._gold(traj))
            ctxs = boundary_contexts(traj)
            if ctxs:
                items.append(_Shared(i, ctxs[-1], [len(c) for c in ctxs], tpl))
        return items

    def shared_batches(self, items: list[_Shared]) -> list[list[_Shared]]:
        """Greedy packing, widest first: rows x widest (context + T templates) <= budget."""
        batches: list[list[_Shared]] = []
        current: list[_Shared] = []
        for item in sorted(items, key=lambda it: it.width, reverse=True):
            if current and (len(current) + 1) * current[0].width > self.cfg.token_budget:
                batches.append(current)
                current = []
            current.append(item)
        if current:
            batches.append(current)
        return batches

    @torch.inference_mode()
    def _score_shared(self, items: list[_Shared]) -> dict[tuple[int, int], float]:
        """Two passes for a batch of trajectories: contexts (with cache), then all templates."""
        base, head = self.model.base_model, self.model.get_output_embeddings()
        device = head.weight.device
        n_ctx = max(len(it.context) for it in items)
        ctx_ids = torch.full((len(items), n_ctx), self.pad_id, dtype=torch.long)
        for i, it in enumerate(items):
            ctx_ids[i, : len(it.context)] = torch.tensor(it.context)
        # No padding mask: contexts are right-padded and attention is causal, so no real token
        # sees a pad, and the templates' own mask hides the pads' cache entries. Without a
        # mask SDPA takes its fused causal kernel instead of materialising [B, H, L, L]
        # scores (5x faster on CPU at 16 x 1000 tokens).
        first = base(input_ids=ctx_ids.to(device), use_cache=True)
        dtype = first.last_hidden_state.dtype
        tpl_ids, pos_ids, mask = _template_block(items, n_ctx, self.pad_id, dtype)
        second = base(
            input_ids=tpl_ids.to(device),
            attention_mask=mask.to(device),
            position_ids=pos_ids.to(device),
            past_key_values=first.past_key_values,
            use_cache=True,
        )
        # Positions index the concatenation [context hidden | template hidden]: a gold token
        # at template index k is predicted by template token k-1, or by the context's last
        # token when k = 0 (empty prefix).
        hidden = torch.cat([first.last_hidden_state, second.last_hidden_state], dim=1)
        rows, cols, targets, owners = [], [], [], []
        for i, it in enumerate(items):
            m = len(it.template.ids)
            for b, n in enumerate(it.lengths):
                for k in it.template.gold_positions:
                    rows.append(i)
                    cols.append(n - 1 if k == 0 else n_ctx + b * m + k - 1)
                    targets.append(it.template.ids[k])
                    owners.append((it.traj, b))
        picked = hidden[torch.tensor(rows, device=device), torch.tensor(cols, device=device)]
        logp = torch.log_softmax(head(picked).float(), dim=-1)
        token_lp = logp.gather(1, torch.tensor(targets, device=device)[:, None])[:, 0].double()
        sums: dict[tuple[int, int], list[float]] = {}
        for key, lp in zip(owners, token_lp.tolist()):
            sums.setdefault(key, []).append(lp)
        return {key: sum(v) / len(v) for key, v in sums.items()}

    # -- public API ------------------------------------------------------------------------
    def score(
        self, trajectories: Sequence[Trajectory], *, version: int | None = None
    ) -> list[IGResult]:
        """IG for every trajectory, batched under ``cfg.token_budget`` (see module doc)."""
        values: dict[tuple[int, int], float] = {}
        if self.cfg.share_prefix:
            for group in self.shared_batches(self.shared_items(trajectories)):
                values.update(self._score_shared(group))
        else:
            for batch in self.batches(self.rows(trajectories)):
                for r, v in zip(batch, self._score_batch(batch)):
                    values[(r.traj, r.boundary)] = v
        return self._results(trajectories, values, version)

    def score_per_turn(
        self, trajectories: Sequence[Trajectory], *, version: int | None = None
    ) -> list[IGResult]:
        """Same results, one full forward per boundary (the slow, obviously-right path)."""
        values = {(r.traj, r.boundary): self._score_row_full(r) for r in self.rows(trajectories)}
        return self._results(trajectories, values, version)

    def _results(
        self,
        trajectories: Sequence[Trajectory],
        values: dict[tuple[int, int], float],
        version: int | None,
    ) -> list[IGResult]:
        v = self.version if version is None else version
        return self.results(trajectories, values, [v] * len(trajectories))


def write_ig_rewards(traj: Trajectory, result: IGResult) -> None:
    """Put IG_1..IG_{T-1} into ``turn.rewards["ig"]`` of turns 1..T-1 and record the version.

    The final turn is left alone: its reward is the outcome.
    """
    if result.trajectory_id != traj.trajectory_id:
        raise ValueError(f"IG result {result.trajectory_id} is not for {traj.trajectory_id}")
    for turn, gain in zip(traj.turns[:-1], result.ig):
        turn.rewards["ig"] = gain
        turn.reward_versions["ig"] = result.version
