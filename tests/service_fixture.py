"""The run service on a loopback port for tests: the real app under uvicorn, in a thread.

Imported by tests/test_services_*.py (not a conftest, so it stays theirs). ``serve(cfg,
tokens)`` yields a ``Service`` with the URL and the live ``ServiceState``; with no
``ray.address`` in ``cfg`` the service starts its own local Ray head, stopped again on exit.
"""

from __future__ import annotations

import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from services.config import ServiceConfig
from services.ray_cluster import LocalRayHead, free_port

ALICE, BOB, VIEWER = "alice-token-0123456789", "bob-token-0123456789xyz", "viewer-token-0123456789"
TOKENS = f"alice={ALICE},bob={BOB},viewer:ro={VIEWER}"


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


class Service:
    def __init__(self, url: str, state, tmp: Path) -> None:
        self.url, self.state, self.tmp = url, state, tmp


def ray_down(tmp: Path, **fields) -> ServiceConfig:
    """A service whose Ray job server address answers nothing: every admitted run gets 503."""
    return ServiceConfig(state_dir=str(tmp), ray={"address": f"http://127.0.0.1:{free_port()}"}, **fields)


@contextmanager
def serve(cfg: ServiceConfig, tokens: str = TOKENS, environ: dict[str, str] | None = None) -> Iterator[Service]:
    import uvicorn

    from services.api import create_app
    from services.server import build_state

    state = build_state(cfg, {**(environ or {}), "TURNRL_SERVICE_TOKENS": tokens})
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(create_app(state), host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 30
        while not server.started and time.monotonic() < deadline:
            time.sleep(0.05)
        yield Service(f"http://127.0.0.1:{port}", state, Path(cfg.state_dir))
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        state.manager.registry.close()
        if cfg.ray.address is None:
            LocalRayHead(cfg.ray.local, cfg.state_path()).stop()
