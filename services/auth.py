"""Bearer-token auth: who is calling, and may they write.

Tokens come from the config file or environment variables and are kept only as SHA-256
digests for comparison (constant time); the raw values are held for one purpose, redacting
them from log lines (``RedactSecrets``). A browser gets a session cookie from
``POST /v1/session`` (made with its bearer token); the cookie authenticates GET/HEAD only, so a
cross-site form can never submit, stop or delete a run with it.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import secrets
import threading
import time
from dataclasses import dataclass
from typing import Mapping

from fastapi import HTTPException, Request

from services.config import AuthConfig, ServiceConfigError

SESSION_COOKIE = "turnrl_session"
_SAFE_METHODS = ("GET", "HEAD")


@dataclass(frozen=True)
class Principal:
    name: str
    read_only: bool = False


def _digest(token: str) -> bytes:
    return hashlib.sha256(token.encode()).digest()


def _env_tokens(value: str) -> list[tuple[str, str, bool]]:
    """``name=token,viewer:ro=token`` -> [(name, token, read_only)]."""
    out = []
    for item in filter(None, (part.strip() for part in value.split(","))):
        name, sep, token = item.partition("=")
        if not sep:
            raise ServiceConfigError("token list entries must look like name=token (name:ro=token read-only)")
        read_only = name.endswith(":ro")
        out.append((name.removesuffix(":ro"), token, read_only))
    return out


def token_env_names(cfg: AuthConfig) -> frozenset[str]:
    """Environment variables that hold API tokens: kept out of the Ray head's environment, and
    so out of every run's (a run could otherwise print them, or send one as a Redis password)."""
    return frozenset(filter(None, [cfg.tokens_env, *(tc.token_env for tc in cfg.tokens)]))


class TokenStore:
    def __init__(self, entries: list[tuple[Principal, str]]) -> None:
        self._entries = [(p, _digest(t)) for p, t in entries]
        self._secrets = [t for _, t in entries]

    @classmethod
    def from_config(cls, cfg: AuthConfig, environ: Mapping[str, str] = os.environ) -> "TokenStore":
        raw: list[tuple[str, str, bool]] = []
        for tc in cfg.tokens:
            token = tc.token.get_secret_value() if tc.token else environ.get(tc.token_env or "", "")
            if not token:
                raise ServiceConfigError(f"auth.tokens[{tc.name}]: environment variable {tc.token_env} is not set")
            raw.append((tc.name, token, tc.read_only))
        if cfg.tokens_env and environ.get(cfg.tokens_env):
            raw.extend(_env_tokens(environ[cfg.tokens_env]))
        if not raw:
            raise ServiceConfigError("no API tokens: set auth.tokens in the service config or "
                                     f"{cfg.tokens_env or 'auth.tokens_env'}=name=token in the environment")
        names = [n for n, _, _ in raw]
        if len(set(names)) != len(names):
            raise ServiceConfigError("auth: token names must be unique (they own runs)")
        for name, token, _ in raw:
            if len(token) < cfg.min_token_length:
                raise ServiceConfigError(f"auth: the token of {name!r} is shorter than "
                                         f"auth.min_token_length={cfg.min_token_length}")
        return cls([(Principal(n, ro), t) for n, t, ro in raw])

    def lookup(self, token: str) -> Principal | None:
        digest = _digest(token)
        found = None
        for principal, known in self._entries:  # compare against all: timing reveals nothing
            if hmac.compare_digest(digest, known):
                found = principal
        return found

    def secrets(self) -> list[str]:
        return list(self._secrets)


class Sessions:
    """Dashboard login cookies, in memory (a restarted service asks for the token again)."""

    def __init__(self, ttl_s: float) -> None:
        self.ttl_s = ttl_s
        self._lock = threading.Lock()
        self._sessions: dict[str, tuple[Principal, float]] = {}

    def create(self, principal: Principal) -> str:
        sid = secrets.token_urlsafe(32)
        now = time.time()
        with self._lock:
            self._sessions = {k: v for k, v in self._sessions.items() if v[1] > now}
            self._sessions[sid] = (principal, now + self.ttl_s)
        return sid

    def get(self, sid: str) -> Principal | None:
        with self._lock:
            entry = self._sessions.get(sid)
        return entry[0] if entry and entry[1] > time.time() else None

    def revoke(self, sid: str) -> None:
        with self._lock:
            self._sessions.pop(sid, None)


def _unauthorized(detail: str) -> HTTPException:
    return HTTPException(401, detail, headers={"WWW-Authenticate": "Bearer"})


def authenticate(request: Request) -> Principal:
    """FastAPI dependency: the caller's principal, or 401."""
    store: TokenStore = request.app.state.tokens
    header = request.headers.get("authorization")
    if header:
        scheme, _, token = header.partition(" ")
        principal = store.lookup(token.strip()) if scheme.lower() == "bearer" and token.strip() else None
        if principal is None:
            raise _unauthorized("invalid bearer token")
        return principal
    sid = request.cookies.get(SESSION_COOKIE)
    if sid and request.method in _SAFE_METHODS:
        principal = request.app.state.sessions.get(sid)
        if principal is not None:
            return principal
    raise _unauthorized("missing bearer token (Authorization: Bearer <token>)")


def require_writer(principal: Principal) -> Principal:
    if principal.read_only:
        raise HTTPException(403, f"token {principal.name!r} is read-only")
    return principal


class RedactSecrets(logging.Filter):
    """Replaces any known token in a log record's text with ``***`` (defence in depth)."""

    def __init__(self, secrets: list[str] = ()) -> None:
        super().__init__()
        self.secrets = [s for s in secrets if s]

    def filter(self, record: logging.LogRecord) -> bool:
        if not self.secrets:
            return True
        text = record.getMessage()
        if any(s in text for s in self.secrets):
            for s in self.secrets:
                text = text.replace(s, "***")
            record.msg, record.args = text, ()
        return True
