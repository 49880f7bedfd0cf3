"""Binary encoding of replay groups: msgpack structure, token arrays as packed buffers.

A group held in replay is mostly numbers (~80k token ids and log-probs for 16 rollouts x 8
turns); as JSON they cost a decimal rendering each way and pydantic re-parsing every digit,
which was most of the Redis store's time. A record here is::

    b"TRG" | format version (1 byte) | msgpack body

The body is the group's fields as msgpack maps keyed by field name (so a field added to the
schema is carried without touching this module), except that every ``list[int]`` and
``list[float]`` field of a model is one msgpack binary string: a type byte, then the values
little-endian, int32 when every id fits (int64 when one does not, a plain msgpack list past
that), float64 for floats. Which fields those are comes from the models' annotations.

Log-probs stay float64 on purpose: they are Python floats (IEEE doubles) in the Trajectory,
and a replay store must hand back exactly the group it was given (the in-process store does,
and the contract tests compare groups with ``==``). Rounding to float32 would lose nothing
the learner's float32 importance ratios can see, but it would make the two backends disagree
and change values that a resumed run or a JSONL dump compares against.

Readers accept older records too: a payload starting with ``{`` is the JSON of the
previous format (``Group.model_dump_json()``), and a zlib stream (first byte 0x78, which
neither ``{`` nor the magic is) is decompressed and then read by the same rules. The format
version byte lets a later layout be told apart; this build refuses any it does not know.
"""

from __future__ import annotations

import contextlib
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
FORMAT_VERSION = 1
HEADER = MAGIC + bytes([FORMAT_VERSION])

# The type code that starts a packed array, and the struct/array format of its values.
_INT32, _INT64, _FLOAT64 = 1, 2, 3
_FORMATS = {_INT32: "i", _INT64: "q", _FLOAT64: "d"}
assert [array(f).itemsize for f in _FORMATS.values()] == [4, 8, 8], "unexpected C type sizes"
_LITTLE_ENDIAN = sys.byteorder == "little"  # records are little-endian on every machine

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
    """The layout of a packed array of ``n`` values: its type code, then the values,
    little-endian. Packing through a compiled Struct is ~3x faster than array() (no
    per-item argument parsing); turns come in a few hundred distinct lengths."""
    return struct.Struct(f"<B{n}{_FORMATS[code]}")


def _pack(codes: tuple[int, ...], values: list[Any]) -> bytes | list[Any]:
    """``values`` as the first array type in ``codes`` that holds them all, else as is."""
    for code in codes:
        try:
            return _struct(code, len(values)).pack(code, *values)
        except struct.error:  # an id past int32 (or int64), or not a number at all
            continue
    return values  # written as a plain msgpack list: slower, never wrong


_INT_CODES, _FLOAT_CODES = (_INT32, _INT64), (_FLOAT64,)


def _tree(model: BaseModel) -> dict[str, Any]:
    """The model as a map of field name to value, numeric lists packed."""
    plan = _plan(type(model))
    out = dict(model.__dict__)  # a pydantic model's field values, in field order
    if out.keys() != plan.names:  # something else in __dict__ (a cached property): fields only
        out = {f.name: getattr(model, f.name) for f in plan.fields}
    for f in plan.packed:
        value = out[f.name]
        if f.kind == "ints":
            out[f.name] = _pack(_INT_CODES, value)
        elif f.kind == "floats":
            out[f.name] = _pack(_FLOAT_CODES, value)
        else:
            out[f.name] = [_tree(item) for item in value]
    return out


def _jsonable(value: Any) -> Any:
    """What msgpack cannot write itself (nested models such as ToolCall, and whatever a
    ``metadata`` dict holds) it writes as pydantic would render it in JSON."""
    return to_jsonable_python(value)


def encode_group(group: Group) -> bytes:
    """The group as a record (uncompressed); its length is what replay capacity counts.

    A group msgpack cannot hold (an integer past 64 bits in ``metadata``) is written as the
    JSON record of the previous format instead, which every reader accepts."""
    try:
        return HEADER + msgpack.packb(_tree(group), default=_jsonable)
    except (OverflowError, TypeError, ValueError):
        return group.model_dump_json().encode()


# -- decoding ------------------------------------------------------------------------------
def _unpack(packed: bytes | list[Any]) -> list[Any]:
    """A packed array's values (a list written plain comes back as it is)."""
    if not isinstance(packed, bytes):
        return packed
    fmt = _FORMATS.get(packed[0]) if packed else None
    if fmt is None:
        raise ValueError(f"replay record holds an array of type {packed[:1]!r}, which this "
                         "build does not write: a newer writer or a corrupt record")
    values = array(fmt)
    values.frombytes(memoryview(packed)[1:])  # array's tolist is ~2x memoryview's
    if not _LITTLE_ENDIAN:
        values.byteswap()
    return values.tolist()


def _build(cls: type[BaseModel], tree: dict[str, Any]) -> BaseModel:
    """The model from a decoded map, without validating again what the encoder wrote from a
    validated model: the packed arrays can only hold their type, and pydantic re-checking
    ~80k numbers a group would cost as much as the rest of decoding. Fields msgpack
    flattens (tuples, nested models) are validated back into their types."""
    plan = _plan(cls)
    for f in plan.restored:
        value = tree.get(f.name)
        if not value:
            continue  # absent (a field newer than the record), empty or None: as it is
        if f.kind == "models":
            tree[f.name] = [_build(f.model, item) for item in value]
        elif f.kind == "typed":
            tree[f.name] = f.adapter.validate_python(value)
        else:
            tree[f.name] = _unpack(value)
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


def _decode_binary(record: bytes) -> Group:
    version = record[len(MAGIC)]
    if version != FORMAT_VERSION:
        raise ValueError(f"replay record format {version} is newer than this build reads "
                         f"({FORMAT_VERSION}): upgrade the reader")
    tree = msgpack.unpackb(memoryview(record)[len(HEADER):],
                           strict_map_key=False)  # metadata dicts may have int keys
    return _build(Group, tree)


def decode_group(payload: bytes) -> Group:
    """A group from any record a replay store has written: binary, JSON, or either zlibbed."""
    return decode_groups([payload])[0]


def decode_groups(payloads: Iterable[bytes]) -> list[Group]:
    """``decode_group`` of each, with the cyclic garbage collector paused meanwhile.

    A group allocates ~1,200 lists, dicts and models holding ~80k numbers, none of them in a
    reference cycle; left on, the collector runs every 700 such allocations and walks every
    number of the lists made since, again at each older generation: measured ~3 ms a group,
    more than the decoding itself (msgpack's own documentation gives the same advice)."""
    with _gc_paused():
        return [_decode_one(payload) for payload in payloads]


def _decode_one(payload: bytes) -> Group:
    if payload[:1] == b"x":  # 0x78: a zlib stream; neither '{' nor the magic starts with it
        payload = zlib.decompress(payload)
    if payload[:len(MAGIC)] == MAGIC:
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
