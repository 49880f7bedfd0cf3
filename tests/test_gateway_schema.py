"""OpenAI's chat-completions request schema, field by field, against the live endpoint over real
HTTP (the official SDK, a real HF engine serving the tiny warm-started agent).

The fields are the pinned SDK's own (``CompletionCreateParams``): a field OpenAI adds fails
``test_every_documented_field_is_classified`` until it is classified here and in docs/live.md.
Each is honoured (checked in the reply or the recording), accepted with no effect (the greedy
reply is the one sent without it), or refused with a 400 naming it. Bias and penalties are
checked token by token against the model's own logits: the recorded log-probs are those of the
distribution actually sampled."""

from __future__ import annotations

import json

import openai
import pytest
import torch
from openai.types.chat.completion_create_params import CompletionCreateParamsBase

from gateway.config import LiveConfig
from gateway.openai_types import NO_EFFECT, REFUSED
from gateway.toolcalls import thinking_off_ids
from tests.test_gateway_http import TOKEN, Served, _sdk

MODEL = "turnrl-policy"
USER = [{"role": "user", "content": "Where was Mobi Vogi born?"}]

NO_EFFECT_VALUES = {
    "service_tier": "flex", "prompt_cache_key": "tenant-a", "prompt_cache_retention": "24h",
    "prompt_cache_options": {"mode": "implicit", "ttl": "30m"}, "safety_identifier": "hash-1",
    "metadata": {"team": "search"}, "verbosity": "low", "prediction": {"type": "content", "content": "Katu"},
    "user": "walker", "reasoning_effort": "none", "modalities": ["text"], "store": False,
    "temperature": 0, "top_p": 1.0,
}
"""Fields whose value here changes nothing (``reasoning_effort``: the served Hermes format has no
reasoning switch; ``temperature`` 0 and ``top_p`` 1 are what the baseline sends)."""
REFUSED_VALUES = {
    "audio": {"voice": "alloy", "format": "mp3"}, "functions": [{"name": "search", "parameters": {}}],
    "function_call": "auto", "web_search_options": {}, "moderation": {"model": "omni-moderation-latest"},
    "response_format": {"type": "json_object"},
}
"""Refused on this engine: ``response_format`` (and ``tool_choice`` required/named, ``strict``
tools) need constrained decoding, which the vLLM engine does (tests/test_gateway_guided.py)."""
HONOURED = {"messages", "model", "tools", "tool_choice", "n", "max_tokens", "max_completion_tokens", "stop",
            "logprobs", "top_logprobs", "seed", "stream_options", "logit_bias", "presence_penalty",
            "frequency_penalty", "parallel_tool_calls"}
"""Checked by the tests below, one or more each."""


@pytest.fixture(scope="module")
def served(agent_policy):
    s = Served(LiveConfig(enabled=True, tokens=[TOKEN], default_max_tokens=24), agent_policy[0])
    yield s
    s.close()


@pytest.fixture(scope="module")
def client(served) -> openai.OpenAI:
    return _sdk(served)


@pytest.fixture(scope="module")
def model(agent_policy):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(agent_policy[0], dtype=torch.float32).eval()


def _segment(served, sid: str):
    return served.gateway.service.recorder.segments(sid)[-1].trajectory


def _greedy(client, sid: str, **extra):
    return client.chat.completions.create(model=MODEL, messages=USER, temperature=0, max_tokens=12,
                                          extra_headers={"X-Session-Id": sid}, **extra)


def test_every_documented_field_is_classified() -> None:
    documented = set(CompletionCreateParamsBase.__annotations__) | {"stream"}
    classified = set(NO_EFFECT_VALUES) | set(REFUSED_VALUES) | HONOURED | {"stream"}
    assert documented == classified
    assert set(REFUSED) <= set(REFUSED_VALUES) and set(NO_EFFECT) <= set(NO_EFFECT_VALUES)


@pytest.mark.parametrize("field", sorted(NO_EFFECT_VALUES))
def test_accepted_fields_change_nothing_served(client, field) -> None:
    base = _greedy(client, f"base-{field}")
    got = _greedy(client, f"with-{field}", extra_body={field: NO_EFFECT_VALUES[field]})
    assert got.choices[0].message == base.choices[0].message
    assert got.usage.completion_tokens == base.usage.completion_tokens


@pytest.mark.parametrize("field", sorted(REFUSED_VALUES))
def test_refused_fields_are_400s_naming_them_and_record_nothing(served, client, field) -> None:
    before = served.gateway.stats()["recorder"]["requests"]
    with pytest.raises(openai.BadRequestError) as err:
        _greedy(client, f"refused-{field}", extra_body={field: REFUSED_VALUES[field]})
    assert err.value.body["param"] == field and err.value.status_code == 400
    assert served.gateway.stats()["recorder"]["requests"] == before


def _shaped_logprobs(model, prompt: list[int], action: list[int], bias: dict[int, float],
                     presence: float, frequency: float) -> tuple[list[int], list[float]]:
    """Greedy tokens and their log-probs under the model's logits reshaped as OpenAI says:
    bias added, each earlier occurrence in the reply penalised."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + action])).logits[0, len(prompt) - 1:-1].double()
    tokens, lps = [], []
    for t, row in enumerate(logits):
        row = row.clone()
        for tid, b in bias.items():
            row[tid] += b
        counts = torch.bincount(torch.tensor(action[:t], dtype=torch.long), minlength=row.numel())[: row.numel()]
        row -= frequency * counts + presence * (counts > 0)
        logp = torch.log_softmax(row, -1)
        tokens.append(int(logp.argmax()))
        lps.append(float(logp[action[t]]))
    return tokens, lps


@pytest.mark.parametrize("shape", ["penalties", "logit_bias"])
def test_bias_and_penalties_are_sampled_and_recorded_exactly(served, client, model, shape) -> None:
    plain = _segment_after(served, client, f"{shape}-plain", {})
    if shape == "penalties":
        extra = {"frequency_penalty": 1.5, "presence_penalty": 0.7}
    else:  # ban the token greedy decoding wrote first, lift the second
        first, second = plain.turns[0].action_ids[:2]
        extra = {"logit_bias": {str(first): -100, str(second): 5}}
    traj = _segment_after(served, client, shape, extra)
    action = list(traj.turns[0].action_ids)
    bias = {int(k): v for k, v in extra.get("logit_bias", {}).items()}
    want_tokens, want_lps = _shaped_logprobs(model, list(traj.prompt_ids), action, bias,
                                             extra.get("presence_penalty", 0.0), extra.get("frequency_penalty", 0.0))
    assert action == want_tokens
    assert list(traj.turns[0].action_logprobs) == pytest.approx(want_lps, abs=2e-4)
    assert action != list(plain.turns[0].action_ids)  # the reshaping changed what was written
    assert traj.live.constrained == {0: shape} and plain.live.constrained == {}


def _segment_after(served, client, sid: str, extra: dict):
    _greedy(client, sid, extra_body=extra)
    return _segment(served, sid)


def test_top_logprobs_are_the_most_likely_alternatives(served, client) -> None:
    reply = _greedy(client, "top", logprobs=True, top_logprobs=3)
    for entry in reply.choices[0].logprobs.content:
        alts = [a.logprob for a in entry.top_logprobs]
        assert len(alts) == 3 and alts == sorted(alts, reverse=True)
        assert entry.logprob == pytest.approx(alts[0], abs=1e-5)  # greedy: the sampled token is the top one
        assert entry.top_logprobs[0].token == entry.token
    traj = _segment(served, "top")
    assert [e.logprob for e in reply.choices[0].logprobs.content] == \
        pytest.approx(list(traj.turns[0].action_logprobs[:len(reply.choices[0].logprobs.content)]), abs=1e-6)


def test_one_call_at_most_ends_the_turn_where_the_first_call_closes(served, client, agent_policy) -> None:
    task = agent_policy[1].tasks("train")[0]
    tok = served.gateway.service.engine.tokenizer
    free = client.chat.completions.create(model=MODEL, messages=task.messages, tools=task.tools, temperature=0, max_tokens=64,
                                          extra_headers={"X-Session-Id": "calls-free"})
    one = client.chat.completions.create(model=MODEL, messages=task.messages, tools=task.tools, temperature=0, max_tokens=64,
                                         parallel_tool_calls=False, extra_headers={"X-Session-Id": "calls-one"})
    assert one.choices[0].finish_reason == "tool_calls" and len(one.choices[0].message.tool_calls) == 1
    assert one.choices[0].message.tool_calls[0].function == free.choices[0].message.tool_calls[0].function
    traj = _segment(served, "calls-one")
    text = tok.decode(traj.turns[0].action_ids)
    assert text.rstrip().endswith("</tool_call>") and tok.eos_token_id not in traj.turns[0].action_ids
    assert traj.live.ended_early == {0: "first_tool_call"} and _segment(served, "calls-free").live.ended_early == {}
    # the next request stitches on: the observation closes the turn the server cut
    call = one.choices[0].message.tool_calls[0]
    messages = [*task.messages, one.choices[0].message.model_dump(exclude_none=True),
                {"role": "tool", "tool_call_id": call.id, "content": "Mobi Vogi was born in Katu."}]
    client.chat.completions.create(model=MODEL, messages=messages, tools=task.tools, temperature=0, max_tokens=8,
                                   parallel_tool_calls=False, extra_headers={"X-Session-Id": "calls-one"})
    assert len(_segment(served, "calls-one").turns) == 2


def test_names_n_seed_limits_stop_user_and_usage(served, client) -> None:
    named = [{"role": "developer", "content": "Answer briefly.", "name": "ops"}, {**USER[0], "name": "ada"}]
    reply = client.chat.completions.create(model=MODEL, messages=named, temperature=0, max_completion_tokens=5,
                                           user="named-user")
    assert reply.usage.completion_tokens <= 5 and reply.choices[0].finish_reason in ("length", "stop")
    session = served.gateway.service.recorder.get("named-user")  # ``user`` keys the session
    assert [m.get("name") for m in session.last.messages] == ["ops", "ada"]
    assert session.last.messages[0]["role"] == "system"
    two = client.chat.completions.create(model=MODEL, messages=USER, n=2, seed=11, max_tokens=6)
    again = client.chat.completions.create(model=MODEL, messages=USER, n=2, seed=11, max_tokens=6)
    assert len(two.choices) == 2 and [c.message for c in two.choices] == [c.message for c in again.choices]
    stream = client.chat.completions.create(model=MODEL, messages=USER, temperature=0, max_tokens=6, stream=True,
                                            stream_options={"include_usage": True, "include_obfuscation": False})
    chunks = list(stream)
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens <= 6
    text = _greedy(client, "stopless").choices[0].message.content
    cut = text[len(text) // 2:][:3]
    stopped = _greedy(client, "stopped", stop=[cut]).choices[0].message.content
    assert stopped.strip() == text[:text.index(cut)].strip() and _segment(served, "stopped").live.ended_early == {0: "stop"}
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="other-model", messages=USER, max_tokens=2)
    none = client.chat.completions.create(model=MODEL, messages=USER, tools=[{"type": "function", "function": {
        "name": "search", "parameters": {"type": "object", "properties": {"query": {"type": "string"}}}}}],
        tool_choice="none", temperature=0, max_tokens=12)
    assert none.choices[0].message.tool_calls is None
    assert json.loads(none.model_dump_json())["choices"][0]["message"]["role"] == "assistant"


def test_reasoning_effort_turns_thinking_off_in_a_reasoning_format(agent_policy) -> None:
    """Served in the ``qwen3`` format: ``none`` opens the reply with the empty think block (in the
    recorded prompt, so the record stays exact), a next turn stitches on; ``high`` leaves it out."""
    served = Served(LiveConfig(enabled=True, tokens=[TOKEN], default_max_tokens=8), agent_policy[0], chat_format="qwen3")
    try:
        tok = served.gateway.service.engine.tokenizer
        off = thinking_off_ids(tok, "qwen3", "none")
        assert tok.decode(off) == "<think>\n\n</think>\n\n" and thinking_off_ids(tok, "qwen3", "minimal") == off
        assert thinking_off_ids(tok, "qwen3", "high") == [] and thinking_off_ids(tok, "hermes", "none") == []
        client = _sdk(served)
        kw = {"model": MODEL, "temperature": 0, "extra_headers": {"X-Session-Id": "think-off"}}
        first = client.chat.completions.create(messages=USER, reasoning_effort="none", **kw)
        assert getattr(first.choices[0].message, "reasoning_content", None) is None
        traj = _segment(served, "think-off")
        assert list(traj.prompt_ids[-len(off):]) == off
        follow = [*USER, first.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "Sure?"}]
        client.chat.completions.create(messages=follow, reasoning_effort="none", **kw)
        traj = _segment(served, "think-off")
        assert len(traj.turns) == 2 and list(traj.turns[0].observation_ids[-len(off):]) == off
        client.chat.completions.create(messages=USER, reasoning_effort="high", model=MODEL, max_tokens=4,
                                       extra_headers={"X-Session-Id": "think-on"})
        assert list(_segment(served, "think-on").prompt_ids[-len(off):]) != off
    finally:
        served.close()
