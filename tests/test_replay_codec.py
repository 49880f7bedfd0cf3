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
import numpy as np
import pytest
from pydantic import ValidationError

from envs.toolcalls import ToolCall
from replay import codec
from replay.codec import FORMAT_VERSION, HEADER, MAGIC, decode_group, decode_groups, encode_group
from replay.record import GroupRecord
from replay.redis_store import stored_payload
from rollout.token_array import FloatArray, IntArray
from rollout.trajectory import Group, Trajectory, Turn


def full_traj(tid: str, group_id: str = "g-é", lowest: float = -math.inf) -> Trajectory:
    """Every field of Trajectory and Turn set to something other than its default."""
    return Trajectory(
        trajectory_id=tid, task_id="task-✓", group_id=group_id,
        prompt_ids=[0, 1, 255, 256, 2**31 - 1, 151_643],
        turns=[
            Turn(action_ids=[10, 11, 12, 13], action_logprobs=[-0.5, -1e-300, -0.0, lowest],
                 policy_version=3, version_spans=[(0, 3), (2, 4)], adapter="run-é", observation_ids=[20, 21],
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


V1_HEADER = MAGIC + b"\x01"


def v1_tree(group: Group) -> dict:
    """The map a format-1 record held, as the previous build wrote it: each numeric field its
    own packed array (type byte, values little-endian; int32, int64 past that, a plain list
    past int64; float64)."""
    def ints(values: list[int]) -> bytes | list[int]:
        for code, fmt in ((1, "i"), (2, "q")):
            try:
                return bytes([code]) + struct.pack(f"<{len(values)}{fmt}", *values)
            except struct.error:
                continue
        return values

    tree = group.model_dump()
    for traj in tree["trajectories"]:
        traj["prompt_ids"] = ints(traj["prompt_ids"])
        for turn in traj["turns"]:
            turn["action_ids"], turn["observation_ids"] = ints(turn["action_ids"]), ints(turn["observation_ids"])
            turn["action_logprobs"] = b"\x03" + struct.pack(f"<{len(turn['action_logprobs'])}d",
                                                            *turn["action_logprobs"])
    return tree


def head_of(record: bytes) -> list:
    """A format-2 record's head: [int type, int count, float type, float count, tree]."""
    (size,) = struct.unpack_from("<I", record, len(HEADER))
    start = len(HEADER) + 4
    return msgpack.unpackb(record[start:start + size], strict_map_key=False)


def with_ids(ids: list[int]) -> Group:
    traj = Trajectory(trajectory_id="t", task_id="t", group_id="g", prompt_ids=[5, 6],
                      turns=[Turn(action_ids=ids, action_logprobs=[-1.0] * len(ids), policy_version=0)])
    return Group(group_id="g", task_id="t", trajectories=[traj])


def test_every_field_round_trips_exactly() -> None:
    group = full_group()
    back = decode_group(encode_group(group))
    assert back == group
    assert back.model_dump() == group.model_dump()
    assert back.model_dump_json() == group.model_dump_json()  # same fields, order and types
    turn = back.trajectories[0].turns[0]
    assert turn.version_spans == [(0, 3), (2, 4)] and isinstance(turn.version_spans[0], tuple)
    assert turn.adapter == "run-é" and back.trajectories[0].turns[1].adapter is None
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
    with pytest.raises(ValidationError, match="prompt_ids"):  # past int64: no token id is
        Trajectory(trajectory_id="t", task_id="t", group_id="g", prompt_ids=[2**70])


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
    assert GroupRecord.of(group).nbytes == len(record)
    assert len(record) < len(group.model_dump_json().encode())
    # the store writes the record as it is, or zlibbed; capacity counts the record either way
    assert stored_payload(GroupRecord.of(group), False) == record
    assert decode_group(stored_payload(GroupRecord.of(group), True)) == group


def test_a_newer_format_or_garbage_is_refused_clearly() -> None:
    record = bytearray(encode_group(full_group()))
    record[len(MAGIC)] = FORMAT_VERSION + 1
    with pytest.raises(ValueError, match=rf"format {FORMAT_VERSION + 1} is newer"):
        decode_group(bytes(record))
    with pytest.raises(ValueError, match="not a replay record"):
        decode_group(b"\x00garbage")
    tree = {"group_id": "g", "task_id": "t", "trajectories": [
        {"trajectory_id": "t", "task_id": "t", "group_id": "g", "prompt_ids": b"\x09abcd"}]}
    with pytest.raises(ValueError, match="array of type 9"):
        decode_group(V1_HEADER + msgpack.packb(tree))


def test_a_corrupt_record_is_refused_not_misread() -> None:
    record = encode_group(full_group())
    with pytest.raises(ValueError, match="corrupt replay record"):
        decode_group(record[:-8])  # one float short
    int_code, n_ints, float_code, n_floats, tree = head_of(record)
    tree["trajectories"][0]["prompt_ids"] -= 1  # the fields take one id fewer than held
    columns = record[len(HEADER) + 4 + struct.unpack_from("<I", record, len(HEADER))[0]:]
    head = msgpack.packb([int_code, n_ints, float_code, n_floats, tree])
    with pytest.raises(ValueError, match="take 25 ints but the record holds 26"):
        decode_group(HEADER + struct.pack("<I", len(head)) + head + columns)
    head = msgpack.packb([7, n_ints, float_code, n_floats, head_of(record)[4]])
    with pytest.raises(ValueError, match="array of type 7"):
        decode_group(HEADER + struct.pack("<I", len(head)) + head + columns)


def test_columns_hold_every_number_in_tree_order() -> None:
    group = full_group()
    record = encode_group(group)
    int_code, n_ints, float_code, n_floats, tree = head_of(record)
    trajs = group.trajectories
    ids = [x for t in trajs for x in t.prompt_ids
           + [y for u in t.turns for y in u.action_ids + u.observation_ids]]
    lps = [x for t in trajs for u in t.turns for x in u.action_logprobs]
    assert (int_code, n_ints, float_code, n_floats) == (1, len(ids), 3, len(lps))  # int32 ids
    first = tree["trajectories"][0]
    assert (first["prompt_ids"], first["turns"][0]["action_ids"], first["turns"][0]["action_logprobs"]) == (6, 4, 4)
    start = len(record) - 4 * n_ints - 8 * n_floats
    assert list(struct.unpack_from(f"<{n_ints}i", record, start)) == ids
    assert list(struct.unpack_from(f"<{n_floats}d", record, start + 4 * n_ints)) == lps


@pytest.mark.parametrize("ids, int_code", [
    ([2**31 - 1, -(2**31)], 1),  # int32 holds them
    ([2**31, -1], 2),  # one id past int32: the whole int column is int64
    ([2**63 - 1, -(2**63)], 2),
])
def test_int_column_widens(ids: list[int], int_code: int) -> None:
    group = with_ids(ids)
    record = encode_group(group)
    head = head_of(record)
    assert head[0] == int_code
    assert head[4]["trajectories"][0]["turns"][0]["action_ids"] == len(ids)
    assert head[1] == 2 + len(ids)  # prompt_ids [5, 6] come first in the column
    back = decode_group(record)
    assert back == group and back.trajectories[0].turns[0].action_ids == ids


def test_a_format_2_record_holding_a_plain_list_decodes() -> None:
    # The list-field build wrote a field whose ids fit no column (past int64) as a plain
    # msgpack list in the tree; one that fits is read back like any other.
    group = with_ids([7, 8])
    columns = codec._Columns()
    tree = codec._tree(group, columns)
    tree["trajectories"][0]["turns"][0]["action_ids"] = [7, 8]
    columns.ints = columns.ints[:1]  # the prompt's ids only
    assert decode_group(codec._assemble(tree, columns)) == group
    tree["trajectories"][0]["turns"][0]["action_ids"] = [2**63, 1]
    with pytest.raises(ValueError, match="integers past int64"):
        decode_group(codec._assemble(tree, columns))


def test_decoded_numbers_are_read_only_views_of_the_record() -> None:
    record = bytearray(encode_group(full_group()))  # the Redis store reads into bytearrays
    turn = decode_group(record).trajectories[0].turns[0]
    assert isinstance(turn.action_ids, IntArray) and isinstance(turn.action_logprobs, FloatArray)
    assert np.shares_memory(turn.action_ids.array, np.frombuffer(record, np.uint8))
    with pytest.raises(ValueError, match="read-only"):
        turn.action_ids.array[0] = 1


def test_a_group_without_numbers_round_trips() -> None:
    empty = Trajectory(trajectory_id="t", task_id="t", group_id="g", prompt_ids=[])
    group = Group(group_id="g", task_id="t", trajectories=[empty])
    record = encode_group(group)
    assert head_of(record)[:4] == [1, 0, 3, 0] and decode_group(record) == group


def test_format_1_records_still_decode() -> None:
    """Records the previous build wrote (held in Redis across the upgrade) read as before."""
    for group in (full_group(), with_ids([2**40, -1])):
        record = V1_HEADER + msgpack.packb(v1_tree(group))
        assert decode_group(record) == group
        assert decode_group(zlib.compress(record, 1)) == group
        assert decode_group(bytearray(record)) == group


def test_a_store_read_bytearray_decodes() -> None:
    # The Redis store reads long payloads into bytearrays (replay/redis_reads.py).
    group = full_group()
    assert decode_group(bytearray(encode_group(group))) == group
    assert decode_groups([bytearray(zlib.compress(encode_group(group), 1))]) == [group]


@pytest.mark.parametrize("writer", ["columns", "format 1"])
def test_a_record_missing_a_newer_field_gets_its_default(writer: str) -> None:
    # A record written before a field existed: the field takes its default.
    group = full_group()
    columns = codec._Columns()
    tree = codec._tree(group, columns) if writer == "columns" else v1_tree(group)
    for traj in tree["trajectories"]:
        del traj["metadata"]
        for turn in traj["turns"]:
            del turn["context_start"]
    record = (codec._assemble(tree, columns) if writer == "columns"
              else V1_HEADER + msgpack.packb(tree))
    back = decode_group(record)
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
