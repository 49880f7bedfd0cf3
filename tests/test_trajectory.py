"""The trajectory schema: token views, loss mask, JSONL round trip, clear errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from envs.toolcalls import ToolCall
from rollout.trajectory import AnswerScore, Group, LiveOrigin, Trajectory, Turn, read_jsonl, write_jsonl


def make_traj() -> Trajectory:
    # prompt [1,2,3] | turn0: action [10,11] obs [20,21,22] | turn1: action [12] (final answer)
    return Trajectory(
        trajectory_id="t0", task_id="task", group_id="g", prompt_ids=[1, 2, 3],
        turns=[
            Turn(action_ids=[10, 11], action_logprobs=[-0.5, -0.25], policy_version=3,
                 observation_ids=[20, 21, 22], anchor_observation="q",
                 tool_calls=[ToolCall(name="search", arguments={"query": "x"})], rewards={"env": 0.0}),
            Turn(action_ids=[12], action_logprobs=[-1.0], policy_version=4, anchor_observation="doc",
                 rewards={"outcome": 1.0, "ig": None}),
        ],
        gold_answers=["a"], outcome=1.0, success=True, finish_reason="answer",
    )


def test_token_views_follow_turns() -> None:
    traj = make_traj()
    assert traj.token_ids() == [1, 2, 3, 10, 11, 20, 21, 22, 12]
    # action tokens train; prompt and observation tokens carry no loss
    assert traj.loss_mask() == [0, 0, 0, 1, 1, 0, 0, 0, 1]
    assert traj.behaviour_logprobs() == [0, 0, 0, -0.5, -0.25, 0, 0, 0, -1.0]
    assert traj.turn_index() == [-1, -1, -1, 0, 0, 0, 0, 0, 1]
    assert traj.num_action_tokens() == 3
    assert traj.min_version() == 3


def test_group_version_is_oldest_turn() -> None:
    a, b = make_traj(), make_traj()
    b.turns[0].policy_version = 1
    assert Group(group_id="g", task_id="task", trajectories=[a, b]).min_version() == 1


def test_a_rollout_that_failed_before_acting_does_not_make_its_group_stale() -> None:
    """An episode whose engine died on its first request has no turns and no weights version:
    its group is as fresh as its other rollouts (a version 0 would get it refused as stale)."""
    good, failed = make_traj(), make_traj()
    failed.turns, failed.error, failed.finish_reason = [], "ActorDiedError: the engine died", "error"
    assert Group(group_id="g", task_id="task", trajectories=[good, failed]).min_version() == 3
    assert Group(group_id="g", task_id="task", trajectories=[failed]).min_version() == 0


def test_jsonl_round_trip_keeps_everything(tmp_path) -> None:
    path = tmp_path / "t.jsonl"
    assert write_jsonl(path, [make_traj(), make_traj()]) == 2
    back = list(read_jsonl(path))
    assert back[0] == make_traj()
    assert back[0].turns[1].rewards == {"outcome": 1.0, "ig": None}  # missing stays None, not 0


def test_bad_jsonl_line_names_line_and_field(tmp_path) -> None:
    good = make_traj().model_dump()
    bad = json.loads(json.dumps(good))
    bad["turns"][0]["action_logprobs"] = "oops"
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps(good) + "\n" + json.dumps(bad) + "\n")
    with pytest.raises(ValueError, match=r"bad.jsonl:2: field 'turns.0.action_logprobs'"):
        list(read_jsonl(path))


def test_misaligned_logprobs_rejected() -> None:
    with pytest.raises(ValueError, match="one behaviour log-prob per sampled token"):
        Turn(action_ids=[1, 2], action_logprobs=[-1.0], policy_version=0)


def test_unknown_schema_version_rejected() -> None:
    with pytest.raises(ValueError, match="schema_version 7 is not supported"):
        Trajectory(schema_version=7, trajectory_id="t", task_id="x", group_id="g", prompt_ids=[])


def windowed_traj(history_turns: int | None) -> Trajectory:
    # prompt [1,2] | t0: act [10] obs [20] | t1: act [11] obs [21] | t2: act [12] obs [22] | t3: act [13]
    from rollout.trajectory import window_start

    turns = [Turn(action_ids=[10 + t], action_logprobs=[-0.1 * (t + 1)], policy_version=0,
                  observation_ids=[20 + t] if t < 3 else [],
                  context_start=window_start(t, history_turns)) for t in range(4)]
    return Trajectory(trajectory_id="w", task_id="task", group_id="g", prompt_ids=[1, 2], turns=turns)


def test_history_window_splits_turns_into_the_contexts_they_were_sampled_from() -> None:
    from rollout.trajectory import Segment

    whole = windowed_traj(None)
    assert [t.context_start for t in whole.turns] == [0, 0, 0, 0]
    assert whole.segments() == [Segment(0, 0, 4)]  # one row: today's layout
    ids, owner = whole.row(whole.segments()[0])
    assert ids == whole.token_ids() and owner == [-1, -1, 0, -1, 1, -1, 2, -1, 3]

    # window of 1: turn t sees the prompt and turn t-1 only; turns 0 and 1 share a context
    win = windowed_traj(1)
    assert [t.context_start for t in win.turns] == [0, 0, 1, 2]
    assert win.segments() == [Segment(0, 0, 2), Segment(1, 2, 3), Segment(2, 3, 4)]
    rows = [win.row(s) for s in win.segments()]
    # the observation after a row's last action is left off (nothing trained attends to it)
    assert rows[0] == ([1, 2, 10, 20, 11], [-1, -1, 0, -1, 1])
    # turn 1's action is context for turn 2: attended, owned by no trained turn
    assert rows[1] == ([1, 2, 11, 21, 12], [-1, -1, -1, -1, 2])
    assert rows[2] == ([1, 2, 12, 22, 13], [-1, -1, -1, -1, 3])
    # each row is exactly what the engine was asked to continue, plus the trained action
    for t, turn in enumerate(win.turns):
        context = win.context_ids(turn.context_start, t)
        row_ids = next(r for s, r in zip(win.segments(), rows) if s.first <= t < s.stop)[0]
        assert row_ids[: len(context) + 1] == context + turn.action_ids

    # a window of 0 keeps only the prompt
    assert [win.row(s)[0] for s in windowed_traj(0).segments()][1] == [1, 2, 11]
    assert Trajectory(trajectory_id="e", task_id="t", group_id="g", prompt_ids=[1]).segments() == [Segment(0, 0, 0)]


def test_context_start_out_of_order_is_rejected_naming_the_turn() -> None:
    data = windowed_traj(1).model_dump()
    data["turns"][3]["context_start"] = 0  # before turn 2's start (1)
    with pytest.raises(ValueError, match=r"turns\.3\.context_start is 0"):
        Trajectory.model_validate(data)
    data["turns"][3]["context_start"] = 4  # after its own turn
    with pytest.raises(ValueError, match=r"turns\.3\.context_start is 4"):
        Trajectory.model_validate(data)


def test_a_schema_1_file_still_reads_and_travels(tmp_path) -> None:
    """A file written before version 2 (no ``version_spans``, ``schema_version`` 1; the
    fixture is the schema-1 model's own JSON of ``make_traj`` and a second rollout) reads with
    one weights version per turn, and travels through the replay codec unchanged."""
    from replay.codec import decode_group, encode_group

    path = Path(__file__).parent / "fixtures" / "trajectories" / "schema1.jsonl"
    assert all('"version_spans"' not in line for line in path.read_text().splitlines())
    a, b = list(read_jsonl(path))
    assert (a.schema_version, b.schema_version) == (1, 1)
    assert a.token_ids() == [1, 2, 3, 10, 11, 20, 21, 22, 12]
    assert a.loss_mask() == [0, 0, 0, 1, 1, 0, 0, 0, 1]
    # Every action token carries its turn's version: 3, 3 | 4; b's first turn was version 2.
    assert [t.versions() for t in a.turns] == [[3, 3], [4]]
    assert (a.min_version(), b.min_version()) == (3, 2)
    assert b.turns[1].rewards == {"outcome": 0.0, "ig": 0.25} and a.turns[1].rewards["ig"] is None
    group = Group(group_id="g", task_id="task", trajectories=[a, b])
    assert group.min_version() == 2
    assert decode_group(encode_group(group)) == group
    # Written back, it is still the same rollout (now with the default empty spans).
    assert write_jsonl(tmp_path / "again.jsonl", [a]) == 1
    assert list(read_jsonl(tmp_path / "again.jsonl")) == [a]


SCHEMA2 = Path(__file__).parent / "fixtures" / "trajectories" / "schema2.jsonl"
TYPED_IN_3 = ("producer", "worker", "labels", "answer_score", "reward_details", "reward_errors",
              "skipped_sources", "live")


def test_a_schema_2_file_reads_its_bookkeeping_into_typed_fields(tmp_path) -> None:
    """Version 2 kept components' bookkeeping in ``metadata`` (the fixture: a scheduled rollout
    and a live segment as version 2 wrote them). Read, it lands in the typed fields; the
    reward config the reward service used to stamp is dropped; a client's own key stays."""
    a, b = read_jsonl(SCHEMA2)
    assert (a.schema_version, a.producer, a.worker, a.labels) == (2, "rollout-1", 1, [1, 0])
    assert a.answer_score == AnswerScore(em=1.0, f1=1.0, well_formed=True)
    assert a.reward_errors == [{"source": "prm", "turns": [0], "error": "judge_timeout"}]
    assert a.reward_details == {"prm": {"judgements": [{"score": None, "raw": [], "error": "judge_timeout"}]}}
    assert a.metadata == {"client_tag": "kept"} and a.live is None
    assert b.live == LiveOrigin(session_id="conv", segment=1, feedback=True,
                                prejudged={0: {"score": 0.25, "raw": ["0.25"], "error": None}})
    assert (b.skipped_sources, b.metadata, b.producer, b.answer_score) == (["match"], {}, None, None)
    # Written back and read again: the same rollouts.
    assert write_jsonl(tmp_path / "again.jsonl", [a, b]) == 2
    assert list(read_jsonl(tmp_path / "again.jsonl")) == [a, b]


def test_a_schema_2_replay_record_reads_as_its_file_does() -> None:
    """Replay records of version-2 groups (the JSON record of before, and a format-2 binary
    record, which the codec builds without validation) upgrade as the file does."""
    from replay import codec
    from replay.codec import decode_group

    group = Group(group_id="g", task_id="task", trajectories=list(read_jsonl(SCHEMA2)))
    raw = [json.loads(line) for line in SCHEMA2.read_text().splitlines()]
    as_json = json.dumps({"group_id": "g", "task_id": "task", "trajectories": raw}).encode()
    assert decode_group(as_json) == group
    columns = codec._Columns()
    tree = codec._tree(group, columns)
    for traj, old in zip(tree["trajectories"], raw):  # the tree a version-2 writer made
        for name in TYPED_IN_3:
            del traj[name]
        traj["metadata"] = old["metadata"]
    back = decode_group(codec._assemble(tree, columns))
    assert back == group and back.trajectories[1].live.prejudged == {0: {"score": 0.25, "raw": ["0.25"],
                                                                         "error": None}}


def test_the_outcome_is_set_in_both_its_places() -> None:
    traj = make_traj()
    traj.turns[0].rewards["outcome"] = 0.5  # a stale slot on an earlier turn
    traj.set_outcome(1.0)
    assert traj.outcome == 1.0 and traj.turns[-1].rewards["outcome"] == 1.0
    assert all("outcome" not in t.rewards for t in traj.turns[:-1])
    traj.set_outcome(None)  # missing: None in both, never 0
    assert traj.outcome is None and traj.turns[-1].rewards["outcome"] is None
    empty = Trajectory(trajectory_id="e", task_id="t", group_id="g", prompt_ids=[1])
    empty.set_outcome(0.0)
    assert empty.outcome == 0.0 and empty.turns == []


def test_streamed_chunks_gather_into_a_completion_and_a_turn() -> None:
    """Chunks -> Completion (``Completion.take``, what the vLLM engine and the live gateway
    both use) -> Turn (``Turn.sampled``, what episodes and live sessions both use)."""
    from rollout.engines.base import Chunk, Completion

    comp = Completion.empty("r")
    for chunk in (Chunk("r", [5, 6], [-0.5, -0.25], 3), Chunk("r", [7], [-1.0], 3),
                  Chunk("r", [8], [-2.0], 4), Chunk("r", [], [], 4, "stop")):
        comp.take(chunk)
    assert (comp.token_ids, comp.logprobs) == ([5, 6, 7, 8], [-0.5, -0.25, -1.0, -2.0])
    assert (comp.version_spans, comp.finish_reason) == ([(0, 3), (3, 4)], "stop")  # v4 from token 3 on
    turn = Turn.sampled(comp, text="x")
    assert (turn.policy_version, turn.version_spans, turn.versions()) == (3, [(0, 3), (3, 4)], [3, 3, 3, 4])
    # Nothing sampled: the final chunk still names the version that served the request.
    empty = Completion.empty("e")
    empty.take(Chunk("e", [], [], 7, "length"))
    assert (empty.version_spans, empty.finish_reason) == ([(0, 7)], "length")
    one = Turn.sampled(Completion("o", [1], [-0.1], "stop", [(0, 2)]))
    assert (one.policy_version, one.version_spans, one.adapter) == (2, [], None)  # one version: no spans kept
    # A LoRA run's completion: the final chunk names the adapter, and the turn records it.
    lora = Completion.empty("l")
    for chunk in (Chunk("l", [5], [-0.5], 2, None, "run-a"), Chunk("l", [], [], 2, "stop", "run-a")):
        lora.take(chunk)
    assert Turn.sampled(lora).adapter == "run-a"
    assert turn.adapter is None  # the base model's
