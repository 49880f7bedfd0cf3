"""Reading replay records of format 1, which no build writes any more (``replay/codec.py``
writes format 2): a msgpack tree in which each numeric field is its own packed array (type
byte, then its values little-endian; int32, int64 past that, a plain list past int64;
float64), where format 2 gathers every field's numbers into two columns.

Kept because a Redis replay store or a run's spilled records may still hold such records
from before format 2. ``replay.codec`` imports this module only when it meets one.
"""

from __future__ import annotations

from typing import Any

# The codec's own parsing pieces: format 1 differs only in where a field's numbers are.
from replay.codec import HEADER, _Field, _unpack_tree, _values
from rollout.token_array import NumArray

FORMAT_1 = 1


class InlineReader:
    """Format 1: each numeric field is its own packed array (or a plain list)."""

    @staticmethod
    def take(f: _Field, held: bytes | list[Any]) -> NumArray:
        if not isinstance(held, bytes):
            return f.array.of(held)
        code = held[0] if held else None
        return f.array.of(_values(code, memoryview(held)[1:]))

    @staticmethod
    def check_used_up() -> None:
        pass  # no shared columns: nothing can be left over


def read_format_1(view: memoryview) -> tuple[InlineReader, dict[str, Any]]:
    """A format-1 record's tree and the reader its numeric fields are built with."""
    return InlineReader(), _unpack_tree(view[len(HEADER):])
