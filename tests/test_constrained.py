"""The grammars the gateway builds for the parameters that need constrained decoding
(gateway/constraints.py), compiled with xgrammar -- the backend vLLM's structured outputs run
them on -- against a tiny tokenizer: in every chat format a named tool's call, written the way
the format renders it, is accepted token by token and ends the reply; another tool's call,
arguments off the schema, or free text are not. Through a live vLLM engine: tests/test_live_e2e.py
(tests/constrained_checks.py)."""

from __future__ import annotations

import json

import pytest

from envs.formats import FORMATS, ToolCall, get_format
from gateway.constraints import guide_for
from gateway.errors import InvalidRequest
from gateway.openai_types import parse_chat_request
from gateway_fixtures import tiny_tokenizer

xgr = pytest.importorskip("xgrammar", reason="xgrammar comes with vLLM (requirements-vllm.lock)")

USER = [{"role": "user", "content": "In which city was Mobi Vogi born?"}]
QUERY = {"type": "object", "properties": {"query": {"type": "string", "maxLength": 12}}, "required": ["query"],
         "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "search", "parameters": QUERY}},
         {"type": "function", "function": {"name": "final_answer"}}]


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return tiny_tokenizer(tmp_path_factory.mktemp("tok"))


@pytest.fixture(scope="module")
def compiler(tok):
    info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=len(tok), stop_token_ids=[tok.eos_token_id])
    return xgr.GrammarCompiler(info)


def _accepts(compiler, tok, guide: str, text: str) -> bool:
    """Whether the grammar takes ``text``'s tokens and then lets the reply end."""
    matcher = xgr.GrammarMatcher(compiler.compile_structural_tag(guide))
    ids = tok(text, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    return all(matcher.accept_token(t) for t in ids) and matcher.is_terminated()


def _guide(fmt: str, **extra) -> tuple[str, str]:
    g = guide_for(parse_chat_request({"messages": USER, "tools": TOOLS, **extra}), fmt)
    assert g is not None
    return g.tag, g.reason


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_a_named_tool_is_one_call_in_the_formats_own_syntax(compiler, tok, fmt) -> None:
    guide, reason = _guide(fmt, tool_choice={"type": "function", "function": {"name": "search"}})
    render = get_format(fmt).render
    assert reason == "tool_choice_named"
    assert _accepts(compiler, tok, guide, render(None, [ToolCall(name="search", arguments={"query": "Katu"})]))
    assert not _accepts(compiler, tok, guide, render(None, [ToolCall(name="final_answer", arguments={"answer": "x"})]))
    assert not _accepts(compiler, tok, guide, render(None, [ToolCall(name="search", arguments={"q": "Katu"})]))
    assert not _accepts(compiler, tok, guide, "Katu")


def test_required_is_one_call_of_any_offered_tool(compiler, tok) -> None:
    guide, reason = _guide("hermes", tool_choice="required")
    render = get_format("hermes").render
    assert reason == "tool_choice_required"
    assert _accepts(compiler, tok, guide, render(None, [ToolCall(name="search", arguments={"query": "Katu"})]))
    # a tool without parameters takes any object
    assert _accepts(compiler, tok, guide, render(None, [ToolCall(name="final_answer", arguments={"answer": "K"})]))
    assert not _accepts(compiler, tok, guide, render(None, [ToolCall(name="lookup", arguments={})]))
    assert not _accepts(compiler, tok, guide, "Katu")


def test_strict_tools_leave_text_free_and_calls_to_their_schema(compiler, tok) -> None:
    strict = [{**TOOLS[0], "function": {**TOOLS[0]["function"], "strict": True}}, TOOLS[1]]
    g = guide_for(parse_chat_request({"messages": USER, "tools": strict}), "hermes")
    assert g is not None and (g.reason, g.param) == ("strict_tools", "tools.0.function.strict")
    call = get_format("hermes").render("Let me look.", [ToolCall(name="search", arguments={"query": "Katu"})])
    assert _accepts(compiler, tok, g.tag, "Katu") and _accepts(compiler, tok, g.tag, call)
    bad = get_format("hermes").render(None, [ToolCall(name="search", arguments={"query": 3})])
    assert not _accepts(compiler, tok, g.tag, bad)


def test_response_format_is_json_of_the_schema_or_with_tools_a_call(compiler, tok) -> None:
    city = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
            "additionalProperties": False}
    fmt = {"type": "json_schema", "json_schema": {"name": "c", "schema": city, "strict": True}}
    g = guide_for(parse_chat_request({"messages": USER, "response_format": fmt}), "hermes")
    assert g is not None and g.reason == "response_format_json_schema"
    assert _accepts(compiler, tok, g.tag, json.dumps({"city": "Katu"}))
    assert not _accepts(compiler, tok, g.tag, json.dumps({"town": "Katu"})) and not _accepts(compiler, tok, g.tag, "Katu")
    any_object, reason = _guide("hermes", response_format={"type": "json_object"})
    call = get_format("hermes").render(None, [ToolCall(name="search", arguments={"query": "Katu"})])
    assert reason == "response_format_json_object" and _accepts(compiler, tok, any_object, call)
    assert _accepts(compiler, tok, any_object, '{"a": [1, 2]}') and not _accepts(compiler, tok, any_object, "[1]")
    # nothing asked: no grammar
    assert guide_for(parse_chat_request({"messages": USER, "tools": TOOLS, "response_format": {"type": "text"}}),
                     "hermes") is None


@pytest.mark.parametrize("extra, param, says", [
    ({"tool_choice": {"type": "function", "function": {"name": "lookup"}}}, "tool_choice.function.name", "not in tools"),
    ({"tools": None, "tool_choice": "required"}, "tool_choice", "needs tools"),
])
def test_a_choice_that_names_no_offered_tool_is_a_400_naming_it(extra, param, says) -> None:
    with pytest.raises(InvalidRequest) as err:
        guide_for(parse_chat_request({"messages": USER, "tools": TOOLS, **extra}), "hermes")
    assert err.value.param == param and says in err.value.message
