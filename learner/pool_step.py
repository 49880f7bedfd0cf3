"""Fused optimizer steps of the pool learner: several tenants' batches through one base pass.

Each tenant brings the mini-batch of its next optimizer step (a ``TokenBatch`` with its own
advantages), its loss settings and its micro-batch size. The k-th micro-batch of every tenant
goes through one forward and one backward of the shared base model, each row through its own
tenant's adapter slot (``learner.adapter_slots``); each tenant's loss is computed on its own rows
with its own settings and weighed by its own share of its mini-batch (rows, or tokens for a
token-mean PPO loss, as ``learner.worker`` weighs micro-batches), so after the last micro-batch
every slot holds exactly the gradient its tenant's step alone would give. Each slot then clips
by its own norm and steps its own optimizer (a non-finite gradient skips that tenant's step
only). The rows of one pass share one sampling temperature: tenants that sample at different
temperatures go in passes of their own (``fused_steps``).

On-policy steps (one epoch, one mini-batch: old log-probs are the current ones, detached), as
``learner.worker`` takes by default. Pure torch: no Ray, no I/O.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from learner.adapter_slots import SlotTable
from learner.batching import TokenBatch, micro_share
from learner.losses import LossInputs, policy_loss
from learner.losses.config import LossConfig
from rollout.next_token import next_token_logprobs


@dataclass
class TenantStep:
    """One tenant's share of a fused step."""

    slot: str
    batch: TokenBatch
    """The rows of its optimizer step, advantages set (``learner.batching``)."""
    loss: LossConfig
    micro_batch_size: int
    temperature: float = 1.0
    """Its rollout sampling temperature (log-probs are taken at it)."""
    metrics: dict[str, float] = field(default_factory=dict)
    """What its batch held (``learner.step_metrics.batch_metrics``), reported with its step."""

    def micro_batches(self) -> list[TokenBatch]:
        n = self.batch.input_ids.size(0)
        return [self.batch.rows(a, min(a + self.micro_batch_size, n)) for a in range(0, n, self.micro_batch_size)]

    def share(self, mb: TokenBatch) -> float:
        """``mb``'s weight in its step, as the run's own learner weighs it."""
        return micro_share(self.loss, mb, self.batch.input_ids.size(0), self.batch.num_tokens)


def _pad_cat(parts: Sequence[torch.Tensor], width: int, value: int) -> torch.Tensor:
    return torch.cat([torch.nn.functional.pad(p, (0, width - p.size(1)), value=value) for p in parts])


def fused_pass(table: SlotTable, steps: Sequence[TenantStep], mbs: Sequence[TokenBatch],
               pad_id: int) -> dict[str, dict[str, float]]:
    """One forward and backward of micro-batches ``mbs`` (one per tenant of ``steps``, all at one
    temperature): each tenant's loss, weighed by its share, backpropagated into its own slot.
    Returns each tenant's loss metrics."""
    width = max(mb.input_ids.size(1) for mb in mbs)
    ids = _pad_cat([mb.input_ids for mb in mbs], width, pad_id)
    mask = _pad_cat([mb.attention_mask for mb in mbs], width, 0)
    device = next(iter(table.model.parameters())).device
    ids, mask = ids.to(device), mask.to(device)
    rows = [s.slot for s, mb in zip(steps, mbs) for _ in range(mb.input_ids.size(0))]
    with table.route(rows):  # no shared prefix pass: its one row would go through one tenant's adapter
        logp, entropy = next_token_logprobs(table.model, ids, mask, 0, steps[0].temperature,
                                            entropy=any(s.loss.type == "ppo" and s.loss.entropy_coef > 0 for s in steps))
    total, out, start = logp.new_zeros(()), {}, 0
    for step, mb in zip(steps, mbs):
        n, cols = mb.input_ids.size(0), mb.loss_mask.size(1)
        mb = mb.to(device)
        mine = logp[start:start + n, :cols]
        inputs = LossInputs(logprobs=mine, old_logprobs=mine.detach(), behaviour_logprobs=mb.behaviour,
                            advantages=mb.advantages, mask=mb.loss_mask, turn_ids=mb.turn_ids,
                            clip_low=mb.clip_low, clip_high=mb.clip_high,
                            entropy=None if entropy is None else entropy[start:start + n, :cols])
        loss, metrics = policy_loss(inputs, step.loss, None)
        total = total + loss * step.share(mb)
        out[step.slot], start = metrics, start + n
    total.backward()
    return out


def fused_steps(table: SlotTable, steps: Sequence[TenantStep], pad_id: int) -> dict[str, bool]:
    """One optimizer step of every tenant in ``steps`` (one tenant each): their k-th
    micro-batches run together (one pass per temperature), then each slot steps alone.
    Returns, per tenant, whether its step was taken (False: a non-finite gradient, skipped)."""
    if len({s.slot for s in steps}) != len(steps):
        raise ValueError("a fused step takes one mini-batch per tenant")
    by_temp: dict[float, list[TenantStep]] = {}
    for s in steps:
        by_temp.setdefault(s.temperature, []).append(s)
    sums: dict[str, dict[str, float]] = {s.slot: {} for s in steps}
    for group in by_temp.values():
        queues = [s.micro_batches() for s in group]
        for k in range(max(len(q) for q in queues)):
            live = [(s, q[k]) for s, q in zip(group, queues) if k < len(q)]
            metrics = fused_pass(table, [s for s, _ in live], [mb for _, mb in live], pad_id)
            for s, mb in live:  # each micro-batch's metrics weighed as its loss is
                for key, value in metrics[s.slot].items():
                    sums[s.slot][f"loss/{key}"] = sums[s.slot].get(f"loss/{key}", 0.0) + value * s.share(mb)
    took = {s.slot: table.slots[s.slot].take_step() for s in steps}
    for s in steps:
        table.slots[s.slot].metrics.update(sums[s.slot])
    return took
