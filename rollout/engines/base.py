"""The engine interface: token ids in; sampled token ids, behaviour log-probs and the weights
version of every token out.

An engine serves concurrent requests. Each request has an id, can be streamed (one ``Chunk``
per decoding step) and aborted; the engine can be paused and resumed, and takes new weights
as an async call that never fails a request. With in-flight updates a completion's tokens may
come from two versions: ``Completion.version_spans`` records where each version begins.
"""

from __future__ import annotations

import uuid
from abc import ABC, abstractmethod
from dataclasses import dataclass, field, replace
from typing import Any, AsyncIterator, Literal

from rollout.engines.transport import WeightHandle

FinishReason = Literal["stop", "length", "abort"]
SEED_RANGE = 2**63
"""Request seeds are in ``[0, SEED_RANGE)`` (what torch and vLLM generators take)."""


def new_request_id() -> str:
    return uuid.uuid4().hex


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0
    """0 means greedy."""
    top_p: float = 1.0
    max_new_tokens: int = 64
    stop_token_ids: tuple[int, ...] = ()
    """Generation ends after any of these (the end-of-turn token is always one)."""
    n: int = 1
    """Completions of one prompt, for ``generate_n``; each is its own request."""
    seed: int | None = None
    """Seeds this request's own sampling noise, so the same request samples the same tokens
    again, whatever else shares its batch (None: the engine's shared generator)."""
    guide: str | None = None
    """Constrained decoding: sample only text this grammar accepts, an xgrammar structural tag
    as JSON (``{"type": "structural_tag", "format": {...}}``, built by ``gateway.constraints``).
    Only an engine whose ``features`` hold ``"guided"`` takes it. The log-probs recorded are
    then those of the constrained distribution the tokens were sampled from."""
    adapter: str | None = None
    """The LoRA adapter to decode with (loaded by ``Engine.update_adapter``; None: the base
    model). The request's tokens carry the adapter's version. Only an engine whose
    ``features`` hold ``"adapters"`` takes it."""
    logit_bias: tuple[tuple[int, float], ...] = ()
    """(token id, bias) pairs added to those tokens' logits before temperature (OpenAI's
    ``logit_bias``; -100/+100 ban or force a token)."""
    presence_penalty: float = 0.0
    """Subtracted from the logit of every token already sampled in this completion."""
    frequency_penalty: float = 0.0
    """Subtracted from a token's logit once per time it was already sampled in this completion."""
    top_logprobs: int = 0
    """Alternatives per sampled token: the ``top_logprobs`` most likely tokens and their
    log-probs under the distribution sampled from (``Completion.top``)."""

    @property
    def reshaped(self) -> bool:
        """Bias or penalties changed the distribution sampled from: the recorded log-probs are
        that distribution's (bias and penalties included), no longer the policy's own."""
        return bool(self.logit_bias) or self.presence_penalty != 0 or self.frequency_penalty != 0

    def choice(self, i: int) -> "SamplingParams":
        """The params of choice ``i`` of ``n``: a seeded request's choices get seeds
        ``seed + i``, so they differ from each other and each repeats."""
        if self.seed is None or i == 0:
            return self
        return replace(self, seed=(self.seed + i) % SEED_RANGE)


@dataclass(frozen=True)
class AdapterSpec:
    """A LoRA adapter as engines serve it: its name (what requests name) and its scale
    (``alpha / rank``, applied to ``B A``)."""

    name: str
    scale: float


@dataclass
class Completion:
    request_id: str
    token_ids: list[int]
    logprobs: list[float]
    """log pi_behaviour(token) under the tempered distribution that sampled it."""
    finish_reason: FinishReason
    version_spans: list[tuple[int, int]]
    """``(first token index, weights version)``: tokens from each index on, up to the next
    span, were sampled with that version. Starts at index 0; one span unless weights changed
    mid-completion."""
    timings: dict[str, float] = field(default_factory=dict)
    adapter: str | None = None
    """The LoRA adapter every token was sampled with (``version_spans`` then count its versions);
    None: the base model."""
    top: list[list[tuple[int, float]]] = field(default_factory=list)
    """Per token, its ``SamplingParams.top_logprobs`` alternatives, most likely first: (token
    id, log-prob under the distribution sampled from); empty when none were asked for."""

    @property
    def version(self) -> int:
        """Version of the first token (the oldest weights in the completion)."""
        return self.version_spans[0][1]

    def versions(self) -> list[int]:
        """The weights version of each token."""
        return expand_spans(self.version_spans, len(self.token_ids))

    @classmethod
    def empty(cls, request_id: str) -> "Completion":
        """A completion to gather a stream into (``take``)."""
        return cls(request_id, [], [], "length", [])

    def take(self, chunk: "Chunk") -> None:
        """The one place streamed chunks become a completion: the chunk's tokens and
        log-probs appended, a new version span where its version differs, and with the final
        chunk the finish reason (and, when nothing was sampled, the version that served it)."""
        if chunk.token_ids:
            add_span(self.version_spans, len(self.token_ids), chunk.version)
        self.token_ids += chunk.token_ids
        self.logprobs += chunk.logprobs
        self.top += chunk.top
        if chunk.finish_reason is not None:
            self.finish_reason = chunk.finish_reason
            self.adapter = chunk.adapter
            if not self.version_spans:
                self.version_spans.append((0, chunk.version))


@dataclass
class Chunk:
    """The tokens one decoding step added to a streamed request."""

    request_id: str
    token_ids: list[int]
    logprobs: list[float]
    version: int
    finish_reason: FinishReason | None = None
    """Set on the request's last chunk."""
    adapter: str | None = None
    """The LoRA adapter the request is decoded with (None: the base); ``version`` is its."""
    top: list[list[tuple[int, float]]] = field(default_factory=list)
    """Each token's alternatives (``Completion.top``); empty when none were asked for."""


def expand_spans(spans: list[tuple[int, int]], n_tokens: int) -> list[int]:
    """Per-token versions from ``(start, version)`` spans."""
    out: list[int] = []
    for k, (start, version) in enumerate(spans):
        stop = spans[k + 1][0] if k + 1 < len(spans) else n_tokens
        out += [version] * (stop - start)
    return out


def add_span(spans: list[tuple[int, int]], index: int, version: int) -> None:
    """Record that token ``index`` was sampled with ``version`` (a new span only on change)."""
    if not spans or spans[-1][1] != version:
        spans.append((index, version))


class Engine(ABC):
    """Serves concurrent requests; see the module docstring for the contract."""

    features: frozenset[str] = frozenset()
    """What the engine does beyond the contract: ``guided`` (``SamplingParams.guide``),
    ``adapters`` (``update_adapter``, ``SamplingParams.adapter``)."""

    @property
    @abstractmethod
    def version(self) -> int:
        """Version of the weights currently serving."""

    @property
    @abstractmethod
    def tokenizer(self) -> Any:
        """The tokenizer matching the served model."""

    @abstractmethod
    def stream(self, prompt_ids: list[int], params: SamplingParams,
               request_id: str | None = None) -> AsyncIterator[Chunk]:
        """Sample one completion of ``prompt_ids``, one chunk per decoding step. Closing the
        iterator early aborts the request."""

    @abstractmethod
    async def generate(self, prompt_ids: list[int], params: SamplingParams,
                       request_id: str | None = None) -> Completion:
        """Sample one completion of ``prompt_ids``."""

    @abstractmethod
    async def prompt_logprobs(self, prompt_ids: list[int], first: int = 1,
                              adapter: str | None = None) -> tuple[int, list[float]]:
        """Score a prompt without sampling: ``(version, lp)`` where ``lp[j]`` is
        log pi(prompt_ids[first + j] | prompt_ids[: first + j]) under the serving weights
        (untempered; with ``adapter``, the base plus that adapter, and its version), for every
        token from index ``first`` (>= 1) on. Used by scorers that read
        the behaviour policy's log-probs (IG gold answers) from the engine instead of a model
        copy of their own; a ``first`` past a context the engine has just generated from lets
        an engine with a prefix cache compute only the tokens after it."""

    @abstractmethod
    async def abort(self, request_id: str) -> bool:
        """End a waiting or running request now (finish reason ``abort``, the tokens sampled
        so far kept); False when no such request is open."""

    @abstractmethod
    async def pause(self) -> None:
        """Stop producing tokens at the next step boundary; requests stay open."""

    @abstractmethod
    async def resume(self) -> None:
        """Continue after ``pause``."""

    @abstractmethod
    async def update_weights(self, version: int, handle: WeightHandle) -> int:
        """Load ``version`` from ``handle`` without failing any request; returns the version
        serving once it is loaded (a newer one may have superseded it)."""

    @abstractmethod
    async def join_weight_group(self, init: dict[str, Any]) -> None:
        """Join the learner's weight broadcast group (``transport.BroadcastGroup``) as rank
        ``init["rank"]``; returns once every member has joined."""

    async def update_adapter(self, name: str, version: int, handle: WeightHandle, scale: float) -> int:
        """Serve ``version`` of LoRA adapter ``name`` (``<module>.lora_A.weight`` /
        ``.lora_B.weight`` tensors from ``handle``, scaled by ``scale``) beside the others,
        replacing its previous version without pausing other requests; returns the version
        serving it. Engines whose ``features`` lack ``adapters`` refuse."""
        refuse_adapter(self, name)
        return version

    async def remove_adapter(self, name: str) -> None:
        """Unload adapter ``name`` once no open request names it."""
        refuse_adapter(self, name)

    def serving_version(self, adapter: str | None = None) -> int:
        """The version a request naming ``adapter`` starts on now: the adapter's (engines with
        ``adapters`` override this), or the weights' for None."""
        refuse_adapter(self, adapter)
        return self.version

    def stats(self) -> dict[str, float]:
        """Counters for metrics (tokens generated, batches, mean batch size ...)."""
        return {}

    async def close(self) -> None:
        """Stop background work."""


def check_first(first: int, n_tokens: int) -> None:
    """``prompt_logprobs``'s ``first`` must name a token of the prompt past its first."""
    if not 1 <= first < n_tokens:
        raise ValueError(f"prompt_logprobs: first={first} must be >= 1 and below the prompt's "
                         f"{n_tokens} tokens (the first token has no prefix to score it by)")


def refuse_adapter(engine: Engine, adapter: str | None) -> None:
    """An engine without the ``adapters`` feature refuses any request naming one, naming
    the engine that serves them."""
    if adapter is not None and "adapters" not in engine.features:
        raise ValueError(f"adapter {adapter!r}: the {type(engine).__name__} serves no LoRA adapters; "
                         "rollout.engine.type: hf does (docs/lora.md)")
