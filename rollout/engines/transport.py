"""How new weights reach an engine: a handle the engine resolves when it loads a version.

The learner publishes a handle, not tensors; the engine fetches through it at load time, so a
handle is cheap to pass around (through the weight broker, to every engine of a group).
Transports: in memory (in-process engines and tests) and the Ray object store (CPU clusters).
A GPU transport (NCCL broadcast, a shared-filesystem safetensors path) is another subclass.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, Mapping


class WeightHandle(ABC):
    """A published state dict, fetched on demand."""

    @abstractmethod
    async def load(self) -> Mapping[str, Any]:
        """The state dict (parameter name -> tensor)."""


class InMemoryWeights(WeightHandle):
    """A state dict held directly (same process)."""

    def __init__(self, state: Mapping[str, Any]) -> None:
        self.state = state

    async def load(self) -> Mapping[str, Any]:
        return self.state


class ObjectStoreWeights(WeightHandle):
    """A state dict in Ray's object store. The reference travels boxed in a list so Ray does
    not resolve it when the handle is passed as an argument."""

    def __init__(self, boxed: list[Any]) -> None:
        self.boxed = boxed

    async def load(self) -> Mapping[str, Any]:
        return await self.boxed[0]
