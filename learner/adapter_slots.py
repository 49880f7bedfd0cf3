"""Trainable LoRA adapter slots on one frozen base model: the pool learner's model.

Each tenant of an engine pool trains a LoRA adapter of the pool's base. ``SlotTable`` holds the
base once, frozen, and a slot per tenant: its adapter (``A`` ``[rank, in]`` and ``B`` ``[out,
rank]`` per adapted linear layer, scale ``alpha / rank``), its own AdamW state, step counter and
learning rate. A forward pass mixes tenants row by row: ``route`` names each row's slot, and a
hook on every adapted layer adds ``scale * (x A^T) B^T`` to that slot's rows only (one gather
and one index-add per slot and layer, the per-row routing the HF engine decodes mixed adapters
with, ``rollout.engines.adapters``, here with gradients). A row's output depends on its own
slot's tensors alone, so one backward through a mixed batch gives each slot exactly the gradient
of its own rows' loss, and a slot's optimizer never sees another's.

A fresh slot starts as peft starts a LoRA adapter (``A`` Kaiming-uniform, ``B`` zero: the base
model exactly), from a seed of its own. Plain torch: no Ray, no DeepSpeed.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch

from learner.lora import check_targets
from rollout.engines.adapters import A_SUFFIX, B_SUFFIX


@dataclass
class SlotSettings:
    """What a tenant's adapter and optimizer are made of (its run's ``learner.lora`` and
    ``learner`` settings)."""

    rank: int = 16
    alpha: float = 32.0
    lr: float = 1e-4
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    warmup_steps: int = 0
    """Steps over which the learning rate rises linearly to ``lr`` (0: constant)."""
    seed: int = 0
    """Seed of the adapter's initial ``A``."""


@dataclass
class AdapterSlot:
    """One tenant's adapter, optimizer and step counter."""

    name: str
    settings: SlotSettings
    layers: dict[str, tuple[torch.nn.Parameter, torch.nn.Parameter]]
    optimizer: torch.optim.Optimizer
    step: int = 0
    skipped: int = 0
    """Steps skipped for a non-finite gradient."""
    metrics: dict[str, float] = field(default_factory=dict)

    @property
    def scale(self) -> float:
        return self.settings.alpha / self.settings.rank

    def parameters(self) -> list[torch.nn.Parameter]:
        return [p for pair in self.layers.values() for p in pair]

    @property
    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def lr_at(self, step: int) -> float:
        warm = self.settings.warmup_steps
        return self.settings.lr * (min(1.0, (step + 1) / warm) if warm > 0 else 1.0)

    def adapter_state(self) -> dict[str, torch.Tensor]:
        """The adapter as engines load it (``<module>.lora_A.weight``, ``.lora_B.weight``)."""
        out: dict[str, torch.Tensor] = {}
        for module, (a, b) in self.layers.items():
            out[module + A_SUFFIX], out[module + B_SUFFIX] = a.detach().clone(), b.detach().clone()
        return out

    def state_dict(self) -> dict[str, Any]:
        """Everything a checkpoint of the slot holds: adapter, optimizer, counters."""
        return {"adapter": self.adapter_state(), "optimizer": self.optimizer.state_dict(),
                "step": self.step, "skipped": self.skipped}

    def load_adapter(self, state: Mapping[str, torch.Tensor]) -> None:
        """Adapter tensors as engines load them (``adapter_state``'s names) into this slot."""
        missing = sorted(m for m in self.layers if m + A_SUFFIX not in state or m + B_SUFFIX not in state)
        if missing:
            raise ValueError(f"adapter state lacks layers {missing[:3]}{'...' if len(missing) > 3 else ''}")
        with torch.no_grad():
            for module, (a, b) in self.layers.items():
                a.copy_(state[module + A_SUFFIX])
                b.copy_(state[module + B_SUFFIX])

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.load_adapter(state["adapter"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.step, self.skipped = int(state["step"]), int(state["skipped"])

    def take_step(self) -> bool:
        """Clip this slot's gradient by its own norm and step its optimizer; a non-finite
        gradient skips the step (this slot's only) and is dropped. Returns whether it stepped."""
        params = self.parameters()
        norm = torch.nn.utils.clip_grad_norm_(params, self.settings.grad_clip)
        self.metrics = {"grad_norm": float(norm)}
        if not torch.isfinite(norm):
            self.skipped += 1
            self.optimizer.zero_grad(set_to_none=True)
            return False
        for group in self.optimizer.param_groups:
            group["lr"] = self.lr_at(self.step)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        return True


class SlotTable:
    """The frozen base ``model`` and the slots trained on it; ``targets`` name the adapted
    linear layers (as ``learner.lora.target_modules``: names or dotted suffixes)."""

    def __init__(self, model: torch.nn.Module, targets: Sequence[str]) -> None:
        check_targets(model, list(targets))
        self.model = model.requires_grad_(False)
        self.modules = {name: mod for name, mod in model.named_modules() if isinstance(mod, torch.nn.Linear)
                        and any(name == t or name.endswith("." + t) for t in targets)}
        self.slots: dict[str, AdapterSlot] = {}
        self._groups: list[tuple[AdapterSlot, torch.Tensor]] = []
        for name, module in self.modules.items():
            module.register_forward_hook(self._hook(name))

    def attach(self, name: str, settings: SlotSettings) -> AdapterSlot:
        """A fresh slot for tenant ``name``: B zero (the base model exactly), A from its seed."""
        if name in self.slots:
            raise ValueError(f"adapter slot {name!r} is taken: detach it first")
        gen = torch.Generator().manual_seed(settings.seed)
        weight = next(iter(self.model.parameters()))
        layers = {}
        for module, linear in self.modules.items():
            a = torch.empty(settings.rank, linear.in_features)
            with torch.no_grad():  # as peft and nn.Linear start A, from the slot's own generator
                torch.nn.init.kaiming_uniform_(a, a=math.sqrt(5), generator=gen)
            b = torch.zeros(linear.out_features, settings.rank)
            layers[module] = (torch.nn.Parameter(a.to(weight)), torch.nn.Parameter(b.to(weight)))
        params = [p for pair in layers.values() for p in pair]
        opt = torch.optim.AdamW(params, lr=settings.lr, weight_decay=settings.weight_decay)
        slot = AdapterSlot(name, settings, layers, opt)
        self.slots[name] = slot
        return slot

    def detach(self, name: str) -> AdapterSlot:
        """Free tenant ``name``'s slot (its tensors and optimizer state go with it)."""
        return self.slots.pop(name)

    @contextmanager
    def route(self, row_slots: Sequence[str | None]) -> Iterator[None]:
        """Forward passes inside go row ``i`` through slot ``row_slots[i]`` (None: the base)."""
        device = next(iter(self.model.parameters())).device
        by_slot: dict[str, list[int]] = {}
        for i, name in enumerate(row_slots):
            if name is not None:
                by_slot.setdefault(name, []).append(i)
        unknown = sorted(set(by_slot) - set(self.slots))
        if unknown:
            raise KeyError(f"rows name adapter slots {unknown} that are not attached")
        self._groups = [(self.slots[n], torch.tensor(rows, device=device)) for n, rows in by_slot.items()]
        try:
            yield
        finally:
            self._groups = []

    def _hook(self, module: str):  # type: ignore[no-untyped-def]
        def add_adapters(_mod: torch.nn.Module, inputs: tuple[torch.Tensor, ...], out: torch.Tensor) -> torch.Tensor:
            # In place: the out-of-place index_add copied the whole output once per slot, which
            # made a fused pass of T tenants cost T full copies per layer (the linear's backward
            # needs its input and weight, not its output, so writing into it is safe).
            x = inputs[0]
            for slot, rows in self._groups:
                a, b = slot.layers[module]
                delta = (x.index_select(0, rows) @ a.t()) @ b.t() * slot.scale
                out.index_add_(0, rows, delta.to(out.dtype))
            return out
        return add_adapters
