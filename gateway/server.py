"""The gateway as a service: the plain class the driver wraps as a Ray actor.

``LiveGateway.start()`` binds the configured host and port (0: a free one), serves the app with
uvicorn on the actor's own event loop (so engine calls, streams and session sweeps share it
with HTTP), starts the sweeper that closes idle sessions and returns the OpenAI base URL. The same
class runs in-process for tests and benches.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from typing import Any

from envs.formats import DEFAULT_FORMAT
from gateway.app import build_app
from gateway.config import LiveConfig
from gateway.service import LiveService

log = logging.getLogger(__name__)
STOP_DRAIN_S = 10.0
"""How long ``stop`` waits for live submissions already under way."""


KEEP_ALIVE_S = 75
"""Seconds an idle client connection stays open: longer than clients keep one in their pools
(httpx 5 s, aiohttp 15 s, browsers ~60 s), so the client closes an idle connection, not the
server. With uvicorn's 5 s the server closed connections clients were reusing that instant:
ReadError on 10 of 3,364 requests at 256 concurrent sessions (bench/live_load.py)."""


class LiveGateway:
    def __init__(self, cfg: LiveConfig, engine: Any, ports: Any = None,
                 scorable_without_feedback: bool = False, run_id: str = "",
                 record_path: str | None = None, early_judge: bool = False, chat_format: str = DEFAULT_FORMAT) -> None:
        self.cfg = cfg
        self.service = LiveService(cfg, engine, ports, scorable_without_feedback, record_path, early_judge,
                                   chat_format)
        self.app = build_app(self.service, run_id)
        self._server: Any = None
        self._tasks: list[asyncio.Task] = []
        self.address = ""

    async def start(self) -> str:
        """Serve; returns the base URL (``http://host:port/v1``). Idempotent."""
        import uvicorn

        if self._server is not None:
            return self.base_url
        sock = socket.socket(socket.AF_INET6 if ":" in self.cfg.host else socket.AF_INET)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((self.cfg.host, self.cfg.port))
        host, port = sock.getsockname()[:2]
        self.address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        config = uvicorn.Config(self.app, log_level="warning", access_log=False, lifespan="off",
                                timeout_graceful_shutdown=2, timeout_keep_alive=KEEP_ALIVE_S)
        self._server = uvicorn.Server(config)
        loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(self._server.serve(sockets=[sock])), loop.create_task(self._sweep())]
        while not self._server.started:
            if self._tasks[0].done():
                self._tasks[0].result()  # raises why it could not start
            await asyncio.sleep(0.01)
        return self.base_url

    @property
    def base_url(self) -> str:
        return f"http://{self.address}/v1"

    async def _sweep(self) -> None:
        period = min(self.cfg.feedback_timeout_s / 4, self.cfg.close_after_feedback_s / 4, 5.0)
        while True:
            await asyncio.sleep(period)
            try:
                await self.service.sweep()
            except Exception:  # noqa: BLE001 - a failed sweep must not stop serving
                log.exception("gateway: closing idle sessions failed")

    def start_metrics_server(self, run_id: str) -> str:
        """The Prometheus endpoint (``/metrics`` on the gateway's own port)."""
        return self.address

    def stats(self) -> dict[str, Any]:
        return self.service.stats()

    async def drain(self) -> None:
        await self.service.drain()

    async def stop(self) -> None:
        """Finish the requests in flight, then close every session still open (counted
        ``run_ended``, kept in the record file) and wait for the submissions under way."""
        if self._server is not None:
            self._server.should_exit = True
            await asyncio.gather(self._tasks[0], return_exceptions=True)
        for task in self._tasks[1:]:
            task.cancel()
        await self.service.close_all("run_ended")
        try:  # submissions under way; the driver gives stop() 30 s in all
            await asyncio.wait_for(self.service.drain(), STOP_DRAIN_S)
        except asyncio.TimeoutError:
            log.warning("gateway: %d live submissions still running at stop", len(self.service._pending))  # noqa: SLF001
