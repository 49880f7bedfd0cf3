"""The replay record codec (replay/codec.py): exact round trips, old records, clear errors.

Speed is measured by bench/replay.py, never here.
"""

from __future__ import annotations

import datetime as dt
import gc
import math
import struct
import zlib

import msgpack
import pytest

from envs.toolcalls import ToolCall
from replay import codec
from replay.codec import FORMAT_VERSION, HEADER, MAGIC, decode_group, decode_groups, encode_group, encoded_size
from replay.redis_store import encode_group as store_encode
from rollout.trajectory import Group, Trajectory, Turn


def full_traj(tid: str, group_id: str = "g-é", lowest: float = -math.inf) -> Trajectory:
    """Every field of Trajectory and Turn set to something other than its default."""
    return Trajectory(
        trajectory_id=tid, task_id="task-✓", group_id=group_id,
        prompt_ids=[0, 1, 255, 256, 2**31 - 1, 151_643],
        turns=[
            Turn(action_ids=[10, 11, 12, 13], action_logprobs=[-0.5, -1e-300, -0.0, lowest],
                 policy_version=3, version_spans=[(0, 3), (2, 4)], observation_ids=[20, 21],
                 anchor_observation="obs «quoted» \n tab\t", invalid_action=True,
                 tool_calls=[ToolCall(name="search", arguments={"q": "naïve", "k": 3, "nested": [1, {"a": None}]})],
                 rewards={"outcome": 1.0, "ig": None, "prm": -0.25}, reward_versions={"ig": 2},
                 text="é€ 😀 <tool_call>", context_start=0),
            Turn(action_ids=[14], action_logprobs=[-2.718281828459045], policy_version=4,
                 context_start=1),
        ],
        gold_answers=["Paris", "パリ"], gold_tool_calls=[ToolCall(name="lookup")],
        answer="Paris", outcome=0.75, success=True, finish_reason="answer", error="timeout once",
        timings={"generate": 1.25, "env": 0.001},
        metadata={"seed": 7, "tags": ["a", "b"], "nested": {"x": [1.5, None, True]}, "ünï": "✓"},
    )


def full_group(lowest: float = -math.inf) -> Group:
    minimal = Trajectory(trajectory_id="t-min", task_id="task-✓", group_id="g-é", prompt_ids=[])
    trajs = [full_traj("t0", lowest=lowest), full_traj("t1", lowest=lowest), minimal]
    return Group(group_id="g-é", task_id="task-✓", trajectories=trajs)


def test_every_field_round_trips_exactly() -> None:
    group = full_group()
    back = decode_group(encode_group(group))
    assert back == group
    assert back.model_dump() == group.model_dump()
    assert back.model_dump_json() == group.model_dump_json()  # same fields, order and types
    turn = back.trajectories[0].turns[0]
    assert turn.version_spans == [(0, 3), (2, 4)] and isinstance(turn.version_spans[0], tuple)
    assert isinstance(turn.tool_calls[0], ToolCall)
    assert isinstance(back.trajectories[0].gold_tool_calls[0], ToolCall)


def test_logprobs_keep_every_bit() -> None:
    # float64 on purpose: the in-process store hands back the very floats it was given.
    lps = [-0.1, -1 / 3, -5e-324, -0.0, -math.inf, -1e308, -0.30000000000000004]
    group = Group(group_id="g", task_id="t", trajectories=[Trajectory(
        trajectory_id="t", task_id="t", group_id="g", prompt_ids=[1],
        turns=[Turn(action_ids=list(range(len(lps))), action_logprobs=lps, policy_version=0)])])
    back = decode_group(encode_group(group)).trajectories[0].turns[0].action_logprobs
    assert [struct.pack("<d", x) for x in back] == [struct.pack("<d", x) for x in lps]


def test_token_ids_past_int32_and_negative_round_trip() -> None:
    ids = [-1, 0, 2**31, 2**40, -(2**63)]  # int64 fallback for the whole array
    traj = Trajectory(trajectory_id="t", task_id="t", group_id="g", prompt_ids=ids)
    group = Group(group_id="g", task_id="t", trajectories=[traj])
    assert decode_group(encode_group(group)) == group
    huge = Group(group_id="g", task_id="t", trajectories=[traj.model_copy(update={"prompt_ids": [2**70]})])
    assert decode_group(encode_group(huge)) == huge  # past int64: written as a plain list


def test_metadata_msgpack_cannot_hold_is_rendered_as_json_would() -> None:
    when = dt.datetime(2026, 1, 2, 3, 4, 5)
    group = Group(group_id="g", task_id="t", trajectories=[Trajectory(
        trajectory_id="t", task_id="t", group_id="g", prompt_ids=[1],
        metadata={"when": when, "pair": (1, 2), "call": ToolCall(name="x")})])
    back = decode_group(encode_group(group))
    assert back.trajectories[0].metadata == {"when": "2026-01-02T03:04:05", "pair": [1, 2],
                                             "call": {"name": "x", "arguments": {}}}
    assert back == Group.model_validate_json(group.model_dump_json())  # what JSON gave before


def test_a_group_msgpack_cannot_encode_falls_back_to_json() -> None:
    group = Group(group_id="g", task_id="t", trajectories=[Trajectory(
        trajectory_id="t", task_id="t", group_id="g", prompt_ids=[1], metadata={"big": 2**70})])
    record = encode_group(group)
    assert record[:1] == b"{" and decode_group(record) == group


def test_old_json_records_still_decode() -> None:
    group = full_group(lowest=-1e30)  # JSON wrote -inf as null, which never read back
    old = group.model_dump_json().encode()  # what the store wrote before the binary format
    assert decode_group(old) == group
    assert decode_group(zlib.compress(old, 1)) == group  # compress: true, before
    assert decode_group(zlib.compress(encode_group(group), 1)) == group  # compress: true, now


def test_record_layout_and_bytes_accounting() -> None:
    group = full_group()
    record = encode_group(group)
    assert record[:len(MAGIC)] == MAGIC and record[len(MAGIC)] == FORMAT_VERSION
    assert encoded_size(group) == len(record)
    assert len(record) < len(group.model_dump_json().encode())
    # capacity counts the uncompressed record whether or not the payload is compressed
    assert store_encode(group, True)[1] == store_encode(group, False)[1] == len(record)
    assert store_encode(group, False)[0] == record


def test_a_newer_format_or_garbage_is_refused_clearly() -> None:
    record = bytearray(encode_group(full_group()))
    record[len(MAGIC)] = FORMAT_VERSION + 1
    with pytest.raises(ValueError, match=rf"format {FORMAT_VERSION + 1} is newer"):
        decode_group(bytes(record))
    with pytest.raises(ValueError, match="not a replay record"):
        decode_group(b"\x00garbage")
    tree = {"group_id": "g", "task_id": "t", "trajectories": [
        {"trajectory_id": "t", "task_id": "t", "group_id": "g", "prompt_ids": b"\x09abcd"}]}
    with pytest.raises(ValueError, match="array of type"):
        decode_group(HEADER + msgpack.packb(tree))


def test_a_record_missing_a_newer_field_gets_its_default() -> None:
    # A record written before a field existed: the field takes its default.
    group = full_group()
    tree = codec._tree(group)
    for traj in tree["trajectories"]:
        del traj["metadata"]
        for turn in traj["turns"]:
            del turn["context_start"]
    back = decode_group(HEADER + msgpack.packb(tree, default=codec._jsonable))
    assert back.trajectories[0].metadata == {} and back.trajectories[0].turns[1].context_start == 0
    assert back.trajectories[0].turns[0] == group.trajectories[0].turns[0]


def test_decoding_restores_the_collectors_state() -> None:
    record = encode_group(full_group())
    assert gc.isenabled()
    decode_groups([record, record])
    assert gc.isenabled()
    gc.disable()
    try:
        decode_group(record)
        assert not gc.isenabled()  # a process that turned it off keeps it off
    finally:
        gc.enable()
