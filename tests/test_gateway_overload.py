"""Overload answered cleanly (real HTTP, the official SDK, a real HF engine serving the tiny
agent): past ``live.max_concurrent`` requests, or a token's ``max_concurrent_per_token`` share,
the gateway answers 429 at once with ``Retry-After`` in OpenAI's rate-limit shape (the SDK raises
``RateLimitError``), serves the rest, and takes requests again as slots free; a client that stops
reading a stream does not hold the engine: its request is aborted within the stall timeout."""

from __future__ import annotations

import asyncio
import json
import socket
import time

import httpx
import openai
import pytest

from gateway.config import LiveConfig
from tests.test_gateway_http import Served

MODEL = "turnrl-policy"
TOKENS = ["tok-a", "tok-b"]
QUESTION = [{"role": "user", "content": "Where was Mobi Vogi born?"}]


@pytest.fixture(scope="module")
def served(agent_policy):
    cfg = LiveConfig(enabled=True, tokens=TOKENS, max_concurrent=3, max_concurrent_per_token=2, retry_after_s=3,
                     stream_stall_timeout_s=1.0, max_context_tokens=2048)
    s = Served(cfg, agent_policy[0])
    yield s
    s.close()


def _no_end(served) -> dict[str, int]:
    """A logit bias banning end-of-turn: a reply runs to ``max_tokens``."""
    return {str(served.gateway.service.engine.tokenizer.eos_token_id): -100}


async def _streams(url: str, token: str, n: int, max_tokens: int, bias: dict[str, int]) -> list[int | str]:
    """``n`` streams at once; each one's status, or the error body's code."""
    async with httpx.AsyncClient(timeout=120) as http:
        async def one() -> int | str:
            body = {"model": MODEL, "messages": QUESTION, "stream": True, "max_tokens": max_tokens,
                    "logit_bias": bias}
            async with http.stream("POST", f"{url}/chat/completions", json=body,
                                   headers={"Authorization": f"Bearer {token}"}) as reply:
                if reply.status_code != 200:
                    await reply.aread()
                    assert reply.headers["retry-after"] == "3"
                    error = reply.json()["error"]
                    assert set(error) == {"message", "type", "param", "code"}
                    return error["code"]
                async for _ in reply.aiter_lines():
                    pass
                return reply.status_code
        return list(await asyncio.gather(*[one() for _ in range(n)]))


def _idle(served) -> None:
    """Until every slot is given back (a stream's slot goes once its last byte is sent)."""
    deadline = time.monotonic() + 10
    while served.gateway.service.admission.busy:
        assert time.monotonic() < deadline
        time.sleep(0.05)


def test_past_the_limits_requests_get_429_at_once_and_the_rest_are_served(served) -> None:
    t0 = time.monotonic()
    got = asyncio.run(_streams(served.url, TOKENS[0], 4, 400, _no_end(served)))
    assert sorted(map(str, got)) == ["200", "200", "rate_limit_exceeded", "rate_limit_exceeded"]  # the token's 2
    assert time.monotonic() - t0 < 60
    _idle(served)
    refused = served.gateway.service.admission.refused

    async def both() -> list[list[int | str]]:
        return list(await asyncio.gather(_streams(served.url, TOKENS[0], 2, 400, _no_end(served)),
                                         _streams(served.url, TOKENS[1], 2, 400, _no_end(served))))
    a, b = asyncio.run(both())  # 4 at once over 2 tokens, 3 slots in all: one is refused
    assert sorted(map(str, a + b)).count("rate_limit_exceeded") == 1 and (a + b).count(200) == 3
    _idle(served)
    assert served.gateway.service.admission.refused == refused + 1
    client = openai.OpenAI(base_url=served.url, api_key=TOKENS[1], max_retries=0)
    reply = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=4)  # slots free again
    assert reply.choices[0].message.role == "assistant"


def _stall_once(served) -> bool:
    """One stream whose client reads nothing; returns whether its engine request was aborted
    (True) or had already ended when the stall was counted (False: the engine decoded all of it
    while the socket buffers were still taking chunks, which a loaded machine's timing allows)."""
    engine = served.gateway.service.engine.engine
    aborted, stalled = engine.stats()["aborted"], served.gateway.stats()["episodes"]["client_stalled"]
    host, port = served.url.split("//")[1].split("/")[0].split(":")
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1024)  # before connecting: a small window
    sock.connect((host, int(port)))
    # ~3 KB a chunk (20 alternatives per token) for 1900 tokens: more than the socket buffers hold
    body = ('{"model": "%s", "stream": true, "max_tokens": 1900, "logit_bias": %s, "logprobs": true, '
            '"top_logprobs": 20, "messages": [{"role": "user", "content": "Where was Mobi Vogi born?"}]}'
            % (MODEL, json.dumps(_no_end(served)))).encode()
    sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + TOKENS[1].encode() +
                 b"\r\nContent-Type: application/json\r\nContent-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
    try:  # ... and read nothing
        deadline = time.monotonic() + 60
        while served.gateway.stats()["episodes"]["client_stalled"] == stalled:
            assert time.monotonic() < deadline, "the stalled stream was never ended"
            time.sleep(0.2)
        # the abort lands at the engine's next decoding step, after the stall was counted
        while engine.stats()["open_requests"]:
            assert time.monotonic() < deadline, f"the stalled request still runs: {engine.stats()}"
            time.sleep(0.1)
        assert engine.stats()["aborted"] - aborted in (0, 1)
        return engine.stats()["aborted"] == aborted + 1
    finally:
        sock.close()


def test_a_client_that_stops_reading_does_not_hold_the_engine(served) -> None:
    # Every try ends the stalled stream with no engine request left open; at least one of three
    # must end it while the engine still decodes it, so that its abort (the row freed) is seen.
    assert any(_stall_once(served) for _ in range(3)), "the engine finished every stalled request before its abort"
