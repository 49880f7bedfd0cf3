"""The HTTP face of the live service: OpenAI-compatible routes plus the session routes.

``POST /v1/chat/completions`` (JSON, or server-sent events with ``stream: true``),
``POST /v1/responses`` (the same, in the Responses API's shapes and events) and
``GET /v1/responses/{id}``, ``GET /v1/models``, ``POST /v1/sessions/{id}/feedback``, ``POST /v1/sessions/{id}/end``,
``GET /metrics`` (Prometheus, no auth, like every exporter) and ``GET /healthz``. Errors use
OpenAI's body (``{"error": {"message", "type", "param", "code"}}``) with the status the error
carries: 400 bad parameter, 401 bad token, 404 unknown session, 409 ended session, 429 full
(replay's live budget, or every admission slot taken: ``gateway.admission``; ``Retry-After`` set).
"""

from __future__ import annotations

import hmac
import json
import logging
import time
from typing import Any, AsyncIterator, Callable

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.background import BackgroundTask
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from gateway.errors import GatewayError
from gateway.metrics import GatewayMetrics
from gateway.responses_service import ResponsesService
from gateway.service import LiveService

log = logging.getLogger(__name__)


class Unauthorized(GatewayError):
    status = 401

    def __init__(self) -> None:
        super().__init__(None, "missing or invalid bearer token (Authorization: Bearer <token>)")


def _error(exc: GatewayError) -> JSONResponse:
    headers = {"Retry-After": str(exc.retry_after_s)} if exc.retry_after_s is not None else None
    return JSONResponse(exc.body(), status_code=exc.status, headers=headers)


def build_app(service: LiveService, run: str = "") -> FastAPI:
    tokens = [t.get_secret_value().encode() for t in service.cfg.tokens]
    metrics = GatewayMetrics(service.stats, run)
    app = FastAPI(title="TurnRL live gateway", docs_url=None, redoc_url=None)
    app.state.metrics = metrics
    responses = ResponsesService(service)

    def check(request: Request) -> str:
        """The request's bearer token, checked ("" when the endpoint takes none)."""
        if not tokens:
            return ""
        given = request.headers.get("authorization", "")
        scheme, _, token = given.partition(" ")
        if scheme.lower() != "bearer" or not any(hmac.compare_digest(token.encode(), t) for t in tokens):
            raise Unauthorized()
        return token

    @app.exception_handler(GatewayError)
    async def _on_gateway_error(request: Request, exc: GatewayError) -> JSONResponse:
        metrics.requests.labels(_route(request), str(exc.status)).inc()
        return _error(exc)

    @app.exception_handler(Exception)
    async def _on_bug(request: Request, exc: Exception) -> JSONResponse:
        # A bug or a dead engine: logged with its traceback, counted, and named to the client.
        log.error("gateway: %s failed", _route(request), exc_info=exc)
        metrics.requests.labels(_route(request), "500").inc()
        return JSONResponse(server_error(exc), status_code=500)

    async def serve(request: Request, route: str, open_call: Callable, complete: Callable, events: Callable,
                    chat_of: Callable = lambda call: call) -> Response:
        """One request, holding an admission slot (``gateway.admission``) until its last byte."""
        token = check(request)
        service.admission.take(token)
        streaming = False
        try:
            t0 = time.perf_counter()
            try:
                body = await request.json()
            except ValueError:
                raise _BadJson() from None
            call = await open_call(body, request.headers.get("x-session-id"))
            metrics.tokens.labels("prompt").inc(len(chat_of(call).prepared.prompt_ids))
            if not call.req.stream:
                out = await complete(call)
                _served(metrics, route, chat_of(call), t0, False)
                return JSONResponse(out)
            streaming = True
            return StreamingResponse(events(call, metrics, t0), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"},
                                     background=BackgroundTask(service.admission.give, token))
        finally:
            if not streaming:
                service.admission.give(token)

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        return await serve(request, "/v1/chat/completions", service.open_call, service.complete,
                           lambda call, m, t0: _sse(service, call, m, t0))

    @app.post("/v1/responses")
    async def create_response(request: Request) -> Response:
        return await serve(request, "/v1/responses", responses.open, responses.complete,
                           lambda call, m, t0: _response_events(responses, call, m, t0), lambda call: call.chat)

    @app.get("/v1/responses/{response_id}")
    async def get_response(response_id: str, request: Request) -> JSONResponse:
        check(request)
        out = responses.get(response_id)
        metrics.requests.labels("/v1/responses/{response_id}", "200").inc()
        return JSONResponse(out)

    @app.get("/v1/models")
    async def models(request: Request) -> JSONResponse:
        check(request)
        metrics.requests.labels("/v1/models", "200").inc()
        return JSONResponse(await service.models())

    @app.post("/v1/sessions/{session_id}/feedback")
    async def feedback(session_id: str, request: Request) -> JSONResponse:
        check(request)
        try:
            body = await request.json()
        except ValueError:
            raise _BadJson() from None
        out = service.feedback(session_id, body)
        metrics.requests.labels("/v1/sessions/{session_id}/feedback", "200").inc()
        return JSONResponse(out)

    @app.post("/v1/sessions/{session_id}/end")
    async def end(session_id: str, request: Request) -> JSONResponse:
        check(request)
        out = service.end(session_id)
        metrics.requests.labels("/v1/sessions/{session_id}/end", "200").inc()
        return JSONResponse(out)

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/healthz")
    async def healthz() -> dict[str, Any]:
        return {"ok": True, "version": service.engine.version}

    return app


def server_error(exc: BaseException) -> dict[str, Any]:
    """OpenAI's body for a failure of ours (a bug, a dead engine), naming it."""
    return {"error": {"message": f"internal error: {type(exc).__name__}: {exc}", "type": "server_error",
                      "param": None, "code": None}}


def _route(request: Request) -> str:
    route = request.scope.get("route")
    return getattr(route, "path", "unmatched")


class _BadJson(GatewayError):
    def __init__(self) -> None:
        super().__init__(None, "the request body is not valid JSON")


async def _sse(service: LiveService, call: Any, metrics: GatewayMetrics, t0: float) -> AsyncIterator[bytes]:
    """``data: <chunk>`` events, then ``data: [DONE]``. An engine failure mid-stream becomes an
    error event (the status line is already sent)."""
    try:
        async for chunk in service.stream(call):
            yield b"data: " + json.dumps(chunk.wire()).encode() + b"\n\n"
    except GatewayError as exc:
        yield b"data: " + json.dumps(exc.body()).encode() + b"\n\n"
        metrics.requests.labels("/v1/chat/completions", str(exc.status)).inc()
        return
    except Exception as exc:  # noqa: BLE001 - a dead engine mid-stream: OpenAI's error event, then the end
        log.error("gateway: a stream failed", exc_info=exc)
        yield b"data: " + json.dumps(server_error(exc)).encode() + b"\n\n"
        metrics.requests.labels("/v1/chat/completions", "500").inc()
        return
    yield b"data: [DONE]\n\n"
    _served(metrics, "/v1/chat/completions", call, t0, True)


async def _response_events(responses: ResponsesService, call: Any, metrics: GatewayMetrics,
                           t0: float) -> AsyncIterator[bytes]:
    """``event: <type>`` / ``data: <event>`` pairs, as OpenAI streams a response (no ``[DONE]``)."""
    async for event in responses.stream(call):
        yield f"event: {event['type']}\ndata: ".encode() + json.dumps(event).encode() + b"\n\n"
        if event["type"] == "error":
            metrics.requests.labels("/v1/responses", "500").inc()
            return
    _served(metrics, "/v1/responses", call.chat, t0, True)


def _served(metrics: GatewayMetrics, route: str, call: Any, t0: float, stream: bool) -> None:
    """A served request's completion tokens, latency and 200, counted once it is done."""
    metrics.tokens.labels("completion").inc(call.completion_tokens)
    metrics.latency.labels(str(stream).lower()).observe(time.perf_counter() - t0)
    metrics.requests.labels(route, "200").inc()
