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
   the models rebuilt the way the codec rebuilds them (no validation). This is what the codec
   would cost if the schema carried arrays from the engine to the learner's tensors.

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
from pydantic import BaseModel

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere

from replay import codec  # noqa: E402
from replay.codec import decode_group, encode_group  # noqa: E402
from rollout.trajectory import Group  # noqa: E402

TYPECODES = {"ints": "i", "floats": "d"}  # int32 ids, float64 log-probs, as the codec's columns


def best_ms(fn: Callable[[], Any], reps: int) -> float:
    fn()  # warm: the codec builds its field plans once
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times) * 1e3


def walk(cls: type[BaseModel], obj: BaseModel | dict[str, Any], numeric: Callable[[str, Any], Any],
         build: Callable[[type[BaseModel], dict[str, Any]], Any] = lambda cls, fields: fields) -> Any:
    """``obj`` (a model or its field map) as a field map whose numeric fields are replaced by
    ``numeric(kind, value)``, nested models walked alike, in the codec's field order (its field
    plan says which fields are which); ``build(cls, fields)`` makes each level's result."""
    fields = dict(obj.__dict__ if isinstance(obj, BaseModel) else obj)
    for f in codec._plan(cls).packed:
        value = fields[f.name]
        fields[f.name] = ([walk(f.model, item, numeric, build) for item in value] if f.kind == "models"
                          else numeric(f.kind, value))
    return build(cls, fields)


# -- array fields: the record a schema with array token fields would write -------------------
def as_arrays(group: Group) -> dict[str, Any]:
    """The group as field maps whose numeric fields are arrays."""
    return walk(Group, group, lambda kind, values: array(TYPECODES[kind], values))


def array_encode(tree: dict[str, Any]) -> tuple[bytes, int, list[array]]:
    """The record (head: the tree, each numeric field replaced by its length; then the
    fields' buffers), the head's length and the buffers."""
    buffers: list[array] = []

    def cut(_: str, values: array) -> int:
        buffers.append(values)
        return len(values)

    head = msgpack.packb(walk(Group, tree, cut), default=lambda v: v.model_dump(mode="json"))
    return b"".join([head, *buffers]), len(head), buffers


def array_decode(record: bytes, head_len: int) -> Group:
    view, at = memoryview(record), head_len

    def take(kind: str, n: int) -> array:
        nonlocal at
        values = array(TYPECODES[kind])
        values.frombytes(view[at:at + n * values.itemsize])
        at += n * values.itemsize
        return values

    def build(cls: type[BaseModel], fields: dict[str, Any]) -> BaseModel:
        return codec._construct(cls, codec._plan(cls), fields)  # the codec's own model path

    return walk(Group, msgpack.unpackb(view[:head_len]), take, build)


def list_floor(buffers: list[memoryview]) -> list[list[Any]]:
    return [view.tolist() for view in buffers]


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
    tree = as_arrays(group)
    arr_record, head_len, arrays = array_encode(tree)
    buffers = [memoryview(values) for values in arrays]
    # the array record reads back to the same group: written again, it is the same bytes
    assert array_encode(as_arrays(array_decode(arr_record, head_len)))[0] == arr_record
    gc.disable()  # decoding pauses the collector (replay.codec.decode_groups); so does this
    try:
        rows = [("codec: encode", best_ms(lambda: encode_group(group), args.reps)),
                ("codec: decode", best_ms(lambda: decode_group(record), args.reps)),
                ("list floor: lists only", best_ms(lambda: list_floor(buffers), args.reps)),
                ("array fields: encode", best_ms(lambda: array_encode(tree), args.reps)),
                ("array fields: decode", best_ms(lambda: array_decode(arr_record, head_len), args.reps))]
    finally:
        gc.enable()
    base = {"encode": rows[0][1], "decode": rows[1][1]}
    numbers = sum(len(values) for values in arrays)
    print(f"one group: {len(group.trajectories)} rollouts, {numbers} numbers, record {len(record) / 1e3:.0f} kB "
          f"(array record {len(arr_record) / 1e3:.0f} kB); best of {args.reps}")
    for name, ms in rows:
        side = "encode" if "encode" in name else "decode"
        print(f"  {name:<26} {ms:7.2f} ms   {ms / base[side]:5.2f} x the codec's {side}")
    print(f"codec encode + decode {base['encode'] + base['decode']:.2f} ms; with array fields "
          f"{rows[3][1] + rows[4][1]:.2f} ms; the lists alone {rows[2][1]:.2f} ms")


if __name__ == "__main__":
    main()
