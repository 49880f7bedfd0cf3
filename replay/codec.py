"""Binary encoding of replay groups: msgpack structure, every number in two packed columns.

A group held in replay is mostly numbers (~78k token ids and log-probs for 16 rollouts x 8
turns); as JSON they cost a decimal rendering each way and pydantic re-parsing every digit,
which was most of the Redis store's time. A record here (format 2) is::

    b"TRG" | format version (1 byte) | head length (uint32 LE) | head | int column | float column

    head = msgpack [int type, int count, float type, float count, tree]

The tree is the group's fields as msgpack maps keyed by field name (so a field added to the
schema is carried without touching this module), except that each ``list[int]`` and
``list[float]`` field holds only its length: its values follow, in the order the tree is
walked, in the int column (int32 when every id of the group fits, else int64) or the float
column (float64), little-endian. Which fields those are comes from the models' annotations.
A field whose values fit neither column (an id past int64, something not a number) is written
as a plain msgpack list instead, in the tree; slower, never wrong.

Why two columns rather than one packed array per field (format 1): a group has ~400 numeric
fields, and per-field packing and unpacking cost ~1 us each in Python calls, plus msgpack
copying each array into and out of its buffer; one column is one ``struct`` call to write and
its values are sliced out of one buffer to read (bench/replay.py: encode ~1.2 -> ~0.85 ms a
group, decode ~10 % less).

Log-probs stay float64 on purpose: they are Python floats (IEEE doubles) in the Trajectory,
and a replay store must hand back exactly the group it was given (the in-process store does,
and the contract tests compare groups with ``==``). Rounding to float32 would lose nothing
the learner's float32 importance ratios can see, but it would make the two backends disagree
and change values that a resumed run or a JSONL dump compares against.

Readers accept every older record too: format 1 (msgpack with one packed array per numeric
field), a payload starting with ``{`` (the JSON written before, ``Group.model_dump_json()``),
and a zlib stream of any of them (first byte 0x78, which neither ``{`` nor the magic is). The
format version byte tells the binary layouts apart; a reader refuses one newer than it knows.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import gc
import struct
import sys
import threading
import types
import typing
import zlib
from array import array
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import msgpack
from pydantic import BaseModel, TypeAdapter
from pydantic_core import to_jsonable_python

from rollout.trajectory import Group

MAGIC = b"TRG"
FORMAT_VERSION = 2
HEADER = MAGIC + bytes([FORMAT_VERSION])
_V1 = 1  # one packed array per numeric field; still read
_HEAD_LEN = struct.Struct("<I")

# The type code of a packed array or column, and the struct/array format of its values.
_INT32, _INT64, _FLOAT64 = 1, 2, 3
_FORMATS = {_INT32: "i", _INT64: "q", _FLOAT64: "d"}
assert [array(f).itemsize for f in _FORMATS.values()] == [4, 8, 8], "unexpected C type sizes"
_LITTLE_ENDIAN = sys.byteorder == "little"  # records are little-endian on every machine
_INT_CODES, _FLOAT_CODES = (_INT32, _INT64), (_FLOAT64,)

Kind = typing.Literal["ints", "floats", "models", "typed", "plain"]


# -- field plans ---------------------------------------------------------------------------
@dataclass(frozen=True)
class _Field:
    """How one model field is written and read back."""

    name: str
    kind: Kind
    model: type[BaseModel] | None = None
    """``models``: the item class, walked field by field."""
    adapter: TypeAdapter[Any] | None = None
    """``typed``: restores what msgpack flattens (tuples, nested models) on the way back."""


@dataclass(frozen=True)
class _Plan:
    """A model class's fields, sorted by what the codec does with them (built once a class)."""

    fields: tuple[_Field, ...]
    packed: tuple[_Field, ...]
    """The fields encoding rewrites (numeric lists, lists of such models); the rest go to
    msgpack as they are."""
    restored: tuple[_Field, ...]
    """The fields decoding rewrites: ``packed`` plus the ``typed`` ones."""
    names: frozenset[str]
    plain_init: bool
    """No private attributes and no post-init hook: an instance is its ``__dict__`` and
    fields-set, which ``_construct`` sets directly (``model_construct`` minus its per-field
    alias and default handling, which a complete record does not need)."""


@functools.cache
def _plan(cls: type[BaseModel]) -> _Plan:
    """How each field of ``cls`` is written, from its annotation: numeric lists packed, lists
    of models that hold numeric lists walked, the rest left to msgpack."""
    fields = tuple(_field(name, info.annotation) for name, info in cls.model_fields.items())
    packed = tuple(f for f in fields if f.kind != "plain" and f.kind != "typed")
    restored = tuple(f for f in fields if f.kind != "plain")
    plain_init = not cls.__private_attributes__ and cls.__pydantic_post_init__ is None
    return _Plan(fields, packed, restored, frozenset(f.name for f in fields), plain_init)


def _field(name: str, annotation: Any) -> _Field:
    if typing.get_origin(annotation) is list:
        (item,) = typing.get_args(annotation)
        if item is int:
            return _Field(name, "ints")
        if item is float:
            return _Field(name, "floats")
        if isinstance(item, type) and issubclass(item, BaseModel) and _packs(item):
            return _Field(name, "models", model=item)
    if _msgpack_native(annotation):
        return _Field(name, "plain")
    return _Field(name, "typed", adapter=TypeAdapter(annotation))


def _packs(cls: type[BaseModel]) -> bool:
    """Whether ``cls`` (or a model nested in it) has a numeric list worth packing."""
    return bool(_plan(cls).packed)


_NATIVE_LEAVES = (str, int, float, bool, type(None), bytes, Any)
_NATIVE_CONTAINERS = (list, dict, typing.Union, types.UnionType)


def _msgpack_native(annotation: Any) -> bool:
    """True when msgpack gives back exactly the value pydantic validated (str, numbers,
    lists, dicts, unions and literals of those); tuples, sets and models come back as lists
    and dicts, so those fields are validated again on the way back."""
    if annotation in _NATIVE_LEAVES:
        return True
    origin = typing.get_origin(annotation)
    if origin is typing.Literal:
        return True
    return origin in _NATIVE_CONTAINERS and all(_msgpack_native(a) for a in typing.get_args(annotation))


# -- encoding ------------------------------------------------------------------------------
@functools.lru_cache(maxsize=4096)
def _struct(code: int, n: int) -> struct.Struct:
    """The layout of ``n`` values of type ``code``, little-endian. Packing through a compiled
    Struct is ~2x faster than array() (no per-item argument parsing)."""
    return struct.Struct(f"<{n}{_FORMATS[code]}")


def _packed(code: int, values: list[Any]) -> bytes | None:
    """``values`` as a column of type ``code``, or None when one does not fit it."""
    try:
        return _struct(code, len(values)).pack(*values)
    except (struct.error, OverflowError):  # an id past int32 (or int64), or not a number
        return None


@dataclass
class _Columns:
    """The numbers of one record, gathered while its tree is written."""

    checked: bool
    """Test each field before taking it (the slow path, after a whole column did not fit):
    a field that fits no column type stays in the tree as a plain list."""
    ints: list[Any] = dataclasses.field(default_factory=list)
    floats: list[Any] = dataclasses.field(default_factory=list)

    def take(self, kind: Kind, values: list[Any]) -> int | list[Any]:
        """What the tree holds for a numeric field: its length, its values joining a column."""
        codes = _INT_CODES if kind == "ints" else _FLOAT_CODES
        if self.checked and _packed(codes[-1], values) is None:
            return list(values)
        (self.ints if kind == "ints" else self.floats).extend(values)
        return len(values)


def _tree(model: BaseModel, columns: _Columns) -> dict[str, Any]:
    """The model as a map of field name to value, numeric lists moved to ``columns``."""
    plan = _plan(type(model))
    out = dict(model.__dict__)  # a pydantic model's field values, in field order
    if out.keys() != plan.names:  # something else in __dict__ (a cached property): fields only
        out = {f.name: getattr(model, f.name) for f in plan.fields}
    for f in plan.packed:
        value = out[f.name]
        if f.kind == "models":
            out[f.name] = [_tree(item, columns) for item in value]
        else:
            out[f.name] = columns.take(f.kind, value)
    return out


def _jsonable(value: Any) -> Any:
    """What msgpack cannot write itself (nested models such as ToolCall, and whatever a
    ``metadata`` dict holds) it writes as pydantic would render it in JSON."""
    return to_jsonable_python(value)


def _column(codes: tuple[int, ...], values: list[Any]) -> tuple[int, bytes] | None:
    """The first column type in ``codes`` that holds every value, and the packed column."""
    for code in codes:
        if (packed := _packed(code, values)) is not None:
            return code, packed
    return None


def _record(group: Group, checked: bool) -> bytes | None:
    """The format-2 record, or None when a column does not fit (then retry ``checked``)."""
    columns = _Columns(checked)
    return _assemble(_tree(group, columns), columns)


def _assemble(tree: dict[str, Any], columns: _Columns) -> bytes | None:
    """Header, head and the two packed columns, joined in one copy."""
    ints, floats = _column(_INT_CODES, columns.ints), _column(_FLOAT_CODES, columns.floats)
    if ints is None or floats is None:
        return None
    head = msgpack.packb([ints[0], len(columns.ints), floats[0], len(columns.floats), tree],
                         default=_jsonable)
    return b"".join((HEADER, _HEAD_LEN.pack(len(head)), head, ints[1], floats[1]))


def encode_group(group: Group) -> bytes:
    """The group as a record (uncompressed); its length is what replay capacity counts.

    A group msgpack cannot hold (an integer past 64 bits in ``metadata``) is written as the
    JSON record of the previous format instead, which every reader accepts."""
    try:
        return _record(group, checked=False) or _record(group, checked=True)
    except (OverflowError, TypeError, ValueError):
        return group.model_dump_json().encode()


# -- decoding ------------------------------------------------------------------------------
def _format(code: Any) -> str:
    fmt = _FORMATS.get(code)
    if fmt is None:
        raise ValueError(f"replay record holds an array of type {code!r}, which this build "
                         "does not write: a newer writer or a corrupt record")
    return fmt


def _values(code: Any, data: memoryview) -> memoryview | array:
    """A column's values, sliceable and with ``tolist()``: a view of the record where the
    machine is little-endian (no copy), else a byte-swapped copy."""
    fmt = _format(code)
    if len(data) % struct.calcsize("<" + fmt):
        raise ValueError(f"corrupt replay record: {len(data)} bytes of {fmt!r} values")
    if _LITTLE_ENDIAN:
        return data.cast(fmt)
    values = array(fmt)
    values.frombytes(data)
    values.byteswap()
    return values


class _ColumnReader:
    """Hands out a format-2 record's column values to its numeric fields, in tree order."""

    def __init__(self, ints: memoryview | array, floats: memoryview | array) -> None:
        self._columns = {"ints": ints, "floats": floats}
        self._next = {"ints": 0, "floats": 0}

    def take(self, kind: Kind, held: int | list[Any]) -> list[Any]:
        if type(held) is not int:
            return held  # a field written as a plain list
        start = self._next[kind]
        self._next[kind] = start + held
        return self._columns[kind][start:start + held].tolist()

    def check_used_up(self) -> None:
        """Every value handed out, none missing: anything else is a corrupt record."""
        for kind, column in self._columns.items():
            if self._next[kind] != len(column):
                raise ValueError(f"corrupt replay record: its fields take {self._next[kind]} "
                                 f"{kind} but the record holds {len(column)}")


class _InlineReader:
    """Format 1: each numeric field is its own packed array (or a plain list)."""

    @staticmethod
    def take(kind: Kind, held: bytes | list[Any]) -> list[Any]:
        if not isinstance(held, bytes):
            return held
        code = held[0] if held else None
        return _values(code, memoryview(held)[1:]).tolist()

    @staticmethod
    def check_used_up() -> None:
        pass


Reader = _ColumnReader | _InlineReader


def _build(cls: type[BaseModel], tree: dict[str, Any], reader: Reader) -> BaseModel:
    """The model from a decoded map, without validating again what the encoder wrote from a
    validated model: the columns can only hold their type, and pydantic re-checking ~78k
    numbers a group would cost as much as the rest of decoding. Fields msgpack flattens
    (tuples, nested models) are validated back into their types."""
    plan = _plan(cls)
    for f in plan.restored:
        value = tree.get(f.name)
        if f.kind == "ints" or f.kind == "floats":
            if value is not None:  # None: a field newer than the record keeps its default
                tree[f.name] = reader.take(f.kind, value)
        elif not value:
            continue  # absent, empty or None: as it is
        elif f.kind == "models":
            tree[f.name] = [_build(f.model, item, reader) for item in value]
        else:
            tree[f.name] = f.adapter.validate_python(value)
    return _construct(cls, plan, tree)


def _construct(cls: type[BaseModel], plan: _Plan, values: dict[str, Any]) -> BaseModel:
    if not (plan.plain_init and values.keys() == plan.names):
        # A record from another schema version (a field missing or gone): defaults and all.
        return cls.model_construct(**values)
    model = cls.__new__(cls)
    object.__setattr__(model, "__dict__", values)
    object.__setattr__(model, "__pydantic_fields_set__", set(values))
    object.__setattr__(model, "__pydantic_extra__", None)
    object.__setattr__(model, "__pydantic_private__", None)
    return model


def _unpack_tree(data: memoryview) -> Any:
    return msgpack.unpackb(data, strict_map_key=False)  # metadata dicts may have int keys


def _decode_binary(record: bytes | bytearray) -> Group:
    version = record[len(MAGIC)]
    view = memoryview(record)
    if version == _V1:
        reader: Reader = _InlineReader()
        tree = _unpack_tree(view[len(HEADER):])
    elif version == FORMAT_VERSION:
        reader, tree = _split_columns(view)
    else:
        raise ValueError(f"replay record format {version} is newer than this build reads "
                         f"({FORMAT_VERSION}): upgrade the reader")
    group = _build(Group, tree, reader)
    reader.check_used_up()
    return group


def _split_columns(view: memoryview) -> tuple[_ColumnReader, dict[str, Any]]:
    """A format-2 record's tree and a reader over its two columns."""
    start = len(HEADER) + _HEAD_LEN.size
    if len(view) < start:
        raise ValueError(f"corrupt replay record: {len(view)} bytes, shorter than its header")
    (head_len,) = _HEAD_LEN.unpack_from(view, len(HEADER))
    int_code, n_ints, float_code, n_floats, tree = _unpack_tree(view[start:start + head_len])
    ints_at = start + head_len
    floats_at = ints_at + n_ints * struct.calcsize("<" + _format(int_code))
    end = floats_at + n_floats * struct.calcsize("<" + _format(float_code))
    if end != len(view):
        raise ValueError(f"corrupt replay record: {len(view)} bytes, but its head says "
                         f"{n_ints} ints and {n_floats} floats end at byte {end}")
    ints, floats = _values(int_code, view[ints_at:floats_at]), _values(float_code, view[floats_at:])
    return _ColumnReader(ints, floats), tree


def decode_group(payload: bytes | bytearray) -> Group:
    """A group from any record a replay store has written: binary, JSON, or either zlibbed."""
    return decode_groups([payload])[0]


def decode_groups(payloads: Iterable[bytes | bytearray]) -> list[Group]:
    """``decode_group`` of each, with the cyclic garbage collector paused meanwhile.

    A group allocates ~1,200 lists, dicts and models holding ~78k numbers, none of them in a
    reference cycle; left on, the collector runs every 700 such allocations and walks every
    number of the lists made since, again at each older generation: measured ~3 ms a group,
    more than the decoding itself (msgpack's own documentation gives the same advice)."""
    with _gc_paused():
        return [_decode_one(payload) for payload in payloads]


def _decode_one(payload: bytes | bytearray) -> Group:
    if payload[:1] == b"x":  # 0x78: a zlib stream; neither '{' nor the magic starts with it
        payload = zlib.decompress(payload)
    if payload[:len(MAGIC)] == MAGIC and len(payload) > len(MAGIC):
        return _decode_binary(payload)
    if payload[:1] == b"{":
        return Group.model_validate_json(payload)
    raise ValueError(f"not a replay record: starts with {bytes(payload[:8])!r}")


_gc_lock = threading.Lock()
_gc_pausers = 0
_gc_was_enabled = False


@contextlib.contextmanager
def _gc_paused() -> Iterator[None]:
    """Collector off while any thread decodes; back on after the last one, and only if it
    was on before the first (a process that turned it off keeps it off)."""
    global _gc_pausers, _gc_was_enabled
    with _gc_lock:
        if _gc_pausers == 0:
            _gc_was_enabled = gc.isenabled()
            gc.disable()
        _gc_pausers += 1
    try:
        yield
    finally:
        with _gc_lock:
            _gc_pausers -= 1
            if _gc_pausers == 0 and _gc_was_enabled:
                gc.enable()


def encoded_size(group: Group) -> int:
    """Bytes a group counts toward ``capacity_bytes``: its uncompressed record's length."""
    return len(encode_group(group))
