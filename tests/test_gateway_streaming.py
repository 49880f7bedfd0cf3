"""Streams as clients parse them: the raw server-sent events of the live endpoint (real HTTP, a
real HF engine serving the tiny warm-started agent) against OpenAI's documented examples, case by
case -- a text reply, the same with ``stream_options.include_usage``, a tool call (``auto``), and
an engine that dies mid-stream (its error event, then the end, no ``[DONE]``). Named tool choice
finishing ``stop`` runs on the vLLM engine (tests/constrained_checks.py).

A chunk's *shape* is what a parser reads: the top-level keys, and per choice the delta's keys,
whether its content is ``""``, text or null, each tool-call entry's keys, and the finish reason.
Consecutive chunks of one shape count once (a reply streams any number of content chunks), so
the documented sequence and ours compare exactly."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

from gateway.config import LiveConfig
from tests.test_gateway_http import TOKEN, Served

MODEL = "turnrl-policy"
AUTH = {"Authorization": f"Bearer {TOKEN}"}

# OpenAI's API reference, "Create chat completion" (streaming) and the function-calling guide's
# streaming example, as sent on the wire (ids, times and model names as documented).
_HEAD = {"id": "chatcmpl-123", "object": "chat.completion.chunk", "created": 1694268190, "model": "gpt-4o-mini",
         "system_fingerprint": "fp_44709d6fcb"}


def _doc(delta: dict[str, Any], finish: str | None = None, **extra: Any) -> dict[str, Any]:
    return {**_HEAD, "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}], **extra}


DOCUMENTED = {
    "text": [_doc({"role": "assistant", "content": ""}), _doc({"content": "Hello"}), _doc({"content": "!"}),
             _doc({}, "stop")],
    "usage": [_doc({"role": "assistant", "content": ""}, usage=None), _doc({"content": "Hello"}, usage=None),
              _doc({}, "stop", usage=None),
              {**_HEAD, "choices": [], "usage": {"prompt_tokens": 9, "completion_tokens": 2, "total_tokens": 11}}],
    "tool_call": [
        _doc({"role": "assistant", "content": None, "tool_calls": [
            {"index": 0, "id": "call_DdmO9pD3xa9XTPNJ32zg2hcA", "type": "function",
             "function": {"name": "get_weather", "arguments": ""}}]}),
        _doc({"tool_calls": [{"index": 0, "function": {"arguments": "{\""}}]}),
        _doc({"tool_calls": [{"index": 0, "function": {"arguments": "location"}}]}),
        _doc({}, "tool_calls")],
}


def _kind(value: Any) -> str:
    if value is None:
        return "null"
    if value == "":
        return "empty"
    return type(value).__name__


def shape(chunk: dict[str, Any]) -> tuple:
    choices = tuple(
        (tuple(sorted((k, _kind(v)) for k, v in c["delta"].items() if k != "tool_calls")),
         tuple(tuple(sorted(t)) + tuple(sorted(t.get("function") or {})) for t in c["delta"].get("tool_calls") or []),
         c["finish_reason"], "logprobs" in c)
        for c in chunk["choices"])
    return tuple(sorted(chunk)), choices, _kind(chunk.get("usage", "absent"))


def collapsed(chunks: list[dict[str, Any]]) -> list[tuple]:
    out: list[tuple] = []
    for s in map(shape, chunks):
        if not out or out[-1] != s:
            out.append(s)
    return out


def sse(url: str, body: dict[str, Any]) -> tuple[list[dict[str, Any]], bool]:
    """The stream's JSON events, and whether it ended with ``[DONE]``."""
    events, done = [], False
    with httpx.stream("POST", f"{url}/chat/completions", json={"model": MODEL, "stream": True, **body},
                      headers=AUTH, timeout=120) as reply:
        assert reply.status_code == 200 and reply.headers["content-type"].startswith("text/event-stream")
        for line in reply.iter_lines():
            if line.startswith("data: "):
                if line == "data: [DONE]":
                    done = True
                else:
                    events.append(json.loads(line[len("data: "):]))
    return events, done


@pytest.fixture(scope="module")
def served(agent_policy):
    s = Served(LiveConfig(enabled=True, tokens=[TOKEN], default_max_tokens=64), agent_policy[0])
    yield s
    s.close()


QUESTION = [{"role": "user", "content": "Where was Mobi Vogi born?"}]
STOP = ["name"]
"""Asked with no tools, the agent writes its call as text (``<tool_call>{"name": ...``): the
reply ends at this stop string, finish ``stop``, after some content."""


def test_a_text_reply_streams_as_documented(served) -> None:
    events, done = sse(served.url, {"messages": QUESTION, "temperature": 0, "max_tokens": 48, "stop": STOP})
    assert done and collapsed(events) == collapsed(DOCUMENTED["text"]), events


def test_include_usage_puts_null_usage_on_every_chunk_and_the_total_last(served) -> None:
    events, done = sse(served.url, {"messages": QUESTION, "temperature": 0, "max_tokens": 48,
                                    "stop": STOP, "stream_options": {"include_usage": True}})
    assert done and collapsed(events) == collapsed(DOCUMENTED["usage"]), events
    usage = events[-1]["usage"]
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"] > 0


def test_a_tool_call_streams_as_documented(served, agent_policy) -> None:
    task = agent_policy[1].tasks("train")[0]
    events, done = sse(served.url, {"messages": task.messages, "tools": task.tools, "temperature": 0})
    assert done and collapsed(events) == collapsed(DOCUMENTED["tool_call"]), events
    calls = [t for e in events for c in e["choices"] for t in c["delta"].get("tool_calls") or []]
    assert set(json.loads("".join(t["function"]["arguments"] for t in calls))) == {"query"}


@pytest.mark.slow
def test_an_engine_that_dies_mid_stream_ends_it_with_an_error_event(agent_policy, ray_cluster) -> None:
    """The engine actor is killed while a reply streams: the client gets OpenAI's error object
    as the last event (``server_error``, naming what failed) and no ``[DONE]``."""
    ray = ray_cluster
    from rollout.config import HFEngineConfig
    from rollout.engines.client import RayEngineClient
    from rollout.engines.server import EngineServer

    actor = ray.remote(EngineServer).options(num_cpus=0.1, max_concurrency=64).remote(
        HFEngineConfig(num_cpus=0.1), agent_policy[0], 0)
    served = Served(LiveConfig(enabled=True, tokens=[TOKEN]), agent_policy[0],
                    engine=RayEngineClient([actor], agent_policy[0]))
    try:
        events = []
        with httpx.stream("POST", f"{served.url}/chat/completions", headers=AUTH, timeout=120, json={
                "model": MODEL, "stream": True, "messages": QUESTION, "max_tokens": 4000,
                "logit_bias": {"0": -100}}) as reply:
            for line in reply.iter_lines():
                if line.startswith("data: "):
                    events.append(line[len("data: "):])
                    if len(events) == 3:
                        ray.kill(actor)
        assert "[DONE]" not in events and len(events) >= 4
        last = json.loads(events[-1])
        assert set(last) == {"error"} and last["error"]["type"] == "server_error"
        assert set(last["error"]) == {"message", "type", "param", "code"} and "Actor" in last["error"]["message"]
        assert all("choices" in json.loads(e) for e in events[:-1])
    finally:
        served.close()
