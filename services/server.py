"""``turnrl serve``: wire config, tokens, Ray, registry and API together and run uvicorn."""

from __future__ import annotations

import logging
import os
import socket
import sys
from typing import Any, Mapping

from services.api import ServiceState, create_app
from services.auth import RedactSecrets, Sessions, TokenStore, token_env_names
from services.config import ServiceConfig
from services.jobs import RayJobs
from services.ray_cluster import LocalRayHead
from services.registry import RunRegistry
from services.runs import RunManager

log = logging.getLogger(__name__)


def log_config(level: str, secrets: list[str]) -> dict[str, Any]:
    """One stderr handler for the service and uvicorn, with tokens redacted from every line."""
    return {
        "version": 1,
        "disable_existing_loggers": False,
        "filters": {"redact": {"()": RedactSecrets, "secrets": secrets}},
        "formatters": {"plain": {"format": "%(asctime)s %(levelname)s %(name)s: %(message)s"}},
        "handlers": {"stderr": {"class": "logging.StreamHandler", "formatter": "plain", "filters": ["redact"],
                                "stream": "ext://sys.stderr"}},
        "loggers": {name: {"level": level.upper(), "handlers": [], "propagate": True}
                    for name in ("uvicorn", "uvicorn.error", "uvicorn.access", "services")},
        "root": {"handlers": ["stderr"], "level": "WARNING"},
    }


def build_state(cfg: ServiceConfig, environ: Mapping[str, str] = os.environ,
                tokens: TokenStore | None = None) -> ServiceState:
    tokens = tokens or TokenStore.from_config(cfg.auth, environ)  # fail before starting anything
    address = cfg.ray.address or LocalRayHead(cfg.ray.local, cfg.state_path(), token_env_names(cfg.auth)).ensure()
    jobs = RayJobs(address, cfg.jobs)
    manager = RunManager(cfg, RunRegistry(cfg.registry_path()), jobs)
    return ServiceState(cfg, tokens, jobs, manager, Sessions(cfg.auth.session_ttl_s))


def serve(cfg: ServiceConfig) -> int:
    import logging.config

    import uvicorn

    tokens = TokenStore.from_config(cfg.auth)
    logging.config.dictConfig(log_config(cfg.log_level, tokens.secrets()))  # before Ray's start-up logs
    state = build_state(cfg, tokens=tokens)
    # Bind first so that port 0 can be reported; uvicorn then serves on this socket.
    sock = socket.socket(socket.AF_INET6 if ":" in cfg.host else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((cfg.host, cfg.port))
    host, port = sock.getsockname()[:2]
    print(f"turnrl serve: http://{host}:{port} (dashboard /dashboard, Ray job server {state.jobs.address}, "
          f"registry {cfg.registry_path()})", file=sys.stderr, flush=True)
    server = uvicorn.Server(uvicorn.Config(
        create_app(state), log_config=log_config(cfg.log_level, tokens.secrets()),
        log_level=cfg.log_level, timeout_graceful_shutdown=5, proxy_headers=False))
    try:
        server.run(sockets=[sock])
    finally:
        state.manager.registry.close()
    return 0


def stop_local_ray(cfg: ServiceConfig) -> int:
    """Stop the Ray head this service started (runs on it end with it)."""
    stopped = LocalRayHead(cfg.ray.local, cfg.state_path()).stop()
    print("stopped the local Ray head" if stopped else "no local Ray head of this service is running",
          file=sys.stderr)
    return 0
