"""The replay codec with array token fields beside the floor any list-field codec pays.

    .venv/bin/python bench/codec_floor.py [--quick] [--reps N]

Trajectories hold their token ids and log-probs as read-only numpy arrays
(rollout/token_array.py), so the codec (replay/codec.py) joins them into the record's two
columns and decodes each field as a view of its slice, making no Python number. A schema of
``list[int]`` / ``list[float]`` fields could not do that: whatever its encoding, it has to
turn every number of the record into a Python object on decode and back on encode. This bench
times, on bench/replay.py's realistic group (16 rollouts x 8 turns, ~78k numbers), in one run:

1. **the codec**, encode and decode;
2. **the list floor**: only packing the group's numbers from lists into one column
   (``struct.pack``, the fastest packing of a list) and only unpacking them into the lists the
   fields would hold (``tolist`` per field), nothing else: no list-field codec is faster;
3. **pickle**, which is how Ray carries a group between actors (rollout -> rewards -> replay):
   a round trip of the group as it is against the same group with list fields.

Everything runs with the cyclic collector paused, as ``replay.codec.decode_groups`` pauses it.
Each line gives milliseconds a group (best of ``--reps``) and the ratio of the two.
"""

from __future__ import annotations

import argparse
import gc
import pickle
import struct
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere

from replay.codec import decode_group, encode_group  # noqa: E402
from rollout.trajectory import Group, Trajectory, Turn  # noqa: E402


def best_ms(fns: tuple[Callable[[], Any], Callable[[], Any]], reps: int) -> tuple[float, float]:
    """Best milliseconds of each of two functions, run alternately (this machine's speed
    drifts from minute to minute)."""
    times: tuple[list[float], list[float]] = ([], [])
    for fn in fns:
        fn()  # warm: the codec builds its field plans once
    for _ in range(reps):
        for fn, out in zip(fns, times):
            start = time.perf_counter()
            fn()
            out.append(time.perf_counter() - start)
    return min(times[0]) * 1e3, min(times[1]) * 1e3


def numeric_fields(group: Group) -> tuple[list[list[int]], list[list[float]]]:
    """Every token-id field and log-prob field of ``group`` as the lists a list schema holds."""
    ids, lps = [], []
    for traj in group.trajectories:
        ids.append(traj.prompt_ids.tolist())
        for turn in traj.turns:
            ids += [turn.action_ids.tolist(), turn.observation_ids.tolist()]
            lps.append(turn.action_logprobs.tolist())
    return ids, lps


def list_pack(ids: list[list[int]], lps: list[list[float]]) -> bytes:
    flat_ids = [x for field in ids for x in field]
    flat_lps = [x for field in lps for x in field]
    return struct.pack(f"<{len(flat_ids)}i", *flat_ids) + struct.pack(f"<{len(flat_lps)}d", *flat_lps)


def list_unpack(columns: bytes, ids: list[list[int]], lps: list[list[float]]) -> list[list[Any]]:
    n_ids = sum(map(len, ids))
    views = (memoryview(columns)[:4 * n_ids].cast("i"), memoryview(columns)[4 * n_ids:].cast("d"))
    out = []
    for view, fields in zip(views, (ids, lps)):
        at = 0
        for field in fields:
            out.append(view[at:at + len(field)].tolist())
            at += len(field)
    return out


def with_list_fields(group: Group) -> Group:
    """``group`` with every numeric field a plain list, as the list schema held it (built
    without validation, which would turn them back into arrays)."""
    def turn(t: Turn) -> Turn:
        return Turn.model_construct(**{**t.__dict__, "action_ids": t.action_ids.tolist(),
                                       "action_logprobs": t.action_logprobs.tolist(),
                                       "observation_ids": t.observation_ids.tolist()})
    trajs = [Trajectory.model_construct(**{**tr.__dict__, "prompt_ids": tr.prompt_ids.tolist(),
                                           "turns": [turn(t) for t in tr.turns]})
             for tr in group.trajectories]
    return group.model_copy(update={"trajectories": trajs})


def pickle_round_trip(group: Group) -> Group:
    return pickle.loads(pickle.dumps(group, protocol=5))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--reps", type=int, default=30, help="timed repeats of each (best kept)")
    parser.add_argument("--quick", action="store_true", help="3 repeats (a smoke run)")
    args = parser.parse_args()
    if args.quick:
        args.reps = 3
    from bench.replay import make_groups

    group = make_groups(1)[0]
    record = encode_group(group)
    ids, lps = numeric_fields(group)
    columns = list_pack(ids, lps)
    listed = with_list_fields(group)
    assert list_unpack(columns, ids, lps) == ids + lps and decode_group(record) == group
    assert pickle_round_trip(group) == group == listed
    gc.disable()  # decoding pauses the collector (replay.codec.decode_groups); so does this
    try:
        rows = [("encode", *best_ms((lambda: encode_group(group), lambda: list_pack(ids, lps)), args.reps)),
                ("decode", *best_ms((lambda: decode_group(record),
                                     lambda: list_unpack(columns, ids, lps)), args.reps)),
                ("pickle round trip", *best_ms((lambda: pickle_round_trip(group),
                                                lambda: pickle_round_trip(listed)), args.reps))]
    finally:
        gc.enable()
    numbers = sum(map(len, ids + lps))
    print(f"one group: {len(group.trajectories)} rollouts, {numbers} numbers in {len(ids) + len(lps)} "
          f"fields, record {len(record) / 1e3:.0f} kB; best of {args.reps}")
    for side, codec_ms, floor_ms in rows:
        name = ("array fields", "list fields") if side.startswith("pickle") else ("codec", "list floor")
        print(f"  {side}: {name[0]} {codec_ms:6.2f} ms | {name[1]} {floor_ms:6.2f} ms | "
              f"{name[0]} / {name[1]} {codec_ms / floor_ms:5.2f}")
    total, floor = rows[0][1] + rows[1][1], rows[0][2] + rows[1][2]
    print(f"encode + decode: codec {total:.2f} ms, list floor {floor:.2f} ms, "
          f"codec / list floor {total / floor:.2f}")


if __name__ == "__main__":
    main()
