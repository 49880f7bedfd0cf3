"""An engine with no model, for control-plane benches only (``bench/scale.py``).

It keeps the engine contract (``rollout.engines.base.Engine``): requests stream pseudo-random
token ids at a fixed rate, can be aborted, paused and resumed; new weights come through the real
transport handles and every byte of a version is read (summed) but never held, so one machine can
host a hundred or more of these as Ray actors and the weight sync's fan-out is measured with real
payloads. It lives in bench/ and no config can name it: a user's run never takes it.

Reading a version, by transport, without importing torch where the transport allows (torch costs
~165 MB of private memory per process, which 256 actors on 24 GiB cannot pay):
- object store: the boxed reference is awaited (the transfer Ray does; on one node a mapping of
  shared memory) and the numpy arrays summed; ``ObjectStoreWeights.load`` would only wrap them
  as tensors without a copy;
- file: the safetensors file is memory-mapped and summed tensor by tensor (the page cache read
  once per engine, nothing copied into the process);
- broadcast: the collective receive, bucket by bucket (torch: the transport needs it);
- anything else: the handle's own ``load``.
"""

from __future__ import annotations

import asyncio
import json
import random
import struct
import time
from typing import Any, AsyncIterator, Mapping

import numpy as np

from rollout.engines.base import Chunk, Completion, Engine, SamplingParams, new_request_id
from rollout.engines.transport import BroadcastGroup, BroadcastWeights, FileWeights, ObjectStoreWeights, WeightHandle

SAFETENSORS_NP = {"F32": np.float32, "F16": np.float16, "I64": np.int64, "I32": np.int32, "U8": np.uint8}


def sum_file(path: str) -> tuple[int, float]:
    """(bytes, checksum) of a safetensors file, read through a memory map."""
    with open(path, "rb") as fh:
        (n,) = struct.unpack("<Q", fh.read(8))
        header = json.loads(fh.read(n))
    data = np.memmap(path, dtype=np.uint8, mode="r", offset=8 + n)
    total, check = 0, 0.0
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        lo, hi = meta["data_offsets"]
        check += float(data[lo:hi].view(SAFETENSORS_NP[meta["dtype"]]).sum(dtype=np.float64))
        total += hi - lo
    return total, check


def sum_state(state: Mapping[str, Any]) -> tuple[int, float]:
    """(bytes, checksum) of a state dict of arrays or tensors."""
    total, check = 0, 0.0
    for v in state.values():
        arr = v if isinstance(v, np.ndarray) else v.detach().float().numpy()
        total += arr.nbytes
        check += float(arr.sum(dtype=np.float64))
    return total, check


def sum_received(handle: BroadcastWeights) -> tuple[int, float]:
    """(bytes, checksum) of a broadcast version, received bucket by bucket."""
    if BroadcastGroup.joined is None:
        raise RuntimeError("this engine has not joined the weight broadcast group")
    total, check = 0, 0.0
    for _, t in BroadcastGroup.joined.receive(handle.layout):
        total += t.numel() * t.element_size()
        check += float(t.double().sum())
    return total, check


class SyntheticEngine(Engine):
    """``rate`` tokens per second per request; versions read in full, never kept."""

    features = frozenset({"adapters"})

    def __init__(self, rate: float = 50.0, vocab: int = 49152, stop_chance: float = 1 / 32, seed: int = 0) -> None:
        self.rate, self.vocab, self.stop_chance = rate, vocab, stop_chance
        self._rng = random.Random(seed)
        self._version = 0
        self._adapters: dict[str, int] = {}
        self._open: dict[str, asyncio.Event] = {}
        self._paused = False  # a flag, not an Event: the engine is pickled into its actor
        self.counts = {"tokens": 0, "loads": 0, "loaded_bytes": 0, "load_s": 0.0, "checksum": 0.0}

    @property
    def version(self) -> int:
        return self._version

    @property
    def tokenizer(self) -> Any:
        return None

    async def stream(self, prompt_ids: list[int], params: SamplingParams,
                     request_id: str | None = None) -> AsyncIterator[Chunk]:
        rid = request_id or new_request_id()
        aborted = self._open[rid] = asyncio.Event()
        version = self.serving_version(params.adapter)
        try:
            for k in range(params.max_new_tokens):
                await asyncio.sleep(1.0 / self.rate)
                while self._paused:
                    await asyncio.sleep(1.0 / self.rate)
                if aborted.is_set():
                    yield Chunk(rid, [], [], version, "abort", params.adapter)
                    return
                stop = bool(params.stop_token_ids) and self._rng.random() < self.stop_chance
                token = params.stop_token_ids[0] if stop else self._rng.randrange(self.vocab)
                self.counts["tokens"] += 1
                last = stop or k == params.max_new_tokens - 1
                yield Chunk(rid, [token], [-1.0], version, ("stop" if stop else "length") if last else None,
                            params.adapter)
                if stop:
                    return
        finally:
            self._open.pop(rid, None)

    async def generate(self, prompt_ids: list[int], params: SamplingParams,
                       request_id: str | None = None) -> Completion:
        out = Completion.empty(request_id or new_request_id())
        async for chunk in self.stream(prompt_ids, params, out.request_id):
            out.take(chunk)
        return out

    async def prompt_logprobs(self, prompt_ids: list[int], first: int = 1,
                              adapter: str | None = None) -> tuple[int, list[float]]:
        return self.serving_version(adapter), [-1.0] * (len(prompt_ids) - first)

    async def abort(self, request_id: str) -> bool:
        event = self._open.get(request_id)
        if event is not None:
            event.set()
        return event is not None

    async def pause(self) -> None:
        self._paused = True

    async def resume(self) -> None:
        self._paused = False

    async def _read(self, handle: WeightHandle) -> None:
        t0 = time.perf_counter()
        if isinstance(handle, ObjectStoreWeights):
            total, check = await asyncio.to_thread(sum_state, await handle.boxed[0])
        elif isinstance(handle, FileWeights):
            total, check = await asyncio.to_thread(sum_file, handle.path)
        elif isinstance(handle, BroadcastWeights):  # bucket by bucket: never a whole version held
            total, check = await asyncio.to_thread(sum_received, handle)
        else:
            total, check = await asyncio.to_thread(sum_state, await handle.load())
        self.counts["loads"] += 1
        self.counts["loaded_bytes"] += total
        self.counts["checksum"] = check
        self.counts["load_s"] += time.perf_counter() - t0

    async def update_weights(self, version: int, handle: WeightHandle) -> int:
        await self._read(handle)
        self._version = max(self._version, version)
        return self._version

    async def update_adapter(self, name: str, version: int, handle: WeightHandle, scale: float) -> int:
        await self._read(handle)
        self._adapters[name] = max(self._adapters.get(name, -1), version)
        return self._adapters[name]

    async def remove_adapter(self, name: str) -> None:
        self._adapters.pop(name, None)

    def serving_version(self, adapter: str | None = None) -> int:
        return self._version if adapter is None else self._adapters[adapter]

    async def join_weight_group(self, init: dict[str, Any]) -> None:
        await asyncio.to_thread(BroadcastGroup.join, init)

    def stats(self) -> dict[str, float]:
        return dict(self.counts)
