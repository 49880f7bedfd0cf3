"""``POST /v1/responses`` and ``GET /v1/responses/{id}`` on top of the live chat service.

A Responses request is served as the chat request ``responses_wire.to_chat_body`` builds, through
``LiveService`` (same validation, engine call, session recording and training), and its chat
reply -- whole, or chunk by chunk when streamed -- becomes the response's output items and
events (``responses_output.OutputBuilder``). Errors name the Responses field (``input``,
``max_output_tokens``, ``tools.0.strict`` ...).

``previous_response_id``: a stored response (``store`` not false) keeps what its request added
to the conversation and its own reply, linked to the response it chained on; a chained request's
history is that chain, walked back (``instructions`` are not carried, OpenAI's rule). The session
is the header's, else the chained response's, else ``user``'s, else a fresh one, so a chain is one
recorded session and its turns stitch token-exact. The newest ``live.max_kept_responses``
responses are kept (least recently used evicted first); a chain reaching an evicted one is a 400
naming ``previous_response_id``.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, AsyncIterator

from gateway.errors import GatewayError, InvalidRequest
from gateway.responses_output import OutputBuilder, usage
from gateway.responses_wire import ResponsesRequest, parse_responses_request, responses_param, to_chat_body
from gateway.service import LiveService

log = logging.getLogger(__name__)


class ResponseNotFound(GatewayError):
    status = 404

    def __init__(self, response_id: str) -> None:
        super().__init__("response_id", f"no response {response_id!r} is kept here (responses are kept unless "
                                        "store is false, the newest live.max_kept_responses of them)")


@dataclass
class _Kept:
    session_id: str
    previous: str | None
    added: list[dict[str, Any]]
    """The chat messages this response added to the conversation: its input, then its reply."""
    response: dict[str, Any]


@dataclass
class ResponseCall:
    req: ResponsesRequest
    chat: Any
    """The served chat call (``gateway.service._Call``)."""
    response_id: str
    created_at: int
    added: list[dict[str, Any]]


class ResponsesService:
    def __init__(self, live: LiveService) -> None:
        self.live = live
        self._kept: OrderedDict[str, _Kept] = OrderedDict()

    async def open(self, body: Any, session_header: str | None) -> ResponseCall:
        req = parse_responses_request(body)
        history, session = [], session_header
        if req.previous_response_id is not None:
            history = self._history(req.previous_response_id)
            session = session or self._kept[req.previous_response_id].session_id
        chat_body = to_chat_body(req, history)
        try:
            call = await self.live.open_call(chat_body, session)
        except InvalidRequest as exc:
            raise InvalidRequest(responses_param(exc.param), exc.message) from None
        added = chat_body["messages"][(req.instructions is not None) + len(history):]
        return ResponseCall(req, call, f"resp_{uuid.uuid4().hex}", int(time.time()), added)

    def _history(self, response_id: str) -> list[dict[str, Any]]:
        chain: list[list[dict[str, Any]]] = []
        at: str | None = response_id
        while at is not None:
            kept = self._kept.get(at)
            if kept is None:
                raise InvalidRequest("previous_response_id", f"response {at!r} is not kept here (never stored, "
                                     "store: false, or evicted past live.max_kept_responses); send the whole "
                                     "conversation as input instead")
            self._kept.move_to_end(at)
            chain.append(kept.added)
            at = kept.previous
        return [m for added in reversed(chain) for m in added]

    def get(self, response_id: str) -> dict[str, Any]:
        kept = self._kept.get(response_id)
        if kept is None:
            raise ResponseNotFound(response_id)
        return kept.response

    # -- serving ------------------------------------------------------------------------------
    async def complete(self, rc: ResponseCall) -> dict[str, Any]:
        out = await self.live.complete(rc.chat)
        choice = out["choices"][0]
        builder = OutputBuilder(rc.response_id)
        logprobs = (choice.get("logprobs") or {}).get("content")
        message = choice["message"]
        builder.delta({**message, "tool_calls": [{**c, "index": i} for i, c in enumerate(message.get("tool_calls") or [])]},
                      logprobs)
        builder.finish(choice["finish_reason"] != "length")
        response = self._response(rc, builder, choice["finish_reason"], out["usage"]["completion_tokens"])
        self._keep(rc, builder, response)
        return response

    async def stream(self, rc: ResponseCall) -> AsyncIterator[dict[str, Any]]:
        """The response's events in order (``sequence_number`` set); ``error`` if serving fails."""
        builder, seq = OutputBuilder(rc.response_id), 0

        def numbered(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
            nonlocal seq
            for e in events:
                e["sequence_number"], seq = seq, seq + 1
            return events

        opening = self._response(rc, builder, None, 0)
        for kind in ("response.created", "response.in_progress"):
            yield numbered([{"type": kind, "response": opening}])[0]
        finish = "stop"
        try:
            async for chunk in self.live.stream(rc.chat):
                for choice in chunk.choices:
                    lps = choice.logprobs.wire()["content"] if choice.logprobs is not None else None
                    builder.delta(choice.delta.wire(), lps)
                    if choice.finish_reason is not None:
                        finish = choice.finish_reason
                        builder.finish(finish != "length")
                for event in numbered(builder.take_events()):
                    yield event
        except GatewayError as exc:
            yield numbered([{"type": "error", "code": exc.code, "message": str(exc), "param": exc.param}])[0]
            return
        except Exception as exc:  # noqa: BLE001 - a dead engine mid-stream: the error event ends it
            log.error("gateway: a response stream failed", exc_info=exc)
            yield numbered([{"type": "error", "code": "server_error", "param": None,
                             "message": f"internal error: {type(exc).__name__}: {exc}"}])[0]
            return
        response = self._response(rc, builder, finish, rc.chat.completion_tokens)
        self._keep(rc, builder, response)
        kind = "response.incomplete" if finish == "length" else "response.completed"
        yield numbered([{"type": kind, "response": response}])[0]

    def _keep(self, rc: ResponseCall, builder: OutputBuilder, response: dict[str, Any]) -> None:
        if rc.req.store is False:
            return
        self._kept[rc.response_id] = _Kept(rc.chat.prepared.session_id, rc.req.previous_response_id,
                                           [*rc.added, builder.reply_message()], response)
        while len(self._kept) > self.live.cfg.max_kept_responses:
            self._kept.popitem(last=False)

    def _response(self, rc: ResponseCall, builder: OutputBuilder, finish: str | None,
                  completion_tokens: int) -> dict[str, Any]:
        req = rc.req
        status = "in_progress" if finish is None else "incomplete" if finish == "length" else "completed"
        fmt = req.text.format.model_dump(by_alias=True, exclude_none=True) if req.text and req.text.format else None
        return {
            "id": rc.response_id, "object": "response", "created_at": rc.created_at, "status": status,
            "error": None, "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": req.instructions, "max_output_tokens": req.max_output_tokens,
            "model": self.live.cfg.model_name, "output": [dict(i) for i in builder.items],
            "parallel_tool_calls": req.parallel_tool_calls is not False,
            "previous_response_id": req.previous_response_id,
            "reasoning": {"effort": req.reasoning.effort if req.reasoning else None, "summary": None},
            "store": req.store is not False, "temperature": req.temperature if req.temperature is not None else 1.0,
            "text": {"format": fmt or {"type": "text"}}, "tool_choice": _tool_choice(req),
            "tools": [t.model_dump(exclude_none=True) for t in req.tools or []],
            "top_p": req.top_p if req.top_p is not None else 1.0, "truncation": req.truncation or "disabled",
            "usage": usage(len(rc.chat.prepared.prompt_ids), completion_tokens) if finish is not None else None,
            "user": req.user, "metadata": req.metadata or {},
        }


def _tool_choice(req: ResponsesRequest) -> Any:
    choice = req.tool_choice
    return choice.model_dump() if choice is not None and not isinstance(choice, str) else (choice or "auto")

