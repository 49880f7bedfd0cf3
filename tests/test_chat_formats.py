"""The chat format registry against each family's published chat template (tests/data/chat_templates)
on tiny local tokenizers: tools shown (by the template, or by the format where the template shows
none), calls the template renders parsed back, parallel calls, round trips, malformed calls as
errors, and streams that the official SDK accumulates to exactly the non-streamed message."""

from __future__ import annotations

import json

import pytest
from openai.lib.streaming.chat import ChatCompletionStreamState
from openai.types.chat import ChatCompletion as SDKCompletion
from openai.types.chat import ChatCompletionChunk as SDKChunk

from chat_format_fixtures import FAMILIES, family_format, family_tokenizer
from envs.formats import FORMATS, StreamParser, ToolCall, get_format
from envs.toolcalls import parse_action
from gateway.openai_types import ChatCompletionChunk
from gateway.responses import ChoiceStream, chat_completion
from gateway_fixtures import Sampled, random_policy  # noqa: F401 - a fixture
from rollout import chat
from rollout.config import RolloutConfig

SEARCH = ToolCall(name="search", arguments={"query": "capital of France"})
LOOKUP = ToolCall(name="lookup", arguments={"id": 3, "city": "Paris é"})
TOOLS = [{"type": "function", "function": {"name": "search", "description": "Search the web.",
                                           "parameters": {"type": "object", "properties": {"query": {"type": "string"}}}}}]
USER = {"role": "user", "content": "What is the capital of France?"}


@pytest.fixture(scope="module")
def toks():
    return {f: family_tokenizer(f) for f in FAMILIES}


def _call_message(calls: list[ToolCall], content: str = "") -> dict:
    return {"role": "assistant", "content": content, "tool_calls": [
        {"id": f"call{k}abcdefgh", "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
        for k, c in enumerate(calls)]}


def test_the_registry_names_every_format_and_unknown_names_fail_listing_them() -> None:
    assert sorted(FORMATS) == ["hermes", "llama3_json", "mistral", "qwen3"]
    assert RolloutConfig().chat_format == "hermes"  # today's behaviour by default
    with pytest.raises(ValueError, match="(?s)chat_format.*known: hermes, llama3_json, mistral, qwen3"):
        RolloutConfig(chat_format="chatml")


# family -> (template renders tools, template renders tool_calls)
SUPPORT = {"qwen2_5": (True, True), "qwen3": (True, True), "llama3_1": (True, True),
           "mistral": (True, False), "smollm2": (False, False)}


@pytest.mark.parametrize("family", list(FAMILIES))
def test_every_prompt_shows_the_tools_by_the_template_or_by_the_format(family, toks) -> None:
    tok, fmt = toks[family], family_format(family)
    support = chat.template_support(tok)
    assert (support.tools, support.tool_calls) == SUPPORT[family]
    text = chat.prompt_text(tok, [USER], TOOLS, fmt)
    assert "Search the web." in text and USER["content"] in text
    syntax = get_format(fmt).call_syntax()
    # The format writes its own call syntax only where the template shows no tools (SmolLM2).
    assert (syntax in text) == (not support.tools)
    if family == "smollm2":
        assert text.startswith("<|im_start|>system\nYou can use tools.") and "SmolLM" not in text


@pytest.mark.parametrize("family", list(FAMILIES))
def test_calls_the_template_renders_parse_back_to_the_same_calls(family, toks) -> None:
    """An assistant call message rendered by the published template (through the format where
    the template writes no calls), cut from the render, parses back to the same calls."""
    tok, fmt = toks[family], family_format(family)
    calls = [SEARCH] if family == "llama3_1" else [SEARCH, LOOKUP]  # Llama 3.1's allows one a message
    head = chat.prompt_text(tok, [USER], None, fmt)
    messages, _ = chat.prepare(tok, [USER, _call_message(calls)], None, fmt)
    full = tok.apply_chat_template(messages, tokenize=False)
    assert full.startswith(head)
    action = full[len(head):full.index(tok.eos_token, len(head))]
    parsed = parse_action(action, fmt)
    assert parsed.calls == calls and parsed.errors == []


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_render_and_parse_round_trip_with_parallel_calls(name) -> None:
    fmt = get_format(name)
    content = None if name == "llama3_json" else "Let me check two things."
    reasoning = "Search first." if name == "qwen3" else None
    text = fmt.render(content, [SEARCH, LOOKUP], reasoning)
    split = fmt.split(text)
    assert (split.valid_calls(), split.content, split.reasoning, split.errors) == ([SEARCH, LOOKUP], content,
                                                                                   reasoning, [])
    # What the arguments strings carry is the JSON the model wrote, and it parses to the call's.
    assert [json.loads(d.arguments) for d in split.calls] == [SEARCH.arguments, LOOKUP.arguments]
    assert fmt.split(fmt.render("<answer>Paris</answer>", [])).content == "<answer>Paris</answer>"
    assert parse_action(fmt.render("<answer>Paris</answer>", []), name).answer == "Paris"


MALFORMED = {
    "hermes": ['<tool_call>{"name": "search", "arguments": {"query": </tool_call>', '<tool_call>{"name": "s"',
               "<tool_call>[1, 2]</tool_call>", '<tool_call>{"name": "s", "arguments": 7}</tool_call>'],
    "qwen3": ['<think>hm</think><tool_call>{"name": "search", "arguments": "x"}</tool_call>',
              "<think>unfinished", '<tool_call>\n{"name": "s", "arguments": {"q": 1}\n</tool_call>'],
    "llama3_json": ['{"name": "search", "parameters": {"query": ', '{"name": 3}', '{"name": "s", "parameters": 5}; oops'],
    "mistral": ['[TOOL_CALLS][{"name": "search", "arguments": {', '[TOOL_CALLS][{"arguments": {}}]',
                '[TOOL_CALLS]{"name": "s", "arguments": []}'],
}


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_malformed_calls_are_errors_and_no_prefix_of_any_text_raises(name) -> None:
    fmt = get_format(name)
    for text in MALFORMED[name]:
        parsed = parse_action(text, name)
        assert parsed.calls == [] and (parsed.errors or name == "qwen3" and text == "<think>unfinished"), text
    # Streaming reads every prefix: none may raise, and what the prefixes release adds up to the
    # finished message (nothing released is ever taken back).
    good = fmt.render("Okay.", [SEARCH, LOOKUP], "why" if name == "qwen3" else None)
    for text in [good, *MALFORMED[name]]:
        parser, content, args = StreamParser(fmt), "", {}
        for i in range(len(text) + 1):
            fmt.scan(text[:i], final=True)
            delta = parser.feed(text[:i], final=i == len(text))
            content += delta.content
            for c in delta.calls:
                args[c.index] = args.get(c.index, "") + c.arguments
        split = fmt.split(text)
        assert (content or None, list(args.values())) == (split.content, [d.arguments for d in split.calls]), text


def test_qwen3_reasoning_is_split_off_and_never_read_as_calls_or_answers() -> None:
    text = ('<think>\nMaybe <answer>Lyon</answer>? <tool_call>{"name": "x"}</tool_call>\n</think>\n\n'
            "<answer>Paris</answer>")
    parsed = parse_action(text, "qwen3")
    assert (parsed.answer, parsed.calls, parsed.errors) == ("Paris", [], [])
    assert parsed.reasoning.startswith("Maybe <answer>Lyon</answer>?")
    # A prompt that opened the reasoning itself: the text starts inside it.
    assert get_format("qwen3").split("still thinking</think>Paris").reasoning == "still thinking"


def _accumulate(tok, fmt: str, text: str) -> tuple[dict, dict]:
    """Stream ``text``'s tokens one at a time through ChoiceStream, and the SDK's own stream
    accumulator; and the non-streamed response as the SDK parses it."""
    ids = tok(text, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    stream = ChoiceStream(tok, "chatcmpl-f", 0, True, False, fmt)
    state = ChatCompletionStreamState()
    choices = [c for tid in ids for c in stream.push([tid], [-0.5])]
    choices += stream.finish("stop")[0]
    reasoning = ""
    for choice in choices:
        wire = ChatCompletionChunk(id="chatcmpl-f", created=1, model="policy", choices=[choice]).wire()
        reasoning += wire["choices"][0]["delta"].get("reasoning_content") or ""
        state.handle_chunk(SDKChunk.model_validate(json.loads(json.dumps(wire))))
    streamed = state.get_final_completion().choices[0]
    resp, _ = chat_completion(tok, "chatcmpl-f", "policy", 1, 3, [Sampled(ids, [-0.5] * len(ids), "stop", [(0, 1)])],
                              True, False, fmt)
    whole = SDKCompletion.model_validate(json.loads(json.dumps(resp.wire()))).choices[0]
    # The first chunk carries content "" as OpenAI's does, which the SDK accumulates to "" where
    # the whole message says null.
    got = {"content": streamed.message.content or None, "finish": streamed.finish_reason, "reasoning": reasoning or None,
           "calls": [(c.id, c.function.name, c.function.arguments) for c in streamed.message.tool_calls or []]}
    want = {"content": whole.message.content, "finish": whole.finish_reason,
            "reasoning": resp.wire()["choices"][0]["message"].get("reasoning_content"),
            "calls": [(c.id, c.function.name, c.function.arguments) for c in whole.message.tool_calls or []]}
    return got, want


@pytest.mark.parametrize("family", list(FAMILIES))
def test_streamed_deltas_accumulate_in_the_sdk_to_the_non_streamed_message(family, toks) -> None:
    tok, name = toks[family], family_format(family)
    fmt = get_format(name)
    content = None if name == "llama3_json" else "Let me check two things."
    text = fmt.render(content, [SEARCH, LOOKUP], "Search first." if name == "qwen3" else None)
    got, want = _accumulate(tok, name, text)
    assert got == want and want["finish"] == "tool_calls" and want["content"] == content
    assert [(n, json.loads(a)) for _, n, a in want["calls"]] == [("search", SEARCH.arguments),
                                                                 ("lookup", LOOKUP.arguments)]
    # The same for a malformed call (its arguments as written) and for plain content.
    for other in [fmt.render("Hi.", []), MALFORMED[name][0]]:
        got, want = _accumulate(tok, name, other)
        assert got == want


def test_a_format_marker_that_is_a_special_token_survives_decoding(toks) -> None:
    tok = toks["mistral"]
    text = get_format("mistral").render(None, [SEARCH])
    ids = tok(text, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    assert tok.convert_tokens_to_ids("[TOOL_CALLS]") in ids
    assert chat.decode_action(tok, ids, "mistral") == text  # [TOOL_CALLS] kept, </s> dropped
    assert chat.decode_action(tok, ids, "hermes") == text.replace("[TOOL_CALLS]", "")


def test_demonstrations_are_rewritten_into_the_policys_format(toks) -> None:
    tok = toks["llama3_1"]
    demo = '<tool_call>{"name": "search", "arguments": {"query": "capital of France"}}</tool_call>'
    ids = chat.action_ids(tok, demo, "llama3_json")
    assert ids[-1] == tok.eos_token_id
    assert tok.decode(ids[:-1]) == '{"name": "search", "parameters": {"query": "capital of France"}}'
    assert chat.action_ids(tok, demo) == tok(demo, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]


# -- token-exact with a template that is not append-only (Qwen3's) ---------------------------------
def test_qwen3_live_session_keeps_the_sampled_reasoning_the_template_would_drop(toks) -> None:
    """Qwen3's template drops an earlier turn's <think> once a new user message follows. The
    recorder still builds the next prompt from the sampled ids plus the template's delta, so
    the segment holds exactly what the engine saw and sampled, reasoning included."""
    from gateway.sessions import CAUSES, SessionRecorder
    from gateway.toolcalls import split_action, template_messages
    from gateway.openai_types import parse_chat_request

    tok = toks["qwen3"]
    rec = SessionRecorder(tok, chat_format="qwen3")
    first = template_messages(parse_chat_request({"messages": [USER], "tools": TOOLS}).messages)
    p1 = rec.prepare("s", first, TOOLS)
    assert p1.prompt_ids == chat.prompt_ids(tok, first, TOOLS)  # the template shows the tools itself
    text = "<think>\nThe capital is well known.\n</think>\n\n<answer>Paris</answer>"
    action = tok(text, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    reply = split_action(text, "chatcmpl-q", 0, True, "qwen3")
    assert (reply.reasoning, reply.content) == ("The capital is well known.", "<answer>Paris</answer>")
    rec.record(p1, [Sampled(action, [-0.1] * len(action), "stop", [(0, 0)])], [reply])
    # The client sends our message back without the reasoning (as OpenAI clients do), then a question.
    body = {"messages": [USER, reply.message().wire() | {"reasoning_content": None},
                         {"role": "user", "content": "Thanks! And Spain?"}], "tools": TOOLS}
    p2 = rec.prepare("s", template_messages(parse_chat_request(body).messages), TOOLS)
    delta = "\n<|im_start|>user\nThanks! And Spain?<|im_end|>\n<|im_start|>assistant\n"
    assert p2.continues == 0 and p2.cause is None
    assert p2.prompt_ids == p1.prompt_ids + action + tok(delta, add_special_tokens=False)["input_ids"]
    fresh = chat.prompt_text(tok, p2.messages, TOOLS, "qwen3")
    assert "The capital is well known." not in fresh  # what a re-render would have trained on
    rec.record(p2, [Sampled(action, [-0.1] * len(action), "stop", [(0, 0)])], [reply])
    [seg] = rec.segments("s")
    assert seg.trajectory.token_ids() == p2.prompt_ids + action
    assert list(seg.trajectory.turns[0].action_ids) == action  # the reasoning's tokens included
    assert {c: n for c, n in rec.counters.items() if c in CAUSES and n} == {} and rec.counters["stitched"] == 1
    assert p2.over_rerender and rec.counters["stitched_over_rerender"] == 1


def test_the_delta_after_a_turn_is_what_each_published_template_writes(toks) -> None:
    """observation_text on every family: the template's text after an assistant turn's end,
    through the next assistant header (Qwen3's included, which the old append-only check refused)."""
    tool = [{"role": "tool", "content": "Paris", "tool_call_id": "call0abcdefgh"}]
    want = {"qwen2_5": "\n<|im_start|>user\n<tool_response>\nParis\n</tool_response><|im_end|>\n<|im_start|>assistant\n",
            "qwen3": "\n<|im_start|>user\n<tool_response>\nParis\n</tool_response><|im_end|>\n<|im_start|>assistant\n",
            "llama3_1": '<|start_header_id|>ipython<|end_header_id|>\n\n{"output": "Paris"}<|eot_id|>'
                        "<|start_header_id|>assistant<|end_header_id|>\n\n",
            "mistral": "[TOOL_RESULTS]Paris[/TOOL_RESULTS]",
            "smollm2": "\n<|im_start|>tool\nParis<|im_end|>\n<|im_start|>assistant\n"}
    for family, text in want.items():
        assert chat.observation_text(toks[family], tool, family_format(family)) == text, family


def test_an_environment_host_parses_actions_in_the_format_the_rollout_names() -> None:
    """The format crosses the environment-actor boundary (EnvHost.open): the same text is a
    call under llama3_json and no action at all under hermes."""
    import asyncio

    from envs.host import EnvHost

    host = EnvHost({"type": "household", "num_train_tasks": 2, "num_heldout_tasks": 1})
    task = host.source.tasks("train")[0]
    action = '{"name": "act", "parameters": {"command": "look"}}'

    async def step(chat_format: str):
        episode, _, _ = await host.open(task, chat_format)
        return (await host.step(episode, action)).tool_calls

    assert asyncio.run(step("llama3_json")) == [ToolCall(name="act", arguments={"command": "look"})]
    assert asyncio.run(step("hermes")) == []

    async def hint(chat_format: str) -> str:  # no action at all: the hint shows the format's syntax
        episode, _, _ = await host.open(task, chat_format)
        return (await host.step(episode, "I am not sure.")).observation.messages[0]["content"]

    assert '{"name": "act", "parameters": {"command": "..."}}' in asyncio.run(hint("llama3_json"))
    assert '<tool_call>{"name": "act", "arguments": {"command": "..."}}</tool_call>' in asyncio.run(hint("hermes"))


@pytest.mark.parametrize("family", list(FAMILIES))
def test_the_stream_decoder_gives_a_full_decode_s_text_token_by_token(family, toks) -> None:
    """``rollout.chat.StreamDecoder`` (the gateway's streams) steps tokenizers' DecodeStream, yet
    after every token its text is what decoding the whole completion gives, the format's kept
    markers included and a character split across tokens held back until complete."""
    import random

    tok, fmt = toks[family], family_format(family)
    text = 'Paris é 東京 <tool_call>{"name": "search"}</tool_call> [TOOL_CALLS] <|python_tag|> ok'
    ids = tok(text, add_special_tokens=False)["input_ids"] + tok.all_special_ids
    rng = random.Random(0)
    ids += [rng.randrange(len(tok)) for _ in range(200)]
    decoder = chat.StreamDecoder(tok, fmt)
    for i in range(len(ids)):
        got = decoder.push(ids[i:i + 1])
        assert got == chat.decode_action(tok, ids[:i + 1], fmt).rstrip("\ufffd"), i
    assert decoder._stream is not None  # never fell back to full decodes


def test_a_rollout_worker_refuses_a_template_whose_turn_end_changes_at_start(random_policy, tmp_path) -> None:
    """A template that ends the last assistant turn with " " before end-of-turn, and without
    it once a message follows: no delta can follow the sampled tokens, so every multi-turn
    episode would fail at its second turn. The worker refuses it as it starts, naming the
    template and why; the same policy with its own template starts."""
    import shutil

    from transformers import AutoTokenizer

    from cluster.config import load_config
    from rollout.engines import local_client
    from rollout.worker import RolloutWorker

    padded = "{%- for m in messages -%}<|im_start|>{{ m.role }}\n{{ m.content }}{% if loop.last and m.role == " \
             "'assistant' %} {% endif %}<|im_end|>\n{% endfor -%}{%- if add_generation_prompt -%}<|im_start|>assistant\n" \
             "{% endif -%}"
    shutil.copytree(random_policy, tmp_path / "policy")
    tok = AutoTokenizer.from_pretrained(tmp_path / "policy")
    tok.chat_template = padded
    tok.save_pretrained(tmp_path / "policy")
    cfg = load_config(None, ["env.num_entities=40", "env.hops=[1]", "env.max_turns=2", "env.num_train_tasks=10",
                             "env.num_heldout_tasks=5"])
    engine = local_client(cfg.rollout.engine, str(tmp_path / "policy"))
    with pytest.raises(ValueError, match=r"chat template of .*policy: the chat template ends an assistant turn "
                                         r"differently when more messages follow.*use a policy whose template does"):
        RolloutWorker(0, cfg.rollout, cfg.env, engine, 0, None)
    own = local_client(cfg.rollout.engine, random_policy)
    assert RolloutWorker(0, cfg.rollout, cfg.env, own, 0, None).worker_id == 0
