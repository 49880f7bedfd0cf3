"""The OpenAI wire format: strict requests, responses the official SDK parses, tool calls
between Hermes text and OpenAI's shape. Tiny tokenizer, hand-built token sequences."""

from __future__ import annotations

import json
import time

import openai.types
import pytest
from openai.types.chat import ChatCompletion as SDKCompletion
from openai.types.chat import ChatCompletionChunk as SDKChunk
from pydantic import BaseModel

from envs.toolcalls import ToolCall
from gateway.errors import InvalidRequest
from gateway.openai_types import ChatCompletionChunk, ModelCard, ModelList, parse_chat_request
from gateway.responses import ChoiceStream, FirstCallWatch, StopWatch, chat_completion, cut_at_stop
from gateway.toolcalls import split_action, template_messages, tool_call_id
from gateway_fixtures import CALL_TEXT, TOOLS, Sampled, tiny_tokenizer

USER = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return tiny_tokenizer(tmp_path_factory.mktemp("tok"))


@pytest.mark.parametrize("extra, param", [
    ({"foo": 1}, "foo"),
    ({"response_format": {"type": "yaml"}}, "response_format.type"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
    ({"logit_bias": {"five": 1}}, "logit_bias.five"),
    ({"logit_bias": {"5": 101}}, "logit_bias.5"),
    ({"logit_bias": {"5": "up"}}, "logit_bias"),
    ({"audio": {"voice": "alloy", "format": "mp3"}}, "audio"),
    ({"functions": [{"name": "search"}]}, "functions"),
    ({"function_call": "auto"}, "function_call"),
    ({"web_search_options": {}}, "web_search_options"),
    ({"moderation": {"model": "omni-moderation-latest"}}, "moderation"),
    ({"modalities": ["text", "audio"]}, "modalities.1"),
    ({"reasoning_effort": "extreme"}, "reasoning_effort"),
    ({"service_tier": "gold"}, "service_tier"),
    ({"store": True}, "store"),
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"top_logprobs": 2}, "top_logprobs"),
    ({"tool_choice": "any"}, "tool_choice"),
    ({"tool_choice": {"type": "function", "function": {"nam": "search"}}}, "tool_choice"),
    ({"stop": ["a", ""]}, "stop.1"),
    ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"frequency_penalty": -3}, "frequency_penalty"),
    ({"parallel_tool_calls": "sometimes"}, "parallel_tool_calls"),
    ({"n": 0}, "n"),
    ({"temperature": 2.5}, "temperature"),
    ({"stop": 7}, "stop"),
    ({"max_tokens": 5, "max_completion_tokens": 6}, "max_tokens"),
    ({"stream_options": {"include_usage": True}}, "stream_options"),
    ({"stream": True, "stream_options": {"include_obfuscation": 3}}, "stream_options.include_obfuscation"),
    ({"tools": [{"type": "function", "function": {"name": "s", "strict": 3}}]}, "tools.0.function.strict"),
    ({"messages": [{"role": "user", "content": "hi", "name": 3}]}, "messages.0.name"),
    ({"messages": [{"role": "function", "content": "hi"}]}, "messages.0.role"),
    ({"messages": [{"role": "tool", "content": "Paris"}]}, "messages.0"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     "messages.0.content"),
    ({"messages": []}, "messages"),
])
def test_unknown_or_unsupported_parameters_are_400s_naming_the_parameter(extra, param) -> None:
    with pytest.raises(InvalidRequest) as info:
        parse_chat_request({"messages": USER, **extra})
    err = info.value
    assert err.param == param and err.status == 400
    assert err.body() == {"error": {"message": str(err), "type": "invalid_request_error",
                                    "param": param, "code": None}}


def test_a_full_request_parses_and_neutral_values_are_accepted() -> None:
    req = parse_chat_request({
        "model": "policy", "messages": [{"role": "system", "content": [{"type": "text", "text": "Be brief."}]}, *USER],
        "tools": TOOLS, "tool_choice": "auto", "n": 2, "temperature": 0.7, "top_p": 0.9,
        "max_completion_tokens": 32, "stop": "\n\n", "logprobs": True, "top_logprobs": 0, "stream": True,
        "stream_options": {"include_usage": True}, "user": "u1", "seed": 3,
        "presence_penalty": 0, "frequency_penalty": 0.0, "parallel_tool_calls": True,
        "service_tier": "flex", "prompt_cache_key": "k", "prompt_cache_retention": "24h", "safety_identifier": "s",
        "metadata": {"team": "a"}, "verbosity": "low", "prediction": {"type": "content", "content": "Paris"},
        "modalities": ["text"], "prompt_cache_options": {"mode": "implicit", "ttl": "30m"}, "reasoning_effort": "low",
    })
    assert (req.n, req.max_new_tokens(64), req.stop_list(), req.messages[0].text()) == (2, 32, ["\n\n"], "Be brief.")
    assert req.tool_dicts() == [{"type": "function", "function": {"name": "search",
                                                                  "parameters": {"properties": {"query": {}}}}}]
    none = parse_chat_request({"messages": USER, "tools": TOOLS, "tool_choice": "none"})
    assert none.tool_dicts() == [] and none.max_new_tokens(64) == 64  # tools withheld from the model


def test_model_text_splits_into_content_and_openai_tool_calls() -> None:
    text = "Let me search." + CALL_TEXT
    reply = split_action(text, "chatcmpl-7", 1)
    assert reply.content == "Let me search." and reply.errors == []
    assert reply.calls == [ToolCall(name="search", arguments={"query": "capital of France"})]
    msg = reply.message().wire()
    assert msg == {"role": "assistant", "content": "Let me search.", "tool_calls": [
        {"id": tool_call_id("chatcmpl-7", 1, 0), "type": "function",
         "function": {"name": "search", "arguments": '{"query": "capital of France"}'}}]}
    # Deterministic per completion, choice and call; distinct otherwise.
    assert split_action(text, "chatcmpl-7", 1).ids == reply.ids
    assert len({tool_call_id("chatcmpl-7", 1, 0), tool_call_id("chatcmpl-7", 0, 0), tool_call_id("chatcmpl-8", 1, 0)}) == 3
    assert reply.ids[0].startswith("call_") and len(reply.ids[0]) == 5 + 24


def test_a_malformed_call_marks_the_action_invalid_and_a_nameless_block_stays_in_the_content() -> None:
    bad = '<tool_call>{"name": "search", "arguments": {"query": </tool_call>'
    reply = split_action("Searching. " + bad + CALL_TEXT, "c", 0)
    # A call whose name was written is a call (streamed as soon as its name is); its arguments
    # are the text the model wrote, invalid JSON included, as OpenAI's API allows.
    assert reply.content == "Searching." and reply.wire == [("search", '{"query": '),
                                                            ("search", '{"query": "capital of France"}')]
    assert [c.name for c in reply.calls] == ["search"] and len(reply.errors) == 1
    assert reply.template_message()["tool_calls"][0]["function"]["arguments"] == '{"query": '
    nameless = split_action("Hm <tool_call>oops</tool_call>", "c", 0)
    assert nameless.content == "Hm <tool_call>oops</tool_call>" and nameless.wire == [] and len(nameless.errors) == 1
    open_only = split_action("<tool_call>{\"name\": \"search\"", "c", 0)
    assert open_only.calls == [] and open_only.wire == [("search", "{}")] and open_only.content is None
    assert open_only.errors == ["unterminated <tool_call>: close it with </tool_call>"]
    plain = split_action(CALL_TEXT, "c", 0, tools_enabled=False)  # tool_choice none: all content
    assert plain.content == CALL_TEXT and plain.calls == []


def test_request_messages_become_template_messages_with_parsed_arguments() -> None:
    call = {"id": "call_1", "type": "function", "function": {"name": "search", "arguments": '{"query": "France"}'}}
    req = parse_chat_request({"messages": [*USER, {"role": "assistant", "content": None, "tool_calls": [call],
                                                   "refusal": None},
                                           {"role": "tool", "tool_call_id": "call_1", "content": "Paris"}]})
    assert template_messages(req.messages) == [
        USER[0],
        {"role": "assistant", "content": "",
         "tool_calls": [{"type": "function", "function": {"name": "search", "arguments": {"query": "France"}}}]},
        {"role": "tool", "content": "Paris", "tool_call_id": "call_1"},
    ]
    # Arguments that are not a JSON object stay as sent: the model may have written them so
    # (a client echoes our own malformed call back), and the recorder compares them as text.
    call["function"]["arguments"] = '{"query": '
    req = parse_chat_request({"messages": [*USER, {"role": "assistant", "tool_calls": [call]}]})
    assert template_messages(req.messages)[1]["tool_calls"][0]["function"]["arguments"] == '{"query": '


def _no_extras(model: BaseModel) -> None:
    """The SDK keeps unknown keys as extras: none anywhere means every key we send is OpenAI's."""
    assert not model.model_extra, f"{type(model).__name__} got unknown fields {model.model_extra}"
    for value in model.__dict__.values():
        for item in value if isinstance(value, list) else [value]:
            if isinstance(item, BaseModel):
                _no_extras(item)


def _ids(tok, text: str) -> list[int]:
    return tok(text, add_special_tokens=False)["input_ids"]


def test_the_sdk_parses_a_completion_with_tool_calls_and_logprobs(tok) -> None:
    call_ids = _ids(tok, "Let me search." + CALL_TEXT) + [tok.eos_token_id]
    plain_ids = _ids(tok, "Paris") + [tok.eos_token_id]
    comps = [Sampled(call_ids, [-0.5] * len(call_ids), "stop", [(0, 7)]),
             Sampled(plain_ids, [-0.25, -0.75], "length", [(0, 7)])]
    resp, replies = chat_completion(tok, "chatcmpl-1", "policy", 1700000000, 30, comps, True, True)
    sdk = SDKCompletion.model_validate(json.loads(json.dumps(resp.wire())))
    _no_extras(sdk)
    first, second = sdk.choices
    assert (first.finish_reason, second.finish_reason) == ("tool_calls", "length")
    assert first.message.content == "Let me search." and first.message.tool_calls[0].id == replies[0].ids[0]
    assert json.loads(first.message.tool_calls[0].function.arguments) == {"query": "capital of France"}
    assert len(first.logprobs.content) == len(call_ids) - 1  # the closing end-of-turn has no entry
    assert [e.token for e in second.logprobs.content] == ["Paris"]
    assert second.logprobs.content[0].logprob == -0.25 and second.logprobs.content[0].bytes == list(b"Paris")
    assert second.message.tool_calls is None and second.message.content == "Paris"
    generated = len(call_ids) + 2  # both choices' tokens, end-of-turn included
    assert (sdk.usage.prompt_tokens, sdk.usage.completion_tokens, sdk.usage.total_tokens) == (30, generated, 30 + generated)
    assert sdk.system_fingerprint == "turnrl-v7" and sdk.object == "chat.completion"


def _stream(tok, text: str, tools_enabled: bool, logprobs: bool = False) -> tuple[list[SDKChunk], object]:
    """Push ``text``'s tokens one at a time; every chunk goes through the SDK."""
    token_ids = _ids(tok, text) + [tok.eos_token_id]
    stream = ChoiceStream(tok, "chatcmpl-s", 0, tools_enabled, logprobs)
    choices = []
    for i, tid in enumerate(token_ids):
        choices += stream.push([tid], [-0.1 * (i + 1)])
    closing, reply = stream.finish("stop")
    choices += closing
    chunks = []
    for choice in choices:
        wire = ChatCompletionChunk(id="chatcmpl-s", created=int(time.time()), model="policy", choices=[choice]).wire()
        chunks.append(SDKChunk.model_validate(json.loads(json.dumps(wire))))
        _no_extras(chunks[-1])
    return chunks, reply


def test_streamed_chunks_parse_and_add_up_to_the_message(tok) -> None:
    text = "Let me search." + CALL_TEXT
    chunks, reply = _stream(tok, text, tools_enabled=True)
    deltas = [c.choices[0].delta for c in chunks]
    assert deltas[0].role == "assistant" and all(d.role is None for d in deltas[1:])
    content = "".join(d.content or "" for d in deltas)
    assert content == "Let me search." == reply.content  # no call text leaks into content
    calls = [tc for d in deltas for tc in d.tool_calls or []]
    # The call starts with its index, id and name, then its arguments follow in fragments.
    assert (calls[0].index, calls[0].id, calls[0].function.name) == (0, reply.ids[0], "search")
    assert all(c.index == 0 and c.id is None and c.function.name is None for c in calls[1:]) and len(calls) > 2
    assert "".join(c.function.arguments or "" for c in calls) == '{"query": "capital of France"}'

    assert [c.choices[0].finish_reason for c in chunks][-1] == "tool_calls"
    assert all(c.choices[0].finish_reason is None for c in chunks[:-1])
    # Content streams as it is decoded: more than one content delta before the call.
    assert sum(1 for d in deltas if d.content) > 3


def test_streamed_logprobs_cover_every_token_but_the_end_of_turn(tok) -> None:
    chunks, reply = _stream(tok, "Paris is the capital", tools_enabled=False, logprobs=True)
    entries = [e for c in chunks if c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    n = len(_ids(tok, "Paris is the capital"))
    assert [e.logprob for e in entries] == pytest.approx([-0.1 * (i + 1) for i in range(n)])
    assert "".join(e.token for e in entries) == "Paris is the capital" == reply.content
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_the_model_list_parses_with_the_served_version() -> None:
    body = ModelList(data=[ModelCard(id="policy", created=1700000000, version=12)]).wire()
    sdk = openai.types.Model.model_validate(body["data"][0])
    assert (sdk.id, sdk.object, sdk.owned_by, body["data"][0]["version"]) == ("policy", "model", "turnrl", 12)


def test_stop_strings_of_one_token_are_also_engine_stop_tokens(tok) -> None:
    # every stop string is watched for in the text; one-token ones also stop the engine at once
    req = parse_chat_request({"messages": USER, "stop": ["<|im_end|>", "Paris", "Let me"]})
    assert req.stop_token_ids(tok) == (tok.eos_token_id, _ids(tok, "Paris")[0])  # 'Let me' is Le|t|Ġ|me


def test_a_reply_ends_before_the_first_stop_string_written_and_streams_none_of_it(tok) -> None:
    ids = _ids(tok, "Hello Observation: more")
    watch = StopWatch(tok, ["Observation:", "zz"])
    keep = watch.feed(ids)
    assert tok.decode(ids[:keep]).endswith("Observation:") and not tok.decode(ids[:keep - 1]).endswith("Observation:")
    assert cut_at_stop(tok.decode(ids), ["Observation:", "more"]) == ("Hello ", True)
    comps = [Sampled(ids[:keep], [-0.5] * keep, "stop", [(0, 3)])]
    response, replies = chat_completion(tok, "c1", "m", 0, 4, comps, False, False, stops=["Observation:"])
    assert (response.choices[0].message.content, replies[0].text) == ("Hello ", "Hello Observation:")
    stream = ChoiceStream(tok, "c1", 0, False, False, stops=["Observation:"])
    sent = ""
    for tid in ids[:keep]:
        for c in stream.push([tid], [-0.5]):
            sent += c.delta.content or ""
    closing, reply = stream.finish("stop")
    sent += "".join(c.delta.content or "" for c in closing)
    assert sent == reply.content == "Hello "




def test_one_call_at_most_ends_the_reply_at_the_token_closing_the_first_call(tok) -> None:
    """``parallel_tool_calls: false``: the watch keeps the tokens through the first call's
    closing tag and nothing after, whatever tokens the text arrives in."""
    ids = _ids(tok, f"Let me look. {CALL_TEXT}\n{CALL_TEXT}")
    keep = FirstCallWatch(tok).feed(ids)
    assert tok.decode(ids[:keep]).endswith("</tool_call>") and tok.decode(ids[:keep]).count("<tool_call>") == 1
    one_by_one = FirstCallWatch(tok)
    fed = next(k for k, tid in enumerate(ids) if one_by_one.feed([tid]) is not None)
    assert fed + 1 == keep
    assert FirstCallWatch(tok).feed(_ids(tok, "No call here, only <tool_call> talk")) is None
    comps = [Sampled(ids[:keep], [-0.5] * keep, "stop", [(0, 3)])]
    response, _ = chat_completion(tok, "c1", "m", 0, 4, comps, True, False)
    assert response.choices[0].finish_reason == "tool_calls" and len(response.choices[0].message.tool_calls) == 1


def test_name_and_developer_reach_the_template_as_templates_take_them() -> None:
    req = parse_chat_request({"messages": [{"role": "developer", "content": "Be brief.", "name": "ops"},
                                           {"role": "user", "content": "hi", "name": "ada"}]})
    assert template_messages(req.messages) == [{"role": "system", "content": "Be brief.", "name": "ops"},
                                               {"role": "user", "content": "hi", "name": "ada"}]
