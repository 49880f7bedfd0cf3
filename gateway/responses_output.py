"""What ``POST /v1/responses`` sends: output items, the response object, and streamed events.

One builder serves both: ``OutputBuilder`` takes the served chat request's deltas (the chunks a
stream sends, or a whole message as one delta) and keeps the output items -- ``reasoning`` (its
text as ``reasoning_text`` content), an assistant ``message`` with one ``output_text`` part, one
``function_call`` item per call (``call_id`` the chat call id, so a call sent back stitches on)
-- emitting OpenAI's streaming events as each item opens, grows and closes:
``response.output_item.added``, ``response.content_part.added``, ``response.output_text.delta``
/ ``response.reasoning_text.delta`` / ``response.function_call_arguments.delta``, their
``.done`` events, ``response.output_item.done``. The stream opens with ``response.created`` and
``response.in_progress`` and ends with ``response.completed`` (or ``response.incomplete`` when
the token limit cut the reply), each carrying the response object; every event has its
``sequence_number``. Usage: ``input_tokens`` (cached: 0, not counted per request),
``output_tokens`` (reasoning tokens: 0, not counted apart).
"""

from __future__ import annotations

import hashlib
from typing import Any


def item_id(kind: str, response_id: str, index: int) -> str:
    """Deterministic id of output item ``index`` of a response: ``msg_``, ``fc_``, ``rs_``."""
    return f"{kind}_{hashlib.sha256(f'{response_id}/{index}'.encode()).hexdigest()[:32]}"


class OutputBuilder:
    """A response's output items from chat deltas, with the events that stream them."""

    def __init__(self, response_id: str) -> None:
        self.response_id = response_id
        self.items: list[dict[str, Any]] = []
        self._open: str | None = None  # kind of the last item while it can still grow
        self._calls: dict[int, int] = {}  # chat call index -> output index
        self.events: list[dict[str, Any]] = []

    def delta(self, delta: dict[str, Any], logprobs: list[dict[str, Any]] | None = None) -> None:
        """One chat delta (``content``, ``reasoning_content``, ``tool_calls``) and its log-probs."""
        if delta.get("reasoning_content"):
            self._text("reasoning", delta["reasoning_content"], None)
        if delta.get("content"):
            self._text("message", delta["content"], logprobs or [])
        for call in delta.get("tool_calls") or []:
            self._call(call)

    def finish(self, complete: bool) -> None:
        """Close the item still open (``incomplete`` when the token limit cut the reply)."""
        self._close("completed" if complete else "incomplete")

    # -- items --------------------------------------------------------------------------------
    def _text(self, kind: str, text: str, logprobs: list[dict[str, Any]] | None) -> None:
        if self._open != kind:
            self._close("completed")
            self._add(self._new_text_item(kind))
        index, item = len(self.items) - 1, self.items[-1]
        part = item["content"][0]
        part["text"] += text
        event = "response.output_text.delta" if kind == "message" else "response.reasoning_text.delta"
        extra = {}
        if logprobs is not None:
            part["logprobs"] += logprobs
            extra = {"logprobs": logprobs}
        self._emit(event, item_id=item["id"], output_index=index, content_index=0, delta=text, **extra)

    def _new_text_item(self, kind: str) -> dict[str, Any]:
        index = len(self.items)
        if kind == "reasoning":
            return {"id": item_id("rs", self.response_id, index), "type": "reasoning", "summary": [],
                    "content": [{"type": "reasoning_text", "text": ""}], "status": "in_progress"}
        return {"id": item_id("msg", self.response_id, index), "type": "message", "role": "assistant",
                "status": "in_progress", "content": [{"type": "output_text", "text": "", "annotations": [],
                                                      "logprobs": []}]}

    def _call(self, call: dict[str, Any]) -> None:
        fn = call.get("function") or {}
        if call.get("id") is not None:  # a call's first delta: a new item
            self._close("completed")
            self._calls[call["index"]] = len(self.items)
            self._add({"id": item_id("fc", self.response_id, len(self.items)), "type": "function_call",
                       "call_id": call["id"], "name": fn.get("name", ""), "arguments": "", "status": "in_progress"})
        index = self._calls[call["index"]]
        item = self.items[index]
        if fn.get("arguments"):
            item["arguments"] += fn["arguments"]
            self._emit("response.function_call_arguments.delta", item_id=item["id"], output_index=index,
                       delta=fn["arguments"])

    def _add(self, item: dict[str, Any]) -> None:
        self.items.append(item)
        self._open = "call" if item["type"] == "function_call" else item["type"]
        index = len(self.items) - 1
        self._emit("response.output_item.added", output_index=index, item=_snapshot(item))
        if item["type"] != "function_call":
            self._emit("response.content_part.added", item_id=item["id"], output_index=index, content_index=0,
                       part=_snapshot(item["content"][0]))

    def _close(self, status: str) -> None:
        if self._open is None:
            return
        index, item = len(self.items) - 1, self.items[-1]
        if item["type"] == "function_call":
            self._emit("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                       name=item["name"], arguments=item["arguments"])
        else:
            part = item["content"][0]
            done = "response.output_text.done" if item["type"] == "message" else "response.reasoning_text.done"
            extra = {"logprobs": part["logprobs"]} if item["type"] == "message" else {}
            self._emit(done, item_id=item["id"], output_index=index, content_index=0, text=part["text"], **extra)
            self._emit("response.content_part.done", item_id=item["id"], output_index=index, content_index=0,
                       part=_snapshot(part))
        item["status"] = status
        self._emit("response.output_item.done", output_index=index, item=_snapshot(item))
        self._open = None

    def _emit(self, kind: str, **fields: Any) -> None:
        self.events.append({"type": kind, **fields})

    def reply_message(self) -> dict[str, Any]:
        """The reply as the chat assistant message a chained request's history holds (the items
        add up to it: reasoning, content, calls)."""
        message: dict[str, Any] = {"role": "assistant", "content": None}
        for item in self.items:
            if item["type"] == "function_call":
                message.setdefault("tool_calls", []).append({"id": item["call_id"], "type": "function", "function": {
                    "name": item["name"], "arguments": item["arguments"]}})
            else:
                key = "content" if item["type"] == "message" else "reasoning_content"
                message[key] = (message.get(key) or "") + item["content"][0]["text"]
        return message

    def take_events(self) -> list[dict[str, Any]]:
        out, self.events = self.events, []
        return out


def _snapshot(obj: dict[str, Any]) -> dict[str, Any]:
    """A copy as it stands now (the item keeps growing after its ``added`` event is sent)."""
    out = {}
    for k, v in obj.items():
        out[k] = [(_snapshot(x) if isinstance(x, dict) else x) for x in v] if isinstance(v, list) else v
    return out


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, Any]:
    return {"input_tokens": prompt_tokens, "input_tokens_details": {"cached_tokens": 0},
            "output_tokens": completion_tokens, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": prompt_tokens + completion_tokens}
