"""The session recorder on the tiny tokenizer: live requests stitched token for token, and every
fallback counted by its cause. Completions are hand-built token sequences (no model)."""

from __future__ import annotations

import copy
import json

import pytest

from envs.toolcalls import ToolCall
from gateway.errors import SessionEnded, UnknownSession
from gateway.openai_types import parse_chat_request
from gateway.sessions import CAUSES, SessionRecorder, session_id_for
from gateway.toolcalls import split_action, template_messages
from gateway_fixtures import CALL_TEXT, TOOLS, Sampled, tiny_tokenizer
from rollout import chat
from rollout.trajectory import LiveOrigin

SYSTEM = {"role": "system", "content": "You are a helpful assistant."}
QUESTION = {"role": "user", "content": "What is the capital of France?"}


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return tiny_tokenizer(tmp_path_factory.mktemp("tok"))


def ids(tok, text: str) -> list[int]:
    return tok(text, add_special_tokens=False)["input_ids"]


def sampled(tok, token_ids: list[int], spans=((0, 0),)) -> Sampled:
    """A completion ending with end-of-turn; log-probs -0.1, -0.2, ... so each is traceable."""
    full = token_ids + [tok.eos_token_id]
    return Sampled(full, [-0.1 * (i + 1) for i in range(len(full))], "stop", list(spans))


def client_request(messages: list[dict], **extra) -> tuple[list[dict], list[dict]]:
    """What the gateway derives from an OpenAI request body: template messages and tools."""
    req = parse_chat_request({"messages": messages, **extra})
    return template_messages(req.messages), req.tool_dicts()


def echo(reply) -> dict:
    """The assistant message an SDK client appends back: our response message as JSON."""
    return reply.message().wire()


def test_three_requests_with_a_tool_call_stitch_into_one_token_exact_trajectory(tok) -> None:
    rec = SessionRecorder(tok)
    sid = session_id_for("conv-1", user="someone")
    assert sid == "conv-1"  # the header wins over ``user``
    msgs1 = [SYSTEM, QUESTION]
    p1 = rec.prepare(sid, *client_request(msgs1, tools=TOOLS))
    expected_p1 = ids(tok, "<|im_start|>system\nYou are a helpful assistant.\n<tools>\nsearch(query)\n"
                           "</tools><|im_end|>\n<|im_start|>user\nWhat is the capital of France?"
                           "<|im_end|>\n<|im_start|>assistant\n")
    assert p1.prompt_ids == expected_p1 and p1.continues is None and p1.cause is None
    c1 = sampled(tok, ids(tok, CALL_TEXT), spans=[(0, 3), (20, 4)])  # weights 4 arrived mid-answer
    r1 = split_action(CALL_TEXT, "chatcmpl-1", 0)
    assert r1.content is None and r1.calls == [ToolCall(name="search", arguments={"query": "capital of France"})]
    rec.record(p1, [c1], [r1])

    tool_result = {"role": "tool", "tool_call_id": r1.ids[0], "content": "Paris is the capital of France."}
    msgs2 = msgs1 + [echo(r1), tool_result]
    p2 = rec.prepare(sid, *client_request(msgs2, tools=TOOLS))
    obs2 = ids(tok, "\n<|im_start|>tool\nParis is the capital of France.<|im_end|>\n<|im_start|>assistant\n")
    assert p2.continues == 0 and p2.observation_ids == obs2
    assert p2.prompt_ids == expected_p1 + c1.token_ids + obs2
    # "Paris" sampled letter by letter: a re-tokenized render would give the one token "Paris".
    spelled = tok.convert_tokens_to_ids(["<", "answer", ">", "P", "a", "r", "i", "s", "<", "/", "answer", ">"])
    assert ids(tok, "<answer>Paris</answer>") != spelled
    c2 = sampled(tok, spelled, spans=[(0, 4)])
    rec.record(p2, [c2], [split_action("<answer>Paris</answer>", "chatcmpl-2", 0)])

    msgs3 = msgs2 + [{"role": "assistant", "content": "<answer>Paris</answer>"},
                     {"role": "user", "content": "Thanks! The weather in Paris?"}]
    p3 = rec.prepare(sid, *client_request(msgs3, tools=TOOLS))
    obs3 = ids(tok, "\n<|im_start|>user\nThanks! The weather in Paris?<|im_end|>\n<|im_start|>assistant\n")
    assert p3.prompt_ids == p2.prompt_ids + c2.token_ids + obs3
    c3 = sampled(tok, ids(tok, "sunny"), spans=[(0, 5)])
    rec.record(p3, [c3], [split_action("sunny", "chatcmpl-3", 0)])

    [seg] = rec.segments(sid)
    traj = seg.trajectory
    assert traj.prompt_ids == expected_p1
    assert traj.token_ids() == p3.prompt_ids + c3.token_ids  # the engine's tokens, nothing rebuilt
    assert [t.action_ids for t in traj.turns] == [c1.token_ids, c2.token_ids, c3.token_ids]
    assert [t.observation_ids for t in traj.turns] == [obs2, obs3, []]
    assert traj.turns[1].action_logprobs == pytest.approx([-0.1 * i for i in range(1, 14)])
    assert [t.policy_version for t in seg.trajectory.turns] == [3, 4, 5]
    assert [t.version_spans for t in seg.trajectory.turns] == [[(0, 3), (20, 4)], [], []]
    assert traj.turns[0].tool_calls == r1.calls and traj.turns[1].text == "<answer>Paris</answer>"
    assert sum(traj.loss_mask()) == len(c1.token_ids) + len(c2.token_ids) + len(c3.token_ids)
    assert traj.task_id == "live:conv-1" and traj.live == LiveOrigin(session_id="conv-1", segment=0) and traj.metadata == {}
    counters = rec.counters
    assert (counters["stitched"], counters["segments"], counters["requests"]) == (2, 1, 3)
    assert all(counters[c] == 0 for c in CAUSES)


def _two_turns(rec: SessionRecorder, tok, sid: str, first: list[dict], answer_ids: list[int],
               answer_text: str, follow_up: list[dict], **extra):
    """Record one request, then prepare the follow-up that echoes our answer."""
    p1 = rec.prepare(sid, *client_request(first, **extra))
    reply = split_action(answer_text, "chatcmpl-a", 0)
    rec.record(p1, [sampled(tok, answer_ids)], [reply])
    return p1, rec.prepare(sid, *client_request(first + [echo(reply)] + follow_up, **extra))


def causes(rec: SessionRecorder) -> dict[str, int]:
    return {c: n for c, n in rec.counters.items() if c in CAUSES and n}


def test_rewritten_history_starts_a_new_segment_from_a_full_render(tok) -> None:
    rec = SessionRecorder(tok)
    p1, _ = _two_turns(rec, tok, "s", [QUESTION], ids(tok, "Paris"), "Paris", [])
    edited = [{"role": "user", "content": "What is the capital of Paris?"},
              {"role": "assistant", "content": "Paris"}, {"role": "user", "content": "Thanks!"}]
    p = rec.prepare("s", *client_request(edited))
    assert p.cause == "history_rewritten" and p.continues is None
    assert p.prompt_ids == chat.prompt_ids(tok, template_messages(parse_chat_request({"messages": edited}).messages), [])
    rec.record(p, [sampled(tok, ids(tok, "sunny"))], [split_action("sunny", "c", 0)])
    first, second = rec.segments("s")
    assert second.trajectory.prompt_ids == p.prompt_ids and len(first.trajectory.turns) == 1
    assert second.trajectory.live.segment == 1 and first.trajectory.group_id != second.trajectory.group_id
    assert causes(rec) == {"history_rewritten": 1}


def test_changed_tools_count_as_rewritten_history(tok) -> None:
    rec = SessionRecorder(tok)
    _, p = _two_turns(rec, tok, "s", [QUESTION], ids(tok, "Paris"), "Paris",
                      [{"role": "user", "content": "Thanks!"}])
    assert p.continues == 0  # same tools (none): stitched
    p = rec.prepare("s", *client_request([QUESTION, {"role": "assistant", "content": "Paris"},
                                          {"role": "user", "content": "Thanks!"}], tools=TOOLS))
    assert p.cause == "history_rewritten"


# A template that re-renders the first message when it is a user turn followed by more turns:
# not append-only, but every assistant turn ends the same way, so a delta exists.
FIRST_USER_MARKED = """\
{%- for m in messages -%}
<|im_start|>{{ m.role }}
{{ m.content }}{% if loop.first and m.role == 'user' and messages|length > 2 %} (continued){% endif %}<|im_end|>
{% endfor -%}
{%- if add_generation_prompt -%}<|im_start|>assistant
{% endif -%}"""
# One that also ends the last assistant turn differently (" " before end-of-turn): once another
# message follows, the turn's end changes, so no delta can follow the sampled tokens.
LAST_TURN_PADDED = FIRST_USER_MARKED.replace("{{ m.content }}", "{{ m.content }}{% if loop.last and "
                                             "m.role == 'assistant' %} {% endif %}")


def _with_template(tok, template: str):
    other = copy.deepcopy(tok)
    other.chat_template = template
    return other


@pytest.fixture(scope="module")
def marked_tok(tok):
    return _with_template(tok, FIRST_USER_MARKED)


@pytest.fixture(scope="module")
def padded_tok(tok):
    other = _with_template(tok, LAST_TURN_PADDED)
    with pytest.raises(ValueError, match="ends an assistant turn differently"):
        chat.observation_text(other, [{"role": "user", "content": "x"}])
    return other


def test_a_template_that_rerenders_history_still_stitches_the_sampled_tokens(marked_tok) -> None:
    rec = SessionRecorder(marked_tok)
    p1, p = _two_turns(rec, marked_tok, "s", [QUESTION], ids(marked_tok, "Paris"), "Paris",
                       [{"role": "user", "content": "Thanks!"}])
    assert p.continues == 0 and p.cause is None and not p.by_render
    # The engine sees the first prompt as it was sampled from, not the re-rendered " (continued)".
    assert p.prompt_ids[:len(p1.prompt_ids)] == p1.prompt_ids
    assert p.prompt_ids != chat.prompt_ids(marked_tok, p.messages, [])
    assert p.observation_ids == ids(marked_tok, "\n<|im_start|>user\nThanks!<|im_end|>\n<|im_start|>assistant\n")
    rec.record(p, [sampled(marked_tok, ids(marked_tok, "sunny"))], [split_action("sunny", "c", 0)])
    [seg] = rec.segments("s")
    assert seg.trajectory.token_ids()[:len(p.prompt_ids)] == p.prompt_ids and causes(rec) == {}
    assert p.over_rerender and rec.counters["stitched_over_rerender"] == 1


def test_a_turn_end_the_template_rewrites_counts_template_not_append_only(padded_tok) -> None:
    rec = SessionRecorder(padded_tok)
    _, p = _two_turns(rec, padded_tok, "s", [QUESTION], ids(padded_tok, "Paris"), "Paris",
                      [{"role": "user", "content": "Thanks!"}])
    assert p.cause == "template_not_append_only" and p.continues is None
    rec.record(p, [sampled(padded_tok, ids(padded_tok, "sunny"))], [split_action("sunny", "c", 0)])
    assert causes(rec) == {"template_not_append_only": 1} and len(rec.segments("s")) == 2


def test_sampled_ids_the_render_does_not_reproduce_count_retokenization_drift(padded_tok) -> None:
    rec = SessionRecorder(padded_tok)
    spelled = padded_tok.convert_tokens_to_ids(["P", "a", "r", "i", "s"])
    p1, p = _two_turns(rec, padded_tok, "s", [SYSTEM, QUESTION], spelled, "Paris",
                       [{"role": "user", "content": "Thanks!"}])
    assert p.cause == "retokenization_drift" and p.prompt_ids[:len(p1.prompt_ids)] == p1.prompt_ids
    rec.record(p, [sampled(padded_tok, ids(padded_tok, "sunny"))], [split_action("sunny", "c", 0)])
    assert causes(rec) == {"retokenization_drift": 1} and len(rec.segments("s")) == 2


def test_a_full_render_that_extends_the_tokens_stays_in_the_segment(padded_tok) -> None:
    rec = SessionRecorder(padded_tok)
    p1, p = _two_turns(rec, padded_tok, "s", [SYSTEM, QUESTION], ids(padded_tok, "Paris"), "Paris",
                       [{"role": "user", "content": "Thanks!"}])
    assert p.continues == 0 and p.by_render and p.cause is None
    rec.record(p, [sampled(padded_tok, ids(padded_tok, "sunny"))], [split_action("sunny", "c", 0)])
    [seg] = rec.segments("s")
    assert seg.trajectory.turns[0].observation_ids == ids(padded_tok, "\n<|im_start|>user\nThanks!<|im_end|>\n"
                                                                      "<|im_start|>assistant\n")
    assert rec.counters["stitched_by_render"] == 1 and causes(rec) == {}


def test_with_n_choices_the_one_the_client_continues_is_recorded(tok) -> None:
    rec = SessionRecorder(tok)
    p1 = rec.prepare("s", *client_request([QUESTION], n=3))
    texts = ["Paris", "Lyon", "Nice"]
    comps = [sampled(tok, ids(tok, t)) for t in texts]
    replies = [split_action(t, "chatcmpl-n", i) for i, t in enumerate(texts)]
    rec.record(p1, comps, replies)
    assert rec.segments("s")[0].trajectory.turns[0].text == "Paris"  # choice 0 until told otherwise
    follow = [QUESTION, echo(replies[1]), {"role": "user", "content": "Thanks!"}]
    p2 = rec.prepare("s", *client_request(follow))
    assert p2.continues == 1
    assert p2.prompt_ids[:len(p1.prompt_ids) + len(comps[1].token_ids)] == p1.prompt_ids + comps[1].token_ids
    rec.record(p2, [sampled(tok, ids(tok, "sunny"))], [split_action("sunny", "c", 0)])
    [seg] = rec.segments("s")
    assert [t.text for t in seg.trajectory.turns] == ["Lyon", "sunny"]
    assert seg.trajectory.turns[0].action_ids == comps[1].token_ids
    assert rec.counters["unchosen_choices"] == 2 and causes(rec) == {}


def test_two_requests_of_one_session_in_flight_open_a_segment_each(tok) -> None:
    rec = SessionRecorder(tok)
    a = rec.prepare("s", *client_request([QUESTION]))
    b = rec.prepare("s", *client_request([QUESTION]))
    rec.record(a, [sampled(tok, ids(tok, "Paris"))], [split_action("Paris", "a", 0)])
    rec.record(b, [sampled(tok, ids(tok, "Lyon"))], [split_action("Lyon", "b", 0)])
    assert [s.trajectory.turns[0].text for s in rec.segments("s")] == ["Paris", "Lyon"]
    assert causes(rec) == {"concurrent_requests": 1}


def test_sessions_end_close_and_list_idle_by_last_activity(tok) -> None:
    now = [100.0]
    rec = SessionRecorder(tok, clock=lambda: now[0])
    for sid in ("old", "new"):
        p = rec.prepare(sid, *client_request([QUESTION]))
        rec.record(p, [sampled(tok, ids(tok, "Paris"))], [split_action("Paris", sid, 0)])
        now[0] += 10.0
    assert rec.idle(older_than_s=15.0) == ["old"] and rec.idle(older_than_s=5.0) == ["old", "new"]
    rec.end("old")
    with pytest.raises(SessionEnded):
        rec.prepare("old", *client_request([QUESTION]))
    segments = rec.close("old")
    assert len(segments) == 1 and segments[0].trajectory.turns[0].text == "Paris"
    with pytest.raises(UnknownSession):
        rec.segments("old")
    assert session_id_for(None, None).startswith("req-") and session_id_for(None, "u1") == "u1"
    assert json.dumps(rec.counters)  # plain ints for metrics
