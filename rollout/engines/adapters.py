"""LoRA adapters served on one base model by the HF engine: many resident at once, each request
decoded with its own, rows of different adapters in one batch.

An adapter is what a LoRA run trains (``learner.lora``): for each adapted linear layer ``W``
(``[out, in]``) a pair ``A`` (``[rank, in]``) and ``B`` (``[out, rank]``) and a scale
``alpha / rank``; the layer then computes ``x W^T + scale * (x A^T) B^T``, which is what the
merged weight ``W + scale * B A`` computes, without a copy of the model per adapter. Only the
adapter's tensors travel when it changes (kilobytes to megabytes, not the model).

``AdapterTable`` holds them. Every layer an adapter adapts gets a forward hook (installed once;
the model's own modules and state-dict names are untouched, so full-weight loads still apply)
that adds each row's own adapter term for the rows of the current forward pass that name one:
``route`` tells the hooks which rows go with which adapter, one gather and one scatter per
adapter and layer. Rows naming no adapter get the base model. A new version of an adapter
replaces its tensors in place between two forward passes; the others' rows decode on.

Adapter tensors arrive as a flat state dict under the base model's module names:
``<module>.lora_A.weight`` and ``<module>.lora_B.weight`` (``learner.lora.adapter_state``).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass

import torch

A_SUFFIX, B_SUFFIX = ".lora_A.weight", ".lora_B.weight"


@dataclass(frozen=True)
class Adapter:
    """One version of a named adapter, ready to serve."""

    name: str
    version: int
    scale: float
    """``alpha / rank``."""
    layers: dict[str, tuple[torch.Tensor, torch.Tensor]]
    """Module name -> (A ``[rank, in]``, B ``[out, rank]``)."""

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes + b.nbytes for a, b in self.layers.values())


def adapter_layers(state: Mapping[str, torch.Tensor]) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """``<module>.lora_A.weight`` / ``<module>.lora_B.weight`` pairs as module -> (A, B); a
    key of neither kind, or an A without its B, is refused naming it."""
    layers: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    for key in state:
        if key.endswith(A_SUFFIX):
            module = key.removesuffix(A_SUFFIX)
            if module + B_SUFFIX not in state:
                raise ValueError(f"adapter tensor {key!r} has no {module + B_SUFFIX!r}")
            layers[module] = (state[key], state[module + B_SUFFIX])
        elif not key.endswith(B_SUFFIX):
            raise ValueError(f"adapter tensor {key!r} is not <module>{A_SUFFIX} or <module>{B_SUFFIX}")
        elif key.removesuffix(B_SUFFIX) + A_SUFFIX not in state:
            raise ValueError(f"adapter tensor {key!r} has no {key.removesuffix(B_SUFFIX) + A_SUFFIX!r}")
    if not layers:
        raise ValueError("an adapter needs at least one <module>.lora_A.weight / .lora_B.weight pair")
    return layers


def check_layer(module: str, a: torch.Tensor, b: torch.Tensor, weight: tuple[int, ...] | None) -> None:
    """The one rule for "does this adapter layer fit the model": ``module`` is a linear layer
    (``weight``: its ``[out, in]`` shape; None: no such layer) and A ``[rank, in]``, B
    ``[out, rank]`` fit it."""
    if weight is None or len(weight) != 2:
        raise ValueError(f"adapter layer {module!r} is not a linear layer of the engine's model")
    out_f, in_f = weight
    if a.dim() != 2 or b.dim() != 2 or a.shape[1] != in_f or b.shape[0] != out_f or a.shape[0] != b.shape[1]:
        raise ValueError(f"adapter layer {module!r}: A {tuple(a.shape)} and B {tuple(b.shape)} do "
                         f"not fit a {in_f} -> {out_f} layer (A [rank, {in_f}], B [{out_f}, rank])")


class AdapterTable:
    """The adapters resident on ``model``, and the hooks that apply them row by row (decode
    thread only, as every forward pass)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self._modules = dict(model.named_modules())
        self.adapters: dict[str, Adapter] = {}
        self._by_layer: dict[str, dict[str, tuple[torch.Tensor, torch.Tensor, float]]] = {}
        """Module name -> adapter name -> (A, B, scale): what each hook adds."""
        self._groups: list[tuple[str, torch.Tensor]] = []
        """The current forward pass's (adapter, row indices), set by ``route``."""

    def __contains__(self, name: object) -> bool:
        return name in self.adapters

    def version(self, name: str) -> int:
        return self.adapters[name].version

    def check(self, layers: Mapping[str, tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Refuse an adapter that does not fit the model, before it is staged: a module that
        is not a linear layer of it, or shapes that do not match that layer's."""
        for module, (a, b) in layers.items():
            linear = self._modules.get(module)
            check_layer(module, a, b, tuple(linear.weight.shape) if isinstance(linear, torch.nn.Linear) else None)

    def load(self, adapter: Adapter) -> None:
        """Serve ``adapter`` (a new name, or a new version replacing the old in place)."""
        self.check(adapter.layers)
        self.remove(adapter.name)
        weight = next(iter(self.model.parameters()))
        for module, (a, b) in adapter.layers.items():
            if module not in self._by_layer:  # the hook creates the layer's entry
                self._modules[module].register_forward_hook(self._hook(module))
            self._by_layer[module][adapter.name] = (a.to(weight), b.to(weight), adapter.scale)
        self.adapters[adapter.name] = adapter

    def remove(self, name: str) -> None:
        if self.adapters.pop(name, None) is not None:
            for held in self._by_layer.values():
                held.pop(name, None)

    @contextmanager
    def route(self, names: list[str | None], device: torch.device | str) -> Iterator[None]:
        """Within this block, forward passes apply adapter ``names[i]`` to row ``i`` (None:
        the base model alone)."""
        rows: dict[str, list[int]] = {}
        for i, name in enumerate(names):
            if name is not None:
                if name not in self.adapters:  # never the base model in its place
                    raise KeyError(f"adapter {name!r} is not loaded; loaded: {sorted(self.adapters)}")
                rows.setdefault(name, []).append(i)
        self._groups = [(name, torch.tensor(idx, device=device)) for name, idx in rows.items()]
        try:
            yield
        finally:
            self._groups = []

    def _hook(self, module: str):
        held = self._by_layer.setdefault(module, {})

        def add_adapters(_: torch.nn.Module, args: tuple, out: torch.Tensor) -> torch.Tensor:
            if not self._groups:
                return out
            x = args[0]
            for name, rows in self._groups:
                lora = held.get(name)
                if lora is not None:
                    a, b, scale = lora
                    out.index_add_(0, rows, (x.index_select(0, rows) @ a.T) @ b.T, alpha=scale)
            return out

        return add_adapters
