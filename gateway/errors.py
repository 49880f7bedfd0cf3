"""Client errors of the gateway, each naming the offending parameter.

The app maps them to OpenAI's error body, ``{"error": {"message", "type", "param", "code"}}``,
with the HTTP status each class carries.
"""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError


class GatewayError(Exception):
    """A request the gateway refuses; ``param`` is the field's dotted path (None: the body)."""

    status = 400
    kind = "invalid_request_error"
    code: str | None = None
    """OpenAI's machine-readable ``code`` (``model_not_found`` ...); None where OpenAI sends null."""
    retry_after_s: int | None = None
    """Sent as ``Retry-After`` (a 429: try again in this many seconds)."""

    def __init__(self, param: str | None, message: str) -> None:
        super().__init__(f"{param}: {message}" if param else message)
        self.param = param
        self.message = message

    def body(self) -> dict[str, Any]:
        """OpenAI's error body."""
        return {"error": {"message": str(self), "type": self.kind, "param": self.param, "code": self.code}}


class InvalidRequest(GatewayError):
    """Malformed, unknown or unsupported request content (HTTP 400)."""


class UnknownSession(GatewayError):
    """No session with this id is recorded (HTTP 404)."""

    status = 404

    def __init__(self, session_id: str) -> None:
        super().__init__("session_id", f"unknown session {session_id!r}")


class ModelNotFound(GatewayError):
    """The request names a model this endpoint does not serve (HTTP 404, like OpenAI's)."""

    status = 404
    code = "model_not_found"

    def __init__(self, model: str, served: str) -> None:
        super().__init__("model", f"the model {model!r} does not exist here; this endpoint serves "
                                  f"{served!r} (GET /v1/models)")


class SessionEnded(GatewayError):
    """The session was ended; it takes feedback but no more requests (HTTP 409)."""

    status = 409

    def __init__(self, session_id: str) -> None:
        super().__init__("session_id", f"session {session_id!r} has ended; start a new session id")


class SessionClosed(GatewayError):
    """Feedback for a session the gateway has already closed and submitted (HTTP 409): its
    segments left with what they had (``cause``: ended, feedback_idle, timed_out, evicted)."""

    status = 409

    def __init__(self, session_id: str, cause: str) -> None:
        super().__init__("session_id", f"session {session_id!r} was closed ({cause}) and submitted before this "
                                       "feedback came; feedback must come before the close (live.close_after_"
                                       "feedback_s, live.feedback_timeout_s)")


class NoEngine(GatewayError):
    """No engine of the run could serve the request: the ones tried were dead or restarting, or
    the one streaming it died mid-way (HTTP 503 with ``Retry-After``; mid-stream, the same body
    as an error event). Ray restarts the engine; the request can be sent again."""

    status = 503
    kind = "server_error"
    code = "engine_unavailable"

    def __init__(self, message: str, retry_after_s: int) -> None:
        super().__init__(None, f"{message}; retry after {retry_after_s} s")
        self.retry_after_s = retry_after_s


def loc_path(loc: tuple[Any, ...]) -> str:
    """Pydantic's error location as a dotted path: ``("messages", 2, "role")`` ->
    ``messages.2.role``."""
    return ".".join(str(p) for p in loc)


def from_validation(exc: ValidationError, fields: frozenset[str] | None = None) -> InvalidRequest:
    """The first validation error as an InvalidRequest naming its field. With ``fields`` (every
    field name of the models involved) the path stops at the first element that is no field
    or index: pydantic appends union members (``stop.str``) that name no parameter."""
    err = exc.errors()[0]
    if err["type"] == "extra_forbidden":
        return InvalidRequest(loc_path(err["loc"]), "unknown or unsupported parameter; remove it")
    loc = list(err["loc"])
    msg = err["msg"].removeprefix("Value error, ")
    if fields is not None:
        cut = next((i for i, p in enumerate(loc) if isinstance(p, str) and p not in fields), len(loc))
        inner = [str(p) for p in loc[cut + 1:] if not isinstance(p, str) or p in fields]
        if inner:  # past a union member's tag: say which of its fields
            msg = f"{'.'.join(inner)}: {msg}"
        loc = loc[:cut]
    path = loc_path(tuple(loc))
    return InvalidRequest(path or None, msg)
