"""Live-traffic configuration: the run's OpenAI-compatible endpoint (pydantic only)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, SecretStr, model_validator

_LOOPBACK = ("127.0.0.1", "localhost", "::1")


class LiveConfig(BaseModel):
    """Serve the policy through an OpenAI-compatible endpoint while the run trains, and record
    every conversation as token-exact trajectories (docs/live.md)."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    enabled: bool = False
    """Start the endpoint with the run; its base URL is printed and kept in ``live.json`` in
    the run directory."""
    host: str = "127.0.0.1"
    """Interface to listen on. Anything but loopback requires ``tokens``."""
    port: int = Field(0, ge=0, le=65535)
    """TCP port; 0 picks a free one."""
    tokens: list[SecretStr] = []
    """Bearer tokens accepted (``Authorization: Bearer <token>``). Empty: no authentication,
    allowed only on a loopback host. Never logged; written to the run's config as ``****``."""
    model_name: str = Field("turnrl-policy", min_length=1)
    """The model id ``GET /v1/models`` lists and responses carry."""
    default_max_tokens: int = Field(256, ge=1)
    """Completion tokens when a request sets neither ``max_tokens`` nor
    ``max_completion_tokens``."""
    max_context_tokens: int = Field(4096, ge=32)
    """A request whose prompt plus ``max_tokens`` exceeds this gets a 400 naming ``messages``."""
    when_full: Literal["shed", "reject"] = "shed"
    """When replay has no room for more live groups (its staleness and capacity budget is
    full): ``shed`` serves the request and drops its recording (counted); ``reject`` answers
    429 with Retry-After and serves nothing."""
    retry_after_s: int = Field(1, ge=1)
    """The Retry-After seconds of a 429."""
    feedback_timeout_s: float = Field(600.0, gt=0)
    """A session with no request or feedback for this long is closed: scored and sent to
    replay, or dropped (``on_timeout``); counted either way."""
    close_after_feedback_s: float = Field(10.0, gt=0)
    """A session that has feedback is closed and submitted once no request or feedback came for
    this long, without waiting for ``/end`` (the openai SDK and agent frameworks never call
    it). A request after that starts a new session under the same id."""
    on_timeout: Literal["score", "drop"] = "score"
    """A session that times out without feedback: ``score`` it with the sources that need no
    gold (PRM, judge; those that cannot apply are skipped and counted), or ``drop`` it."""
    max_sessions: int = Field(10_000, ge=1)
    """Open sessions kept; past this the least recently active one is closed (counted as
    ``evicted``): submitted when it has feedback, else treated as if it had timed out
    (``on_timeout``), so memory stays bounded."""
    max_concurrent: int = Field(256, ge=1)
    """Requests served at once (from parse to a stream's last byte), all clients together; one
    more is answered 429 with ``Retry-After: retry_after_s`` at once, before any engine work."""
    max_concurrent_per_token: int | None = Field(None, ge=1)
    """The same, per bearer token (each client's share); None: only ``max_concurrent``."""
    stream_stall_timeout_s: float = Field(30.0, gt=0)
    """A stream whose client has read nothing for this long is ended: its engine requests are
    aborted (their batch rows freed), nothing is recorded, it is counted (``client_stalled``)."""
    max_kept_responses: int = Field(10_000, ge=1)
    """Responses API responses kept for ``previous_response_id`` and ``GET /v1/responses/{id}``
    (each holds only what it added to its conversation); past this the least recently used goes."""
    num_cpus: float = Field(0.0, ge=0)
    """Ray CPUs reserved for the gateway actor. 0 by default: it parses, tokenizes and waits on
    the engines, which do the heavy work on their own reserved CPUs."""

    @model_validator(mode="after")
    def _auth_off_loopback(self) -> "LiveConfig":
        if self.enabled and not self.tokens and self.host not in _LOOPBACK:
            raise ValueError(f"live.tokens: host {self.host!r} is not loopback, so the endpoint needs "
                             "at least one bearer token (or set live.host to 127.0.0.1)")
        if any(set(t.get_secret_value()) <= {"*"} for t in self.tokens):
            # the masked form a dumped config shows: loading it back would let anyone in
            raise ValueError("live.tokens: an empty token, or one of only '*' (the masked form a dumped "
                             "config shows), would let anyone in; give the real token")
        return self
