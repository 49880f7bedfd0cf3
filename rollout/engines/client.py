"""The engine client: what rollout workers and the live gateway hold instead of an engine.

``LocalEngineClient`` wraps an engine in the same process (tests, benches, single-process
tools). ``RayEngineClient`` spreads requests over a group of engine actors
(``rollout.engines.server.EngineServer``): least outstanding requests first, and one engine per
live session so its requests reuse that engine (prefix caches, vLLM's included).
A group survives an engine's death: a call that finds its engine dead (or restarting) marks it
down for ``DOWN_S``, during which requests go to the others; a non-streamed request, and a stream
that has sent nothing yet, is retried on another engine (the caller saw nothing of it); a stream
that already sent tokens ends with ``EngineUnavailable`` (it cannot continue elsewhere without
the caller seeing two samples). ``AdapterClient`` is a LoRA run's view of either: every request
names the run's adapter. Control calls
(pause, resume, update_weights) go to every engine of the group; in a run the weight sync pushes
to each engine actor itself (a push one dead engine fails must still reach the others). The
client never imports Ray: it calls ``.remote`` on the handles it was given.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import zlib
from abc import ABC, abstractmethod
from dataclasses import replace
from typing import Any, AsyncIterator

from rollout.engines.base import AdapterSpec, Chunk, Completion, Engine, SamplingParams, new_request_id
from rollout.engines.transport import WeightHandle


DOWN_S = 5.0
"""How long a group leaves out an engine a call found dead before a request tries it again (an
HF engine restarted by Ray serves again within seconds; a call to one still restarting waits
in Ray's queue for it, or finds it unavailable and goes elsewhere)."""
ENGINE_GONE = ("RayActorError", "ActorUnavailableError")


def engine_gone(exc: BaseException) -> bool:
    """A call failed because the engine's process died or is restarting (Ray's errors, told by
    class name: this module never imports Ray)."""
    return any(c.__name__ in ENGINE_GONE for c in type(exc).__mro__)


class EngineUnavailable(RuntimeError):
    """No engine of the group could serve the request: every one tried was dead or restarting,
    or the one streaming it died after it had sent tokens."""


class EngineClient(ABC):
    """One interface over an in-process engine or an engine group."""

    @property
    @abstractmethod
    def tokenizer(self) -> Any:
        """The served model's tokenizer."""

    @property
    @abstractmethod
    def version(self) -> int:
        """The newest weights version this client has seen an engine serve."""

    @abstractmethod
    async def generate(self, prompt_ids: list[int], params: SamplingParams,
                       request_id: str | None = None, session_id: str | None = None) -> Completion:
        """One completion of ``prompt_ids``."""

    @abstractmethod
    def stream(self, prompt_ids: list[int], params: SamplingParams, request_id: str | None = None,
               session_id: str | None = None) -> AsyncIterator[Chunk]:
        """One completion, a chunk per decoding step; closing the iterator aborts it."""

    @abstractmethod
    async def abort(self, request_id: str) -> bool:
        """End an open request now; False when no engine holds it."""

    @abstractmethod
    async def prompt_logprobs(self, prompt_ids: list[int], session_id: str | None = None,
                              first: int = 1, adapter: str | None = None) -> tuple[int, list[float]]:
        """``(version, log-probs of prompt_ids[first:])`` from one engine (see ``Engine``);
        the engine ``session_id`` picks, as for ``generate``: the one that generated the
        context, whose prefix cache holds it."""

    @abstractmethod
    async def pause(self) -> None: ...

    @abstractmethod
    async def resume(self) -> None: ...

    @abstractmethod
    async def update_weights(self, version: int, handle: WeightHandle) -> int:
        """Load a version into every engine; returns the lowest version now serving."""

    @abstractmethod
    async def update_adapter(self, name: str, version: int, handle: WeightHandle, scale: float) -> int:
        """Load a version of LoRA adapter ``name`` into every engine (``Engine.update_adapter``);
        returns the lowest version of it now serving."""

    @abstractmethod
    async def remove_adapter(self, name: str) -> None:
        """Unload adapter ``name`` from every engine."""

    @abstractmethod
    async def stats(self) -> list[dict[str, float]]:
        """Per-engine counters."""

    @abstractmethod
    async def features(self) -> frozenset[str]:
        """What the engines do beyond the contract (``Engine.features``; a group is of one kind)."""

    def health(self) -> list[dict[str, Any]]:
        """Per engine, as this client saw it: ``up`` (requests go to it), the weights
        ``version`` its last answer carried, and its calls ``answered`` and ``found_dead``
        (metrics: the live gateway's engine families). An in-process engine never dies alone."""
        return [{"engine": 0, "up": True, "version": self.version, "answered": 0, "found_dead": 0}]

    async def generate_n(self, prompt_ids: list[int], params: SamplingParams,
                         request_id: str | None = None, session_id: str | None = None) -> list[Completion]:
        """``params.n`` completions of one prompt, as n requests that share engine batches
        (ids ``<request_id>-<i>``; a seeded request's choice ``i`` is seeded ``seed + i``)."""
        rid = request_id or new_request_id()
        return list(await asyncio.gather(*[
            self.generate(prompt_ids, params.choice(i), f"{rid}-{i}", session_id) for i in range(params.n)]))


class LocalEngineClient(EngineClient):
    """An ``EngineServer`` in this process, without Ray (tests, benches, tools): the same
    verbs as an engine actor; weights arrive through ``update_weights`` (a caller's, or a
    ``learner.weights.WeightSync`` in the same process)."""

    def __init__(self, server: Any) -> None:
        self.server = server

    @property
    def engine(self) -> Engine:
        return self.server.engine

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    @property
    def version(self) -> int:
        return self.engine.version

    async def generate(self, prompt_ids, params, request_id=None, session_id=None) -> Completion:
        return await self.server.generate(prompt_ids, params, request_id or new_request_id())

    def stream(self, prompt_ids, params, request_id=None, session_id=None) -> AsyncIterator[Chunk]:
        return self.server.stream(prompt_ids, params, request_id or new_request_id())

    async def abort(self, request_id: str) -> bool:
        return await self.server.abort(request_id)

    async def prompt_logprobs(self, prompt_ids, session_id=None, first=1, adapter=None) -> tuple[int, list[float]]:
        return await self.server.prompt_logprobs(prompt_ids, first, adapter)

    async def pause(self) -> None:
        await self.server.pause()

    async def resume(self) -> None:
        await self.server.resume()

    async def update_weights(self, version: int, handle: WeightHandle) -> int:
        return await self.server.update_weights(version, handle)

    async def update_adapter(self, name: str, version: int, handle: WeightHandle, scale: float) -> int:
        return await self.server.update_adapter(name, version, handle, scale)

    async def remove_adapter(self, name: str) -> None:
        await self.server.remove_adapter(name)

    async def stats(self) -> list[dict[str, float]]:
        return [self.server.stats()]

    async def features(self) -> frozenset[str]:
        return frozenset(self.server.features())


class RayEngineClient(EngineClient):
    """A group of ``EngineServer`` actors. Picklable: hand it to any actor that needs an
    engine; the tokenizer is loaded from ``model_path`` where it is first used."""

    def __init__(self, handles: list[Any], model_path: str) -> None:
        if not handles:
            raise ValueError("an engine group needs at least one engine actor")
        self.handles, self.model_path = list(handles), model_path
        self._setup()

    def _setup(self) -> None:
        self._tokenizer: Any = None
        self._outstanding = [0] * len(self.handles)
        self._where: dict[str, int] = {}
        self._version = 0
        self._down: dict[int, float] = {}  # engine index -> when a call found it dead
        self._versions = [0] * len(self.handles)  # the version each engine's last answer carried
        self._calls = [{"answered": 0, "found_dead": 0} for _ in self.handles]

    def __getstate__(self) -> dict[str, Any]:
        return {"handles": self.handles, "model_path": self.model_path}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._setup()

    @property
    def tokenizer(self) -> Any:
        if self._tokenizer is None:
            from transformers import AutoTokenizer

            from storage import node_copy

            self._tokenizer = AutoTokenizer.from_pretrained(node_copy(self.model_path))
        return self._tokenizer

    @property
    def version(self) -> int:
        return self._version

    def _up(self, avoid: tuple[int, ...] = ()) -> list[int]:
        """Engines a request may go to: those not found dead in the last ``DOWN_S`` and not in
        ``avoid``; when none is left, every engine not avoided (a restarting one queues it)."""
        now = time.monotonic()
        free = [i for i in range(len(self.handles)) if i not in avoid]
        return [i for i in free if now - self._down.get(i, -DOWN_S) >= DOWN_S] or free

    def _pick(self, session_id: str | None, avoid: tuple[int, ...] = ()) -> int:
        up = self._up(avoid)
        if session_id is not None:  # stable across clients and processes (no hash seed)
            key = zlib.crc32(session_id.encode())
            home = key % len(self.handles)
            return home if home in up else up[key % len(up)]
        return min(up, key=self._outstanding.__getitem__)

    def _seen(self, version: int) -> None:
        self._version = max(self._version, version)

    def _answered(self, idx: int, version: int, adapter: str | None, call: bool = True) -> None:
        """Engine ``idx`` answered (a call's first answer counts it, with ``call``): up again;
        the weights version it served noted (an adapter's versions are its own, not the weights')."""
        self._down.pop(idx, None)
        self._calls[idx]["answered"] += call
        if adapter is None:
            self._seen(version)
            self._versions[idx] = version

    def _mark_down(self, idx: int) -> None:
        self._down[idx] = time.monotonic()
        self._calls[idx]["found_dead"] += 1

    def _gone(self, idx: int, tried: tuple[int, ...], exc: BaseException) -> tuple[int, ...]:
        """Engine ``idx`` failed a call with ``exc``: unless it died, ``exc`` is raised; else it
        is marked down and the engines tried so far are returned, or ``EngineUnavailable``
        raised once none is left to try."""
        if not engine_gone(exc):
            raise exc
        self._mark_down(idx)
        tried = (*tried, idx)
        if len(tried) >= len(self.handles):
            raise EngineUnavailable(f"no engine could serve the request: engine(s) {list(tried)} of "
                                    f"{len(self.handles)} dead or restarting ({type(exc).__name__})") from exc
        return tried

    def health(self) -> list[dict[str, Any]]:
        up = set(self._up())
        return [{"engine": i, "up": i in up, "version": v, **self._calls[i]} for i, v in enumerate(self._versions)]

    async def generate(self, prompt_ids, params, request_id=None, session_id=None) -> Completion:
        rid = request_id or new_request_id()
        tried: tuple[int, ...] = ()
        while True:  # an engine that died under it: the next one (the caller saw nothing)
            idx = self._pick(session_id, tried)
            self._outstanding[idx] += 1
            self._where[rid] = idx
            try:
                done = await self.handles[idx].generate.remote(prompt_ids, params, rid)
                break
            except Exception as exc:  # noqa: BLE001 - re-raised unless the engine died
                tried = self._gone(idx, tried, exc)
            finally:
                self._outstanding[idx] -= 1
                self._where.pop(rid, None)
        self._answered(idx, done.version_spans[-1][1], params.adapter)
        return done

    async def stream(self, prompt_ids, params, request_id=None, session_id=None) -> AsyncIterator[Chunk]:
        rid = request_id or new_request_id()
        tried: tuple[int, ...] = ()
        while True:  # an engine that died before it sent anything: the next one
            idx = self._pick(session_id, tried)
            sent = False
            try:  # closed with this one: a consumer that leaves early aborts the engine's request now
                async with contextlib.aclosing(self._stream_on(idx, prompt_ids, params, rid)) as chunks:
                    async for chunk in chunks:
                        sent = True
                        yield chunk
                return
            except Exception as exc:  # noqa: BLE001 - re-raised unless the engine died
                if sent and engine_gone(exc):
                    self._mark_down(idx)
                    raise EngineUnavailable(f"engine {idx} died mid-stream ({type(exc).__name__}); "
                                            "the tokens sent so far are all there is") from exc
                tried = self._gone(idx, tried, exc)

    async def _stream_on(self, idx: int, prompt_ids: list[int], params: SamplingParams,
                         rid: str) -> AsyncIterator[Chunk]:
        self._outstanding[idx] += 1
        self._where[rid] = idx
        finished = dead = False
        chunks = 0
        try:
            refs = self.handles[idx].stream.options(num_returns="streaming").remote(prompt_ids, params, rid)
            async for ref in refs:
                chunk = await ref
                self._answered(idx, chunk.version, params.adapter, call=chunks == 0)
                chunks += 1
                finished = chunk.finish_reason is not None
                yield chunk
        except Exception as exc:  # noqa: BLE001 - re-raised
            dead = engine_gone(exc)
            raise
        finally:
            self._outstanding[idx] -= 1
            self._where.pop(rid, None)
            if not finished and not dead:  # the consumer left early: free the engine's row
                await self.handles[idx].abort.remote(rid)

    async def prompt_logprobs(self, prompt_ids, session_id=None, first=1, adapter=None) -> tuple[int, list[float]]:
        idx = self._pick(session_id)  # a shared session id keeps one context's rows on one engine
        self._outstanding[idx] += 1
        try:
            version, lps = await self.handles[idx].prompt_logprobs.remote(prompt_ids, first, adapter)
        finally:
            self._outstanding[idx] -= 1
        if adapter is None:
            self._seen(version)
        return version, lps

    async def abort(self, request_id: str) -> bool:
        idx = self._where.get(request_id)
        if idx is not None:
            return await self.handles[idx].abort.remote(request_id)
        found = await asyncio.gather(*[h.abort.remote(request_id) for h in self.handles])
        return any(found)

    async def _all(self, method: str, *args: Any) -> list[Any]:
        return list(await asyncio.gather(*[getattr(h, method).remote(*args) for h in self.handles]))

    async def pause(self) -> None:
        await self._all("pause")

    async def resume(self) -> None:
        await self._all("resume")

    async def update_weights(self, version: int, handle: WeightHandle) -> int:
        low = min(await self._all("update_weights", version, handle))
        self._seen(low)
        return low

    async def update_adapter(self, name: str, version: int, handle: WeightHandle, scale: float) -> int:
        return min(await self._all("update_adapter", name, version, handle, scale))

    async def remove_adapter(self, name: str) -> None:
        await self._all("remove_adapter", name)

    async def stats(self) -> list[dict[str, float]]:
        return await self._all("stats")

    async def features(self) -> frozenset[str]:
        return frozenset(await self.handles[0].features.remote())


class AdapterClient(EngineClient):
    """A LoRA run's view of an engine group that serves adapters: every request it sends names
    the run's adapter (``SamplingParams.adapter``; prompt log-probs too), so rollout workers,
    evaluation, IG scoring and the live endpoint reach the run's policy, base plus adapter,
    without knowing it is one. ``version`` is the adapter's (the learner's versions);
    ``update_weights`` loads a version of the adapter (what the learner publishes is the
    adapter's tensors). Picklable when ``inner`` is."""

    def __init__(self, inner: EngineClient, adapter: AdapterSpec) -> None:
        self.inner, self.adapter = inner, adapter
        self._version = 0

    def _name(self, asked: str | None) -> str:
        if asked not in (None, self.adapter.name):
            raise ValueError(f"a request names adapter {asked!r} through the client of adapter "
                             f"{self.adapter.name!r}")
        return self.adapter.name

    def _named(self, params: SamplingParams) -> SamplingParams:
        return replace(params, adapter=self._name(params.adapter))

    def _seen(self, version: int) -> None:
        self._version = max(self._version, version)

    def _served(self, adapter: str | None) -> None:
        # The engine's word for what decoded: a request of this run answered by another
        # adapter (or the base) would train on another policy's log-probs, so it never passes.
        if adapter != self.adapter.name:
            raise RuntimeError(f"the engine answered a request for adapter {self.adapter.name!r} "
                               f"with {adapter or 'the base model'!r}")

    @property
    def tokenizer(self) -> Any:
        return self.inner.tokenizer

    @property
    def version(self) -> int:
        return self._version

    async def generate(self, prompt_ids, params, request_id=None, session_id=None) -> Completion:
        done = await self.inner.generate(prompt_ids, self._named(params), request_id, session_id)
        self._served(done.adapter)
        self._seen(done.version_spans[-1][1])
        return done

    async def stream(self, prompt_ids, params, request_id=None, session_id=None) -> AsyncIterator[Chunk]:
        async for chunk in self.inner.stream(prompt_ids, self._named(params), request_id, session_id):
            self._served(chunk.adapter)
            self._seen(chunk.version)
            yield chunk

    async def abort(self, request_id: str) -> bool:
        return await self.inner.abort(request_id)

    async def prompt_logprobs(self, prompt_ids, session_id=None, first=1, adapter=None) -> tuple[int, list[float]]:
        version, lps = await self.inner.prompt_logprobs(prompt_ids, session_id, first, self._name(adapter))
        self._seen(version)
        return version, lps

    async def pause(self) -> None:
        await self.inner.pause()

    async def resume(self) -> None:
        await self.inner.resume()

    async def update_weights(self, version: int, handle: WeightHandle) -> int:
        low = await self.inner.update_adapter(self.adapter.name, version, handle, self.adapter.scale)
        self._seen(low)
        return low

    async def update_adapter(self, name: str, version: int, handle: WeightHandle, scale: float) -> int:
        return await self.inner.update_adapter(name, version, handle, scale)

    async def remove_adapter(self, name: str) -> None:
        await self.inner.remove_adapter(name)

    async def stats(self) -> list[dict[str, float]]:
        return await self.inner.stats()

    async def features(self) -> frozenset[str]:
        return await self.inner.features()

    def health(self) -> list[dict[str, Any]]:
        return self.inner.health()
