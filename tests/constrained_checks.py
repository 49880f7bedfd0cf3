"""Constrained decoding and stop strings through a run's live endpoint, for the end-to-end run
tests (tests/test_live_e2e.py) on each engine: they reuse its run rather than start an engine
of their own. On the vLLM engine ``tool_choice`` required / named, ``response_format``
json_schema and the structured-output paths of pydantic-ai (``output_type``) and LangChain
(``with_structured_output``) must give replies that parse and validate, recorded token-exact and
marked constrained; on the HF engine each is a 400 naming the parameter. Stop strings of several
tokens, ``logit_bias``, penalties, ``top_logprobs`` and ``parallel_tool_calls: false`` work on
both, bias and penalties marked as reshaping the distribution sampled."""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import openai
from pydantic import BaseModel, Field

MODEL = "turnrl-policy"


def _tool(name: str, arg: str) -> dict[str, Any]:
    # maxLength: a tiny model would otherwise write its string until max_tokens
    return {"type": "function", "function": {"name": name, "description": f"The {name} tool.", "parameters": {
        "type": "object", "properties": {arg: {"type": "string", "maxLength": 16}}, "required": [arg],
        "additionalProperties": False}}}


SEARCH, FINAL = _tool("search", "query"), _tool("final_answer", "answer")
SCHEMAS = {"search": SEARCH["function"]["parameters"], "final_answer": FINAL["function"]["parameters"]}
CITY = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 16}, "found": {"type": "boolean"}},
        "required": ["city", "found"], "additionalProperties": False}
FORCED = "100"
"""A token id the tiny tokenizer has; ``logit_bias`` +100 makes it every token written."""
STOP = "<tool_call>"
"""Several tokens of the tiny tokenizer; the agent writes it first when asked a question."""


class Answer(BaseModel):
    city: str = Field(max_length=16)


def _call(client: openai.OpenAI, sid: str, messages: list[dict], max_tokens: int = 128, **kw: Any) -> Any:
    return client.chat.completions.create(model=MODEL, messages=messages, seed=0, max_tokens=max_tokens,
                                          extra_headers={"X-Session-Id": sid}, **kw)


def _valid_call(call: Any) -> dict[str, Any]:
    args = json.loads(call.function.arguments)
    jsonschema.validate(args, SCHEMAS[call.function.name])
    return args


def served_checks(base: str, engine: str, messages: list[dict]) -> dict[str, Any]:
    """Drive the endpoint; returns what each constrained session was served, by session id."""
    client = openai.OpenAI(base_url=base, api_key="none", max_retries=0, timeout=120)
    stopped = _call(client, "c-stop", messages, tools=[SEARCH], stop=["Katu", STOP]).choices[0]
    assert stopped.finish_reason == "stop" and STOP not in (stopped.message.content or "")
    assert not stopped.message.tool_calls  # the call's tag was never finished
    _sampler_checks(client, messages)
    if engine != "vllm":
        for kw, param in [({"tools": [SEARCH], "tool_choice": "required"}, "tool_choice"),
                          ({"response_format": {"type": "json_schema", "json_schema": {"name": "c", "schema": CITY}}},
                           "response_format")]:
            try:
                _call(client, "c-refused", messages, **kw)
                raise AssertionError(f"{param} was not refused")
            except openai.BadRequestError as err:
                assert err.body["param"] == param and "vllm" in err.body["message"]
        return {}
    served: dict[str, Any] = {}
    first = _call(client, "c-req", messages, tools=[SEARCH, FINAL], tool_choice="required").choices[0]
    [call] = first.message.tool_calls
    assert first.finish_reason == "tool_calls" and call.id.startswith("call_")
    _valid_call(call)
    served["c-req"] = [(call.function.name, call.function.arguments)]
    # the client sends the call back with its result: the session goes on in token space
    follow = [*messages, first.message.model_dump(exclude_none=True),
              {"role": "tool", "tool_call_id": call.id, "content": "Mobi Vogi was born in Katu."}]
    _call(client, "c-req", follow, tools=[SEARCH, FINAL])
    named = _call(client, "c-named", messages, tools=[SEARCH, FINAL],
                  tool_choice={"type": "function", "function": {"name": "final_answer"}}).choices[0]
    assert [c.function.name for c in named.message.tool_calls] == ["final_answer"]
    assert named.finish_reason == "stop"  # a call the request named finishes stop, as OpenAI's does
    _valid_call(named.message.tool_calls[0])
    named_stream = [c for c in _call(client, "c-named-stream", messages, tools=[SEARCH, FINAL], stream=True,
                                     tool_choice={"type": "function", "function": {"name": "search"}}) if c.choices]
    assert named_stream[0].choices[0].delta.role == "assistant" and named_stream[0].choices[0].delta.tool_calls
    assert named_stream[-1].choices[0].finish_reason == "stop"
    fmt = {"type": "json_schema", "json_schema": {"name": "city", "schema": CITY, "strict": True}}
    content = _call(client, "c-json", messages, response_format=fmt).choices[0].message.content
    jsonschema.validate(json.loads(content), CITY)
    chunks = [c for c in _call(client, "c-stream", messages, tools=[SEARCH], tool_choice="required", stream=True)
              if c.choices]
    deltas = [d for c in chunks for d in c.choices[0].delta.tool_calls or []]
    assert deltas[0].function.name == "search" and chunks[-1].choices[0].finish_reason == "tool_calls"
    jsonschema.validate(json.loads("".join(d.function.arguments or "" for d in deltas)), SCHEMAS["search"])
    _framework_structured_outputs(base, messages[-1]["content"])
    return served


def _sampler_checks(client: openai.OpenAI, messages: list[dict]) -> None:
    """Bias forcing one token (its log-prob 0, the alternatives led by it), penalties, and one
    call at most, served; their recordings are checked in ``recorded_checks``."""
    forced = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=3, logit_bias={FORCED: 100},
                                            logprobs=True, top_logprobs=2, extra_headers={"X-Session-Id": "c-bias"})
    for entry in forced.choices[0].logprobs.content:
        assert entry.logprob > -1e-3 and len(entry.top_logprobs) == 2
        assert entry.top_logprobs[0].token == entry.token and entry.top_logprobs[1].logprob < -10
    _call(client, "c-pen", messages, temperature=0, max_tokens=16, frequency_penalty=2.0, presence_penalty=1.0)
    one = _call(client, "c-one", messages, tools=[SEARCH], temperature=0, parallel_tool_calls=False).choices[0]
    assert one.finish_reason == "tool_calls" and len(one.message.tool_calls) == 1


def _framework_structured_outputs(base: str, question: str) -> None:
    """Two frameworks' default structured-output paths: pydantic-ai's ``output_type`` (an output
    tool with ``tool_choice: required``, strict) and LangChain's ``with_structured_output``
    (``response_format`` json_schema, strict)."""
    from langchain_openai import ChatOpenAI
    from openai import AsyncOpenAI
    from pydantic_ai import Agent
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider

    client = AsyncOpenAI(base_url=base, api_key="none", max_retries=0, default_headers={"X-Session-Id": "c-pyd"})
    agent = Agent(OpenAIChatModel(MODEL, provider=OpenAIProvider(openai_client=client)), output_type=Answer,
                  model_settings={"seed": 0, "max_tokens": 128})
    assert isinstance(agent.run_sync(question).output, Answer)
    llm = ChatOpenAI(model=MODEL, base_url=base, api_key="none", max_retries=0, seed=0, max_tokens=128,
                     default_headers={"X-Session-Id": "c-lc"})
    assert isinstance(llm.with_structured_output(Answer).invoke(question), Answer)


def recorded_checks(rows: list[dict], served: dict[str, Any], tokenizer: Any, engine: str) -> None:
    """The run's record of these sessions: constrained turns marked, and token-exact."""
    from gateway.responses import cut_at_stop
    from gateway.toolcalls import split_action
    from rollout.trajectory import Trajectory

    trajs = {r["trajectory"]["live"]["session_id"]: Trajectory.model_validate(r["trajectory"]) for r in rows}
    # recorded through the token that completed the stop string, not past it
    ids = list(trajs["c-stop"].turns[0].action_ids)
    assert [cut_at_stop(tokenizer.decode(ids[:k], skip_special_tokens=True), ["Katu", STOP])[1]
            for k in (len(ids) - 1, len(ids))] == [False, True]
    assert trajs["c-stop"].live.ended_early == {0: "stop"}
    assert list(trajs["c-bias"].turns[0].action_ids) == [int(FORCED)] * 3
    assert trajs["c-bias"].live.constrained == {0: "logit_bias"} and trajs["c-pen"].live.constrained == {0: "penalties"}
    one = trajs["c-one"]
    assert one.live.ended_early == {0: "first_tool_call"} and one.live.constrained == {}
    assert tokenizer.decode(list(one.turns[0].action_ids)).rstrip().endswith("</tool_call>")
    if engine != "vllm":
        assert "c-refused" not in trajs  # a refused request records nothing
        return
    want = {"c-req": {0: "tool_choice_required"}, "c-named": {0: "tool_choice_named"},
            "c-json": {0: "response_format_json_schema"}, "c-stream": {0: "tool_choice_required"},
            "c-stop": {}, "c-lc": {0: "response_format_json_schema"}, "c-bias": {0: "logit_bias"},
            "c-named-stream": {0: "tool_choice_named"}}
    assert {sid: trajs[sid].live.constrained for sid in want} == want
    assert trajs["c-pyd"].live.constrained[0] == "tool_choice_required"
    req = trajs["c-req"]  # the call went back and the session went on in one segment, unconstrained
    assert len(req.turns) == 2 and set(req.live.constrained) == {0}
    reply = split_action(tokenizer.decode(list(req.turns[0].action_ids), skip_special_tokens=True), "any", 0)
    assert reply.wire == served["c-req"]
