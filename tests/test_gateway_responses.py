"""The Responses API (``POST /v1/responses``) over real HTTP with the official SDK, on a real HF
engine serving the tiny warm-started agent: a tool call, its output sent back by
``previous_response_id`` or as the whole conversation, recorded as one token-exact session;
streamed events in OpenAI's order and shapes (the SDK's own event types parse them) that add up
to the non-streamed response; every request field the SDK documents classified; bad input named."""

from __future__ import annotations

import httpx
import openai
import pytest
from openai.types.responses.response_create_params import ResponseCreateParamsBase

from gateway.config import LiveConfig
from gateway.responses_wire import NO_EFFECT, REFUSED, ResponsesRequest
from tests.test_gateway_http import TOKEN, Served, _sdk

MODEL = "turnrl-policy"
RESULT = "Mobi Vogi was born in Katu."


@pytest.fixture(scope="module")
def served(agent_policy):
    s = Served(LiveConfig(enabled=True, tokens=[TOKEN], default_max_tokens=64, max_kept_responses=50),
               agent_policy[0])
    yield s
    s.close()


@pytest.fixture(scope="module")
def client(served) -> openai.OpenAI:
    return _sdk(served)


@pytest.fixture(scope="module")
def task(agent_policy):
    task = agent_policy[1].tasks("train")[0]
    tools = [{"type": "function", **t["function"]} for t in task.tools]
    return task, tools


def _input(task) -> list[dict]:
    return [{"role": m["role"], "content": m["content"]} for m in task.messages]


def _segments(served, sid: str):
    return served.gateway.service.recorder.segments(sid)


def test_every_documented_field_is_classified() -> None:
    documented = set(ResponseCreateParamsBase.__annotations__) | {"stream"}
    assert documented == set(ResponsesRequest.model_fields) | set(REFUSED)
    assert set(NO_EFFECT) <= set(ResponsesRequest.model_fields)


def test_a_call_and_its_output_chained_by_previous_response_id_are_one_exact_session(served, client, task) -> None:
    task, tools = task
    first = client.responses.create(model=MODEL, input=_input(task), tools=tools, temperature=0,
                                    extra_headers={"X-Session-Id": "r-chain"})
    [call] = [item for item in first.output if item.type == "function_call"]
    assert first.status == "completed" and call.name == "search" and call.call_id.startswith("call_")
    assert first.usage.input_tokens > 0 and first.usage.output_tokens > 0
    second = client.responses.create(model=MODEL, previous_response_id=first.id, tools=tools, temperature=0,
                                     max_output_tokens=16,
                                     input=[{"type": "function_call_output", "call_id": call.call_id, "output": RESULT}])
    assert second.previous_response_id == first.id and second.output_text
    [seg] = _segments(served, "r-chain")  # the chain is the header's session, stitched in token space
    traj = seg.trajectory
    assert len(traj.turns) == 2 and traj.live.ended_early == {}
    tok = served.gateway.service.engine.tokenizer
    assert "Katu" in tok.decode(traj.turns[0].observation_ids)
    assert tok.decode(traj.turns[1].action_ids, skip_special_tokens=True).strip() == second.output_text
    # a chain without the header is the chained response's session
    third = client.responses.create(model=MODEL, previous_response_id=second.id, input="Thanks. And Tala Renn?",
                                    tools=tools, temperature=0)
    assert len(_segments(served, "r-chain")[-1].trajectory.turns) == 3 and third.id != second.id
    assert client.responses.retrieve(second.id).output_text == second.output_text


def test_the_whole_conversation_sent_again_stitches_as_chat_sessions_do(served, client, task) -> None:
    task, tools = task
    headers = {"X-Session-Id": "r-full"}
    first = client.responses.create(model=MODEL, input=_input(task), tools=tools, temperature=0, extra_headers=headers)
    call = next(item for item in first.output if item.type == "function_call")
    items = [*_input(task), *[o.model_dump(exclude_none=True) for o in first.output],
             {"type": "function_call_output", "call_id": call.call_id, "output": RESULT}]
    client.responses.create(model=MODEL, input=items, tools=tools, temperature=0, max_output_tokens=16,
                            extra_headers=headers)
    [seg] = _segments(served, "r-full")
    assert len(seg.trajectory.turns) == 2


def test_streamed_events_follow_openais_order_and_add_up_to_the_response(served, client, task) -> None:
    task, tools = task
    whole = client.responses.create(model=MODEL, input=_input(task), tools=tools, temperature=0)
    events = list(client.responses.create(model=MODEL, input=_input(task), tools=tools, temperature=0, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    final = events[-1].response
    assert [_strip(o) for o in final.output] == [_strip(o) for o in whole.output]
    for index, item in enumerate(final.output):
        mine = [e for e in events if getattr(e, "output_index", None) == index]
        assert mine[0].type == "response.output_item.added" and mine[-1].type == "response.output_item.done"
        if item.type == "function_call":
            deltas = "".join(e.delta for e in mine if e.type == "response.function_call_arguments.delta")
            done = next(e for e in mine if e.type == "response.function_call_arguments.done")
            assert deltas == done.arguments == item.arguments and mine[0].item.call_id == item.call_id
        else:
            text = "".join(e.delta for e in mine if e.type == "response.output_text.delta")
            assert [e.type for e in mine[:2]] == ["response.output_item.added", "response.content_part.added"]
            assert text == item.content[0].text
    assert final.usage.output_tokens == whole.usage.output_tokens


def _strip(item) -> dict:
    """An output item without its ids (two responses, same content)."""
    return item.model_dump(exclude={"id", "call_id"})


def test_a_cut_reply_is_incomplete_and_logprobs_come_when_included(client) -> None:
    cut = client.responses.create(model=MODEL, input="Where was Mobi Vogi born?", max_output_tokens=3,
                                  include=["message.output_text.logprobs"], top_logprobs=2, temperature=0)
    assert cut.status == "incomplete" and cut.incomplete_details.reason == "max_output_tokens"
    [message] = cut.output
    lps = message.content[0].logprobs
    assert len(lps) == 3 and all(len(e.top_logprobs) == 2 for e in lps)
    events = list(client.responses.create(model=MODEL, input="Where was Mobi Vogi born?", max_output_tokens=3,
                                          temperature=0, stream=True))
    assert events[-1].type == "response.incomplete" and events[-1].response.status == "incomplete"


@pytest.mark.parametrize("extra, param", [
    ({"frobnicate": 1}, "frobnicate"),
    ({"conversation": "conv_1"}, "conversation"),
    ({"background": True}, "background"),
    ({"prompt": {"id": "pmpt_1"}}, "prompt"),
    ({"input": [{"type": "web_search_call", "id": "ws_1", "status": "completed"}]}, "input.0.type"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input.0.type"),
    ({"tools": [{"type": "web_search"}]}, "tools.0.type"),
    ({"tools": [{"type": "function", "name": "s", "strict": True}]}, "tools.0.strict"),
    ({"text": {"format": {"type": "json_object"}}}, "text.format"),
    ({"input": [{"role": "tool", "content": "x"}]}, "input.0"),
    ({"previous_response_id": "resp_nope"}, "previous_response_id"),
    ({"max_output_tokens": 100000}, "input"),
    ({"temperature": 3}, "temperature"),
])
def test_bad_requests_are_400s_naming_the_responses_field(served, extra, param) -> None:
    body = {"model": MODEL, "input": "hi", **extra}
    reply = httpx.post(f"{served.url}/responses", json=body, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=60)
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"]["param"] == param


def test_store_false_is_neither_retrievable_nor_chainable(client) -> None:
    gone = client.responses.create(model=MODEL, input="hi", store=False, max_output_tokens=4)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(gone.id)
    with pytest.raises(openai.BadRequestError) as err:
        client.responses.create(model=MODEL, input="again", previous_response_id=gone.id, max_output_tokens=4)
    assert err.value.body["param"] == "previous_response_id"
