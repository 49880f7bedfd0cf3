"""How new weights reach an engine: a handle the engine resolves when it loads a version.

The learner publishes a handle, not tensors; the engine fetches through it at load time, so a
handle is cheap to pass around (the weight sync pushes it to every engine and model scorer).
Transports: in memory (in-process engines and tests), the Ray object store (CPU clusters), a
safetensors file on a filesystem the engines share, and a bucketed broadcast from learner rank
0 over a process group of its own (NCCL on GPUs, gloo on CPUs).
"""

from __future__ import annotations

import asyncio
import os
from abc import ABC, abstractmethod
from pathlib import Path
from typing import Any, Iterator, Mapping


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
    not resolve it when the handle is passed as an argument.

    ``put`` stores the tensors as numpy arrays: Ray writes those straight into shared memory
    and readers map them without a copy, where torch tensors go through pickle (2.7x slower
    to put, 25x to get, measured by bench/learner.py and docs/learner.md)."""

    def __init__(self, boxed: list[Any]) -> None:
        self.boxed = boxed

    @classmethod
    def put(cls, state: Mapping[str, Any]) -> "ObjectStoreWeights":
        import ray

        return cls([ray.put({k: _as_numpy(v) for k, v in state.items()})])

    async def load(self) -> Mapping[str, Any]:
        import warnings

        import numpy as np
        import torch

        state = await self.boxed[0]
        with warnings.catch_warnings():
            # arrays mapped from the object store are read-only; loaders only copy from them
            warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
            return {k: torch.from_numpy(v) if isinstance(v, np.ndarray) else v for k, v in state.items()}


def _as_numpy(t: Any) -> Any:
    """A CPU tensor's numpy view (no copy); dtypes numpy lacks (bfloat16) stay tensors."""
    try:
        return t.detach().cpu().numpy()
    except (TypeError, AttributeError):
        return t


def write_safetensors(state: Mapping[str, Any], path: str) -> None:
    """Write a state dict as one safetensors file, atomically (readers never see half a file).
    Tensors that share storage (tied embeddings) are written once, under their first name:
    every loader TurnRL uses re-ties them from the model config."""
    import torch
    from safetensors.torch import save_file

    seen: set[tuple[int, int]] = set()
    out: dict[str, torch.Tensor] = {}
    for name, t in state.items():
        key = (t.untyped_storage().data_ptr(), t.storage_offset())
        if key in seen:
            continue
        seen.add(key)
        out[name] = t.detach().contiguous().cpu()
    tmp = f"{path}.tmp-{os.getpid()}"
    save_file(out, tmp)
    os.replace(tmp, path)


class FileWeights(WeightHandle):
    """A safetensors file on a filesystem every engine of the group can read (a shared disk
    across nodes, ``/dev/shm`` on one node). An engine that can read the file itself (vLLM's
    workers) never copies the tensors through its own process."""

    def __init__(self, path: str) -> None:
        self.path = path

    async def load(self) -> Mapping[str, Any]:
        from safetensors.torch import load_file

        return await asyncio.to_thread(load_file, self.path)

    def shapes(self) -> dict[str, tuple[int, ...]]:
        """Parameter name -> shape, from the file's header."""
        from safetensors import safe_open

        with safe_open(self.path, framework="pt") as f:
            return {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}


class FileWeightsWriter:
    """The learner's side of ``FileWeights``: one file per version in ``directory``, the
    ``keep`` newest kept (an engine may still be reading the previous one)."""

    def __init__(self, directory: str, keep: int = 2) -> None:
        self.directory, self.keep = Path(directory), keep
        self.directory.mkdir(parents=True, exist_ok=True)

    def publish(self, version: int, state: Mapping[str, Any]) -> FileWeights:
        path = self.directory / f"weights-v{version:08d}.safetensors"
        write_safetensors(state, str(path))
        for old in sorted(self.directory.glob("weights-v*.safetensors"))[:-self.keep]:
            old.unlink(missing_ok=True)
        return FileWeights(str(path))


def plan_buckets(state: Mapping[str, Any], bucket_bytes: int) -> list[dict[str, Any]]:
    """Group parameters into flat buckets of one dtype and at most ``bucket_bytes`` each (a
    parameter larger than that gets a bucket of its own): one collective per bucket instead
    of one per parameter. Returns the layout both sides of a broadcast follow."""
    buckets: list[dict[str, Any]] = []
    open_by_dtype: dict[str, dict[str, Any]] = {}
    for name, t in state.items():
        dtype, numel = str(t.dtype).removeprefix("torch."), t.numel()
        b = open_by_dtype.get(dtype)
        if b is None or (b["numel"] + numel) * t.element_size() > bucket_bytes and b["entries"]:
            b = open_by_dtype[dtype] = {"dtype": dtype, "numel": 0, "entries": []}
            buckets.append(b)
        b["entries"].append({"name": name, "shape": list(t.shape), "offset": b["numel"], "numel": numel})
        b["numel"] += numel
    return buckets


class BroadcastWeights(WeightHandle):
    """A version the learner broadcasts in buckets over a process group the engines joined
    at the run's start (``BroadcastGroup``: NCCL between GPUs, gloo on CPUs). The handle
    carries only the bucket layout; receiving is a collective, so every engine of the group
    must receive each version the learner sends (the weight sync pushes each to all of them)."""

    def __init__(self, layout: list[dict[str, Any]]) -> None:
        self.layout = layout

    def layout_entries(self) -> list[dict[str, Any]]:
        return [e for b in self.layout for e in b["entries"]]

    async def load(self) -> Mapping[str, Any]:
        group = BroadcastGroup.joined
        if group is None:
            raise RuntimeError("this process has not joined the learner's weight broadcast group")
        return await asyncio.to_thread(lambda: dict(group.receive(self.layout)))


class BroadcastGroup:
    """A process group of its own between learner rank 0 (rank 0 here) and the engines
    (ranks 1..N), built from a TCP store so it never touches the learner's or vLLM's default
    group. ``init`` is a plain dict (host, port, world_size, backend) passed to every member."""

    joined: "BroadcastGroup | None" = None
    """The group this process receives on (one per engine process)."""

    def __init__(self, init: Mapping[str, Any], rank: int, device: Any = "cpu") -> None:
        import datetime

        import torch.distributed as dist

        timeout = datetime.timedelta(seconds=float(init.get("timeout_s", 600)))
        store = dist.TCPStore(init["host"], int(init["port"]), int(init["world_size"]), rank == 0, timeout=timeout)
        store = dist.PrefixStore(str(init.get("name", "turnrl-weights")), store)
        world = int(init["world_size"])
        if init["backend"] == "nccl":
            self.pg = dist.ProcessGroupNCCL(store, rank, world)
        else:
            self.pg = dist.ProcessGroupGloo(store, rank, world, timeout)
        self.rank, self.device = rank, device

    @classmethod
    def join(cls, init: Mapping[str, Any], device: Any = "cpu") -> "BroadcastGroup":
        """Join as a receiver; ``init["rank"]`` is this member's rank (1..N)."""
        cls.joined = cls(init, int(init["rank"]), device)
        return cls.joined

    def send(self, state: Mapping[str, Any], layout: list[dict[str, Any]]) -> int:
        """Broadcast ``state`` bucket by bucket (rank 0); returns the bytes sent."""
        import torch

        sent = 0
        for b in layout:
            flat = torch.cat([state[e["name"]].detach().reshape(-1) for e in b["entries"]]).to(self.device)
            self.pg.broadcast(flat, 0).wait()
            sent += flat.numel() * flat.element_size()
        return sent

    def receive(self, layout: list[dict[str, Any]]) -> Iterator[tuple[str, Any]]:
        """Receive buckets in order, yielding each parameter as a view into its bucket."""
        import torch

        for b in layout:
            flat = torch.empty(b["numel"], dtype=getattr(torch, b["dtype"]), device=self.device)
            self.pg.broadcast(flat, 0).wait()
            for e in b["entries"]:
                yield e["name"], flat[e["offset"]:e["offset"] + e["numel"]].view(e["shape"])


TIED_HEAD = "lm_head.weight"
"""The output head a model with tied embeddings shares with its input embedding: checkpoints
and published state dicts may leave it out (``write_safetensors`` writes shared storage once)."""


def check_fits(want: Mapping[str, tuple[int, ...]], got: Mapping[str, tuple[int, ...]], version: int,
               tied: bool, where: str) -> None:
    """The one rule for "do these weights fit this model" (engines and model scorers): the same
    parameter names with the same shapes; only the output head of a model with tied embeddings
    may be missing. ``want``/``got``: name -> shape of the model ``where`` serves and of the
    published version. Raises before anything is loaded, so no request sees a half-loaded model."""
    missing = sorted(set(want) - set(got) - ({TIED_HEAD} if tied else set()))
    unexpected = sorted(set(got) - set(want))
    wrong = sorted(k for k in set(want) & set(got) if tuple(want[k]) != tuple(got[k]))
    if missing or unexpected or wrong:
        raise ValueError(f"weights v{version} do not fit {where}: missing={missing[:5]} "
                         f"unexpected={unexpected[:5]} wrong_shape={wrong[:5]}")


def shapes_of(state: Mapping[str, Any]) -> dict[str, tuple[int, ...]]:
    """Parameter name -> shape of a state dict (tensors or arrays)."""
    return {k: tuple(v.shape) for k, v in state.items()}
