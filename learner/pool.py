"""The pool learner: one process holding a pool's base model once and an adapter slot per LoRA
run attached to it, training them in fused steps.

A tenant (a LoRA run on the pool) attaches with its own learner settings and its own ports (its
replay, its weight sync): its slot (``learner.adapter_slots``: adapter, AdamW state, step
counter, learning rate), its advantages (``learner.advantages.assemble.BatchAdvantages``: its
estimator, reward weights and live baselines), its sampling temperature. ``train_round`` claims
a batch for every tenant whose replay has one ready, in a fair order (the tenants served last
go first), waits at most ``coalesce_s`` for the others once one is ready, trains the ready ones
in one fused step (``learner.pool_step``) and publishes each one's new adapter version to its
own weight sync, which acknowledges its claim once the engines serve it. A tenant that trained
in a round goes to the back of the order, so a tenant whose batches are always ready (a flood
of live traffic) cannot keep a slower one out of the fused steps.

What a tenant's step computes is what ``learner.worker`` computes for a LoRA run of its own
(on-policy PPO: one epoch, one mini-batch), shown equal by the tests. Plain Python: the
driver wraps it with ``ray.remote``.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from learner.adapter_slots import AdapterSlot, SlotSettings, SlotTable
from learner.advantages.assemble import BatchAdvantages
from learner.batching import build_token_batch
from learner.checkpoints import checkpoint_tag, resume_state, write_state
from learner.config import LearnerConfig, pool_learner_refusal
from learner.lora import write_adapter
from learner.pool_step import TenantStep, fused_steps
from learner.ports import LearnerPorts, claim_batch
from learner.run_files import keep_steps_through, log_trained
from learner.step_metrics import batch_metrics
from replay.base import Claim


@dataclass
class Tenant:
    """One attached run: its settings, ports, advantages and counters."""

    name: str
    cfg: LearnerConfig
    ports: LearnerPorts
    advantages: BatchAdvantages
    temperature: float
    run_dir: Path | None = None
    """Where its checkpoints and trained-groups log go (None: nowhere, a bench or a test)."""
    version: int = 0
    step: int = 0
    last_round: int = -1
    """The round it last trained in (the fair order's key)."""
    metrics: dict[str, float] = field(default_factory=dict)
    live_groups: int = 0
    """Live sessions in each of its batches (``learner.ports.claim_batch``)."""
    requested: int | None = None
    """Steps its driver asked for and has not had (None: trained whenever a batch is ready)."""
    resumed_from: tuple[int, int] = (0, 0)
    """(step, version) of the checkpoint it attached from ((0, 0): none)."""


class PoolLearner:
    """The base model at ``base_path``, adapted on ``targets`` (the pool's
    ``learner.lora.target_modules``), and the tenants attached to it."""

    def __init__(self, base_path: str, targets: list[str], *, coalesce_s: float = 0.5, device: str = "cpu") -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from storage import node_copy

        self.base = str(Path(base_path).resolve()) if Path(base_path).exists() else base_path
        """The base as its runs' LoRA checkpoints name it."""
        local = node_copy(base_path)
        self.tokenizer = AutoTokenizer.from_pretrained(local)
        model = AutoModelForCausalLM.from_pretrained(local, dtype=torch.float32).to(device)
        self.targets, self.coalesce_s = list(targets), coalesce_s
        self.table = SlotTable(model, self.targets)
        self.tenants: dict[str, Tenant] = {}
        self.rounds = 0
        self.failed: dict[str, str] = {}
        """Runs detached because their ports failed, with why (until they attach again)."""

    def attach(self, name: str, cfg: LearnerConfig, ports: LearnerPorts, *, temperature: float,
               rewards: Any = None, initial: Mapping[str, torch.Tensor] | None = None, seed: int = 0,
               run_dir: str | Path | None = None, resume: bool = False, version_floor: int = 0,
               live_groups: int = 0, on_request: bool = False) -> int:
        """Give run ``name`` a slot: a fresh adapter, ``initial``'s tensors, or with ``resume``
        its last checkpoint in ``run_dir`` (adapter, optimizer, step, version, live baselines;
        its trained-groups log cut back to that step: later steps are trained again). Publishes
        the slot's current version (engines serve a LoRA run only with its adapter loaded) and
        returns it; ``version_floor`` (a learner replaced inside a running job: the newest
        version its engines serve) makes that the next version above it. ``on_request``: it
        trains only the steps its driver asks for (``request``), as a run's own learner does."""
        check_tenant(cfg, self.targets)
        lora = cfg.lora
        assert lora is not None
        slot = self.table.attach(name, SlotSettings(rank=lora.rank, alpha=lora.alpha, lr=cfg.lr,
                                                    weight_decay=cfg.weight_decay, grad_clip=cfg.grad_clip, seed=seed))
        try:
            tenant = self._tenant(name, cfg, ports, temperature, rewards, initial, run_dir, resume)
        except BaseException:
            self.table.detach(name)
            raise
        tenant.live_groups, tenant.requested = live_groups, 0 if on_request else None
        if version_floor:
            tenant.version = max(tenant.version, version_floor) + 1
        self.tenants[name] = tenant
        ports.publish(tenant.version, slot.adapter_state(), None)
        return tenant.version

    def _tenant(self, name: str, cfg: LearnerConfig, ports: LearnerPorts, temperature: float, rewards: Any,
                initial: Mapping[str, torch.Tensor] | None, run_dir: str | Path | None, resume: bool) -> Tenant:
        """Run ``name``'s tenant record, its slot loaded from ``initial`` or its checkpoint."""
        slot = self.table.slots[name]
        if initial is not None:
            slot.load_adapter(initial)
        state = resume_state(None, Path(run_dir)) if resume and run_dir is not None else None
        tenant = Tenant(name, cfg, ports, BatchAdvantages.of_run(cfg, rewards, state), temperature,
                        Path(run_dir) if run_dir is not None else None)
        if state is not None:
            slot.load_state_dict(torch.load(Path(run_dir) / state["pool_slot"], weights_only=False))
            tenant.step, tenant.version = state["step"], state["version"]
            tenant.resumed_from = (tenant.step, tenant.version)
            keep_steps_through(self._trained_log(tenant), tenant.step)
        return tenant

    def request(self, name: str, steps: int = 1) -> None:
        """Run ``name``'s driver asks for ``steps`` more steps (``on_request`` tenants); 0 or
        less withdraws what it asked for and had not had."""
        tenant = self.tenants[name]
        tenant.requested = max(0, (tenant.requested or 0) + steps) if steps > 0 else 0

    def detach(self, name: str) -> None:
        """Free run ``name``'s slot at once (its adapter and optimizer state go with it)."""
        self.tenants.pop(name)
        self.table.detach(name)

    def drop(self, name: str, exc: BaseException) -> None:
        """Detach run ``name`` after its own ports failed (its run died or is dying: its
        replay or weight sync is gone); the others' round goes on. Its claim, not acknowledged,
        is delivered again when it attaches from its checkpoint."""
        self.failed[name] = f"{type(exc).__name__}: {exc}"
        if name in self.tenants:
            self.detach(name)

    def slot(self, name: str) -> AdapterSlot:
        return self.table.slots[name]

    # -- training --------------------------------------------------------------------------
    def train_round(self, wait_s: float = 5.0) -> dict[str, dict[str, float]]:
        """One fused step of every tenant with a batch ready: wait up to ``wait_s`` for a
        first one, then up to ``coalesce_s`` for the rest. Returns each trained tenant's metrics;
        a tenant whose ports fail is dropped (``failed``) and the others train."""
        t_wait = time.perf_counter()
        claims = self._claims(wait_s)
        steps = {}
        for name, claim in claims.items():
            try:
                steps[name] = self._step_of(self.tenants[name], claim)
            except Exception as exc:  # noqa: BLE001 - its batch, not the others'
                self.drop(name, exc)
        if not steps:
            return {}
        self.rounds += 1
        t0 = time.perf_counter()
        took = fused_steps(self.table, list(steps.values()), self.tokenizer.pad_token_id or 0)
        elapsed = time.perf_counter() - t0
        out = {}
        for name, step in steps.items():
            try:
                out[name] = self._finish(self.tenants[name], claims[name], step, took[name], len(steps))
            except Exception as exc:  # noqa: BLE001 - its weight sync or replay, not the others'
                self.drop(name, exc)
                continue
            out[name] |= {"time/update_s": elapsed, "time/wait_s": t0 - t_wait}
        return out

    def _finish(self, tenant: Tenant, claim: Claim, step: TenantStep, took: bool, fused: int) -> dict[str, float]:
        """After ``tenant``'s share of a fused step: count it, publish its adapter (its claim
        acknowledged once served), log and checkpoint; returns its metrics."""
        slot = self.table.slots[tenant.name]
        tenant.step, tenant.version, tenant.last_round = tenant.step + 1, tenant.version + 1, self.rounds
        if tenant.requested is not None:
            tenant.requested = max(0, tenant.requested - 1)
        t0 = time.perf_counter()
        tenant.ports.publish(tenant.version, slot.adapter_state(), (claim.claim_id, not tenant.cfg.checkpoint_every))
        self._log_trained(tenant, claim)
        if tenant.cfg.checkpoint_every and tenant.step % tenant.cfg.checkpoint_every == 0:
            self.save_checkpoint(tenant.name)
        tenant.metrics = {**slot.metrics, **step.metrics, "step": float(tenant.step),
                          "version": float(tenant.version), "skipped": float(not took),
                          "pool/tenants_in_step": float(fused), "time/publish_s": time.perf_counter() - t0,
                          "tokens/trained": step.batch.num_tokens}
        return tenant.metrics

    def _step_of(self, tenant: Tenant, claim: Claim) -> TenantStep:
        """``claim``'s trajectories as ``tenant``'s share of a fused step: its advantages, its rows."""
        trajs = [t for g in claim.groups for t in g.trajectories]
        kept, res, mask = tenant.advantages(trajs)
        tb = build_token_batch(kept, res.advantages, mask, self.tokenizer.pad_token_id, res.clip_low, res.clip_high)
        return TenantStep(tenant.name, tb, tenant.cfg.loss, tenant.cfg.micro_batch_size, tenant.temperature,
                          metrics=batch_metrics(trajs, claim.staleness))

    def _order(self) -> list[Tenant]:
        """Tenants whose driver waits for a step, those that trained longest ago first."""
        return sorted((t for t in self.tenants.values() if t.requested is None or t.requested > 0),
                      key=lambda t: t.last_round)

    def _claims(self, wait_s: float) -> dict[str, Claim]:
        claims: dict[str, Claim] = {}
        deadline, first = time.monotonic() + wait_s, None
        while True:
            ready = self._order()
            for tenant in ready:
                if tenant.name not in claims:
                    try:
                        got = claim_batch(tenant.ports, tenant.cfg.batch_groups, tenant.live_groups,
                                          tenant.cfg.live_shortfall == "wait", 0.0)
                    except Exception as exc:  # noqa: BLE001 - its replay is gone: its run died
                        self.drop(tenant.name, exc)
                        continue
                    if got is not None:
                        claims[tenant.name] = got
                        first = first or time.monotonic()
            now = time.monotonic()
            if len(claims) == len(ready) or (first is not None and now - first >= self.coalesce_s) \
                    or (first is None and now >= deadline):
                return claims
            time.sleep(0.02)

    # -- checkpoints -------------------------------------------------------------------------
    def save_checkpoint(self, name: str) -> Path:
        """Tenant ``name``'s slot (adapter, optimizer, counters) under its run directory, its
        adapter as a LoRA checkpoint folder (``checkpoints/step_N``: what ``turnrl eval`` and
        ``turnrl models merge`` read, as a LoRA run's own learner writes), then ``state.json``,
        then the commit of its acknowledged groups in its replay: only now is this version's
        update durable. Returns the checkpoint folder."""
        tenant = self.tenants[name]
        if tenant.run_dir is None:
            raise ValueError(f"tenant {name!r} attached without a run_dir: nowhere to checkpoint")
        tag = checkpoint_tag(tenant.step)
        rel = Path("pool_checkpoint") / f"{tag}.pt"
        (tenant.run_dir / rel).parent.mkdir(parents=True, exist_ok=True)
        tmp = (tenant.run_dir / rel).with_suffix(".tmp")
        slot = self.table.slots[name]
        torch.save(slot.state_dict(), tmp)
        tmp.replace(tenant.run_dir / rel)
        assert tenant.cfg.lora is not None
        folder = tenant.run_dir / "checkpoints" / tag
        write_adapter(slot.adapter_state(), folder, self.base, tenant.cfg.lora)
        self.tokenizer.save_pretrained(folder)
        write_state(tenant.run_dir, None, {
            "step": tenant.step, "version": tenant.version, "hf_path": str(folder), "pool_slot": str(rel),
            **tenant.advantages.saved()})
        tenant.ports.commit(tenant.version)
        return folder

    @staticmethod
    def _trained_log(tenant: Tenant) -> Path:
        assert tenant.run_dir is not None
        return tenant.run_dir / "trained_groups.jsonl"

    def _log_trained(self, tenant: Tenant, claim: Claim) -> None:
        if tenant.run_dir is not None:
            log_trained(self._trained_log(tenant), tenant.step, tenant.version, claim)

    # -- what the driver and tests read ----------------------------------------------------
    def stats(self) -> dict[str, Any]:
        return {"tenants": sorted(self.tenants), "rounds": self.rounds,
                "adapter_parameters": {n: s.num_parameters for n, s in self.table.slots.items()}}


def check_tenant(cfg: LearnerConfig, targets: list[str]) -> None:
    """What the pool learner trains (``learner.config.pool_learner_refusal``), on the pool's
    layers; anything else is refused naming the field."""
    refusal = pool_learner_refusal(cfg)
    if refusal:
        raise ValueError(refusal)
    assert cfg.lora is not None
    if sorted(cfg.lora.target_modules) != sorted(targets):
        raise ValueError(f"learner.lora.target_modules {cfg.lora.target_modules} differ from the pool's {targets}: "
                         "every adapter of a pool adapts the same layers")
