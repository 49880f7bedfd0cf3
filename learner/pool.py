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
from learner.config import LearnerConfig
from learner.pool_step import TenantStep, fused_steps
from learner.ports import LearnerPorts
from learner.run_files import keep_steps_through, log_trained
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


class PoolLearner:
    """The base model at ``base_path``, adapted on ``targets`` (the pool's
    ``learner.lora.target_modules``), and the tenants attached to it."""

    def __init__(self, base_path: str, targets: list[str], *, coalesce_s: float = 0.5, device: str = "cpu") -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from storage import node_copy

        local = node_copy(base_path)
        self.tokenizer = AutoTokenizer.from_pretrained(local)
        model = AutoModelForCausalLM.from_pretrained(local, dtype=torch.float32).to(device)
        self.targets, self.coalesce_s = list(targets), coalesce_s
        self.table = SlotTable(model, self.targets)
        self.tenants: dict[str, Tenant] = {}
        self.rounds = 0

    def attach(self, name: str, cfg: LearnerConfig, ports: LearnerPorts, *, temperature: float,
               rewards: Any = None, initial: Mapping[str, torch.Tensor] | None = None, seed: int = 0,
               run_dir: str | Path | None = None, resume: bool = False) -> int:
        """Give run ``name`` a slot: a fresh adapter, ``initial``'s tensors, or with ``resume``
        its last checkpoint in ``run_dir`` (adapter, optimizer, step, version, live baselines;
        its trained-groups log cut back to that step: later steps are trained again). Publishes
        the slot's current version (engines serve a LoRA run only with its adapter loaded) and
        returns it."""
        check_tenant(cfg, self.targets)
        lora = cfg.lora
        assert lora is not None
        slot = self.table.attach(name, SlotSettings(rank=lora.rank, alpha=lora.alpha, lr=cfg.lr,
                                                    weight_decay=cfg.weight_decay, grad_clip=cfg.grad_clip, seed=seed))
        if initial is not None:
            slot.load_adapter(initial)
        state = resume_state(None, Path(run_dir)) if resume and run_dir is not None else None
        tenant = Tenant(name, cfg, ports, BatchAdvantages.of_run(cfg, rewards, state), temperature,
                        Path(run_dir) if run_dir is not None else None)
        if state is not None:
            slot.load_state_dict(torch.load(Path(run_dir) / state["pool_slot"], weights_only=False))
            tenant.step, tenant.version = state["step"], state["version"]
            keep_steps_through(self._trained_log(tenant), tenant.step)
        self.tenants[name] = tenant
        ports.publish(tenant.version, slot.adapter_state(), None)
        return tenant.version

    def detach(self, name: str) -> None:
        """Free run ``name``'s slot at once (its adapter and optimizer state go with it)."""
        self.tenants.pop(name)
        self.table.detach(name)

    def slot(self, name: str) -> AdapterSlot:
        return self.table.slots[name]

    # -- training --------------------------------------------------------------------------
    def train_round(self, wait_s: float = 5.0) -> dict[str, dict[str, float]]:
        """One fused step of every tenant with a batch ready: wait up to ``wait_s`` for a
        first one, then up to ``coalesce_s`` for the rest. Returns each trained tenant's metrics."""
        claims = self._claims(wait_s)
        if not claims:
            return {}
        self.rounds += 1
        t0 = time.perf_counter()
        steps = {name: self._step_of(self.tenants[name], claim) for name, claim in claims.items()}
        took = fused_steps(self.table, list(steps.values()), self.tokenizer.pad_token_id or 0)
        elapsed = time.perf_counter() - t0
        out = {}
        for name, claim in claims.items():
            tenant, slot = self.tenants[name], self.table.slots[name]
            tenant.step, tenant.version, tenant.last_round = tenant.step + 1, tenant.version + 1, self.rounds
            tenant.ports.publish(tenant.version, slot.adapter_state(), (claim.claim_id, not tenant.cfg.checkpoint_every))
            self._log_trained(tenant, claim)
            if tenant.cfg.checkpoint_every and tenant.step % tenant.cfg.checkpoint_every == 0:
                self.save_checkpoint(name)
            tenant.metrics = {**slot.metrics, "step": float(tenant.step), "version": float(tenant.version),
                              "skipped": float(not took[name]), "pool/tenants_in_step": float(len(claims)),
                              "time/update_s": elapsed, "tokens/trained": steps[name].batch.num_tokens}
            out[name] = tenant.metrics
        return out

    def _step_of(self, tenant: Tenant, claim: Claim) -> TenantStep:
        """``claim``'s trajectories as ``tenant``'s share of a fused step: its advantages, its rows."""
        trajs, res, mask = tenant.advantages([t for g in claim.groups for t in g.trajectories])
        tb = build_token_batch(trajs, res.advantages, mask, self.tokenizer.pad_token_id, res.clip_low, res.clip_high)
        return TenantStep(tenant.name, tb, tenant.cfg.loss, tenant.cfg.micro_batch_size, tenant.temperature)

    def _order(self) -> list[Tenant]:
        """Tenants, those that trained longest ago first."""
        return sorted(self.tenants.values(), key=lambda t: t.last_round)

    def _claims(self, wait_s: float) -> dict[str, Claim]:
        claims: dict[str, Claim] = {}
        deadline, first = time.monotonic() + wait_s, None
        while True:
            for tenant in self._order():
                if tenant.name not in claims:
                    got = tenant.ports.claim(tenant.cfg.batch_groups, None, 0.0)
                    if got is not None:
                        claims[tenant.name] = got
                        first = first or time.monotonic()
            now = time.monotonic()
            if len(claims) == len(self.tenants) or (first is not None and now - first >= self.coalesce_s) \
                    or (first is None and now >= deadline):
                return claims
            time.sleep(0.02)

    # -- checkpoints -------------------------------------------------------------------------
    def save_checkpoint(self, name: str) -> Path:
        """Tenant ``name``'s slot (adapter, optimizer, counters) under its run directory, then
        ``state.json``, then the commit of its acknowledged groups in its replay: only now is
        this version's update durable. Returns the checkpoint file."""
        tenant = self.tenants[name]
        if tenant.run_dir is None:
            raise ValueError(f"tenant {name!r} attached without a run_dir: nowhere to checkpoint")
        rel = Path("pool_checkpoint") / f"{checkpoint_tag(tenant.step)}.pt"
        path = tenant.run_dir / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        torch.save(self.table.slots[name].state_dict(), tmp)
        tmp.replace(path)
        write_state(tenant.run_dir, None, {
            "step": tenant.step, "version": tenant.version, "pool_slot": str(rel), **tenant.advantages.saved()})
        tenant.ports.commit(tenant.version)
        return path

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
    """What the pool learner trains: a LoRA adapter on the pool's layers, with on-policy PPO;
    anything else is refused naming the field."""
    if cfg.lora is None:
        raise ValueError("learner.lora: a run on a pool learner trains a LoRA adapter; set learner.lora")
    if sorted(cfg.lora.target_modules) != sorted(targets):
        raise ValueError(f"learner.lora.target_modules {cfg.lora.target_modules} differ from the pool's {targets}: "
                         "every adapter of a pool adapts the same layers")
    if cfg.loss.type != "ppo":
        raise ValueError(f"learner.loss.type {cfg.loss.type!r}: the pool learner trains the ppo loss")
    if cfg.ppo_epochs != 1 or cfg.mini_batches != 1:
        raise ValueError("learner.ppo_epochs and learner.mini_batches: the pool learner takes on-policy steps "
                         "(one epoch, one mini-batch)")
    if cfg.loss.kl_coef > 0:
        raise ValueError("learner.loss.kl_coef: the pool learner has no KL term yet; set it to 0")
