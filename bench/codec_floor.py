"""How fast a replay record could be encoded and decoded: the codec beside two floors.

    .venv/bin/python bench/codec_floor.py [--quick] [--reps N]

With the codec taken out, the Redis store runs at ~0.69 of raw pipelined writes
(``bench/replay.py``); with it, ~0.17. The goal of 0.5 leaves the codec about 1.4 ms a group.
This bench shows how much of that any codec can reach while trajectories hold ``list[int]`` and
``list[float]`` token fields, against records whose numeric fields are arrays, on
bench/replay.py's realistic group (16 rollouts x 8 turns, ~78k numbers), all in one run:

1. **the codec** (replay/codec.py), encode and decode;
2. **the list floor**: only turning the group's packed numbers into the Python lists its fields
   hold (``memoryview.tolist`` per field), and nothing else. No codec that hands back list
   fields decodes faster than this;
3. **array fields**: the same msgpack head (every field but the numbers), each numeric field
   its own buffer, written with one join and read back with one ``array.frombytes`` a field,
   the models rebuilt the way the codec rebuilds them (no validation). This is what the codec would cost if the
   schema carried arrays from the engine to the learner's tensors.

Decoding runs with the cyclic collector paused, as ``replay.codec.decode_groups`` does. Each
line gives milliseconds a group (best of ``--reps``), and its ratio to the codec.
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
from array import array
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgpack

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere

from replay import codec  # noqa: E402
from replay.codec import decode_group, encode_group  # noqa: E402
from rollout.trajectory import Group, Trajectory, Turn  # noqa: E402

INT_FIELDS = {Trajectory: ("prompt_ids",), Turn: ("action_ids", "observation_ids")}
FLOAT_FIELDS = {Turn: ("action_logprobs",)}


def best_ms(fn: Callable[[], Any], reps: int) -> float:
    fn()  # warm: the codec builds its field plans once
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times) * 1e3


def numeric_fields(group: Group) -> list[tuple[str, list[Any]]]:
    """Every numeric field of the group in tree order, with its typecode (int32 / float64)."""
    out = []
    for traj in group.trajectories:
        out.append(("i", traj.prompt_ids))
        for turn in traj.turns:
            out += [("i", turn.action_ids), ("d", turn.action_logprobs), ("i", turn.observation_ids)]
    return out


def list_floor(buffers: list[tuple[str, memoryview]]) -> list[list[Any]]:
    return [view.tolist() for _, view in buffers]


# -- array fields: the record a schema with array token fields would write -------------------
def as_arrays(group: Group) -> list[dict[str, Any]]:
    """The group's trajectories as field maps whose numeric fields are arrays."""
    trajs = []
    for traj in group.trajectories:
        fields = dict(traj.__dict__, prompt_ids=array("i", traj.prompt_ids))
        fields["turns"] = [dict(turn.__dict__, action_ids=array("i", turn.action_ids),
                                action_logprobs=array("d", turn.action_logprobs),
                                observation_ids=array("i", turn.observation_ids)) for turn in traj.turns]
        trajs.append(fields)
    return trajs


def array_encode(trajs: list[dict[str, Any]]) -> tuple[bytes, int]:
    """Head (the tree, each numeric field replaced by its length) and the fields' buffers."""
    buffers: list[array] = []

    def cut(values: array) -> int:
        buffers.append(values)
        return len(values)

    tree = []
    for fields in trajs:
        head = dict(fields, prompt_ids=cut(fields["prompt_ids"]))
        head["turns"] = [dict(t, action_ids=cut(t["action_ids"]), action_logprobs=cut(t["action_logprobs"]),
                              observation_ids=cut(t["observation_ids"])) for t in fields["turns"]]
        tree.append(head)
    head_bytes = msgpack.packb(tree, default=lambda v: v.model_dump(mode="json"))
    return b"".join([head_bytes, *buffers]), len(head_bytes)


def array_decode(record: bytes, head_len: int) -> list[Trajectory]:
    view, at = memoryview(record), head_len

    def take(n: int, code: str) -> array:
        nonlocal at
        values = array(code)
        values.frombytes(view[at:at + n * values.itemsize])
        at += n * values.itemsize
        return values

    def build(cls: type, fields: dict[str, Any]) -> Any:
        return codec._construct(cls, codec._plan(cls), fields)  # the codec's own model path

    out = []
    for fields in msgpack.unpackb(view[:head_len]):
        fields["prompt_ids"] = take(fields["prompt_ids"], "i")
        fields["turns"] = [build(Turn, dict(
            t, action_ids=take(t["action_ids"], "i"), action_logprobs=take(t["action_logprobs"], "d"),
            observation_ids=take(t["observation_ids"], "i"))) for t in fields["turns"]]
        out.append(build(Trajectory, fields))
    return out


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
    buffers = [(code, memoryview(array(code, values))) for code, values in numeric_fields(group)]
    trajs = as_arrays(group)
    arr_record, head_len = array_encode(trajs)
    numbers = sum(len(view) for _, view in buffers)
    gc.disable()  # decoding pauses the collector (replay.codec.decode_groups); so does this
    try:
        rows = [("codec: encode", best_ms(lambda: encode_group(group), args.reps)),
                ("codec: decode", best_ms(lambda: decode_group(record), args.reps)),
                ("list floor: lists only", best_ms(lambda: list_floor(buffers), args.reps)),
                ("array fields: encode", best_ms(lambda: array_encode(trajs), args.reps)),
                ("array fields: decode", best_ms(lambda: array_decode(arr_record, head_len), args.reps))]
    finally:
        gc.enable()
    codec = {"encode": rows[0][1], "decode": rows[1][1]}
    print(f"one group: {len(group.trajectories)} rollouts, {numbers} numbers, record {len(record) / 1e3:.0f} kB "
          f"(array record {len(arr_record) / 1e3:.0f} kB); best of {args.reps}")
    for name, ms in rows:
        side = "encode" if "encode" in name else "decode"
        print(f"  {name:<26} {ms:7.2f} ms   {ms / codec[side]:5.2f} x the codec's {side}")
    print(f"codec encode + decode {codec['encode'] + codec['decode']:.2f} ms; with array fields "
          f"{rows[3][1] + rows[4][1]:.2f} ms; the lists alone {rows[2][1]:.2f} ms")


if __name__ == "__main__":
    main()
