"""Binary encoding of replay groups: a msgpack head, and every number in two packed columns.

A group held in replay is mostly numbers (~78k token ids and log-probs for 16 rollouts x 8
turns), held as numpy arrays (``rollout/token_array.py``). A record (format 2) is::

    b"TRG" | format version (1 byte) | head length (uint32 LE) | head | int column | float column

    head = msgpack [int type, int count, float type, float count, tree]

The tree is the group's fields as msgpack maps keyed by field name (so a field added to the
schema is carried without touching this module), except that each ``IntArray`` and
``FloatArray`` field holds only its length: its values follow, in the order the tree is walked,
in the int column (int32 when every id of the group fits, else int64) or the float column
(float64), little-endian. Which fields those are comes from the models' annotations.

Encoding joins the fields' arrays into the two columns (one copy each); decoding hands each
field a read-only view of its slice of the record (no copy, no Python number made): a group
costs its ~1,200 maps and models, not its ~78k numbers. Log-probs stay float64: they are the
engine's values exactly, and a replay store hands back exactly the group it was given (the
contract tests compare groups with ``==``).

Readers accept every older record too: format 1 (msgpack with one packed array per numeric
field; read by ``replay/legacy.py``), format 2 written from list fields (the same layout; a field whose values fit no column
held a plain list in the tree), a payload starting with ``{`` (the JSON written before,
``Group.model_dump_json()``), and a zlib stream of any of them (first byte 0x78, which neither
``{`` nor the magic is). The format version byte tells the binary layouts apart; a reader
refuses one newer than it knows. Trajectories of an older schema (``schema_version`` below 3)
are upgraded as they are read (``rollout.trajectory.upgrade_record``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import gc
import struct
import threading
import types
import typing
import zlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import msgpack
import numpy as np
from pydantic import BaseModel, TypeAdapter
from pydantic_core import to_jsonable_python

from rollout.token_array import IntArray, NumArray
from rollout.trajectory import Group, upgrade_record

MAGIC = b"TRG"
FORMAT_VERSION = 2
HEADER = MAGIC + bytes([FORMAT_VERSION])
_V1 = 1  # one packed array per numeric field; still read (replay/legacy.py)
_HEAD_LEN = struct.Struct("<I")

# The type code of a packed array or column, and the dtype of its values (little-endian on
# every machine).
_INT32, _INT64, _FLOAT64 = 1, 2, 3
_DTYPES = {_INT32: np.dtype("<i4"), _INT64: np.dtype("<i8"), _FLOAT64: np.dtype("<f8")}
_INT32_RANGE = np.iinfo(np.int32)

Kind = typing.Literal["ints", "floats", "models", "typed", "plain"]


# -- field plans ---------------------------------------------------------------------------
@dataclass(frozen=True)
class _Field:
    """How one model field is written and read back."""

    name: str
    kind: Kind
    model: type[BaseModel] | None = None
    """``models``: the item class, walked field by field."""
    array: type[NumArray] | None = None
    """``ints`` and ``floats``: the field's array class."""
    adapter: TypeAdapter[Any] | None = None
    """``typed``: restores what msgpack flattens (tuples, nested models) on the way back."""


@dataclass(frozen=True)
class _Plan:
    """A model class's fields, sorted by what the codec does with them (built once a class)."""

    fields: tuple[_Field, ...]
    packed: tuple[_Field, ...]
    """The fields encoding rewrites (numeric arrays, lists of models holding them); the rest
    go to msgpack as they are."""
    restored: tuple[_Field, ...]
    """The fields decoding rewrites: ``packed`` plus the ``typed`` ones."""
    names: frozenset[str]
    plain_init: bool
    """No private attributes and no post-init hook: an instance is its ``__dict__`` and
    fields-set, which ``_construct`` sets directly (``model_construct`` minus its per-field
    alias and default handling, which a complete record does not need)."""


@functools.cache
def _plan(cls: type[BaseModel]) -> _Plan:
    """How each field of ``cls`` is written, from its annotation: numeric arrays packed, lists
    of models that hold numeric arrays walked, the rest left to msgpack."""
    fields = tuple(_field(name, info.annotation) for name, info in cls.model_fields.items())
    packed = tuple(f for f in fields if f.kind != "plain" and f.kind != "typed")
    restored = tuple(f for f in fields if f.kind != "plain")
    plain_init = not cls.__private_attributes__ and cls.__pydantic_post_init__ is None
    return _Plan(fields, packed, restored, frozenset(f.name for f in fields), plain_init)


def _field(name: str, annotation: Any) -> _Field:
    if isinstance(annotation, type) and issubclass(annotation, NumArray):
        return _Field(name, "ints" if issubclass(annotation, IntArray) else "floats", array=annotation)
    if typing.get_origin(annotation) is list:
        (item,) = typing.get_args(annotation)
        if isinstance(item, type) and issubclass(item, BaseModel) and _packs(item):
            return _Field(name, "models", model=item)
    if _msgpack_native(annotation):
        return _Field(name, "plain")
    return _Field(name, "typed", adapter=TypeAdapter(annotation))


def _packs(cls: type[BaseModel]) -> bool:
    """Whether ``cls`` (or a model nested in it) has a numeric array to pack."""
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
@dataclass
class _Columns:
    """The numeric arrays of one record, gathered in tree order while its tree is written."""

    ints: list[np.ndarray] = dataclasses.field(default_factory=list)
    floats: list[np.ndarray] = dataclasses.field(default_factory=list)

    def take(self, f: _Field, values: Any) -> int:
        """What the tree holds for a numeric field: its length, its values joining a column."""
        if type(values) is not f.array:  # a model built without validation
            values = f.array.of(values)
        array = values.array
        (self.ints if f.kind == "ints" else self.floats).append(array)
        return len(array)

    def packed(self) -> tuple[int, np.ndarray, int, np.ndarray]:
        """(int type, int column, float type, float column), each column one array."""
        ints = np.concatenate(self.ints) if self.ints else np.empty(0, np.int64)
        fits = not len(ints) or (ints.min() >= _INT32_RANGE.min and ints.max() <= _INT32_RANGE.max)
        code = _INT32 if fits else _INT64
        floats = np.concatenate(self.floats) if self.floats else np.empty(0)
        return (code, ints.astype(_DTYPES[code], copy=False),
                _FLOAT64, floats.astype(_DTYPES[_FLOAT64], copy=False))


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
            out[f.name] = columns.take(f, value)
    return out


def _jsonable(value: Any) -> Any:
    """What msgpack cannot write itself (nested models such as ToolCall, and whatever a
    ``metadata`` dict holds) it writes as pydantic would render it in JSON."""
    return to_jsonable_python(value)


def _record(group: Group) -> bytes:
    """The format-2 record of ``group``."""
    columns = _Columns()
    return _assemble(_tree(group, columns), columns)


def _assemble(tree: dict[str, Any], columns: _Columns) -> bytes:
    """Header, head and the two columns, joined in one copy."""
    int_code, ints, float_code, floats = columns.packed()
    head = msgpack.packb([int_code, len(ints), float_code, len(floats), tree], default=_jsonable)
    return b"".join((HEADER, _HEAD_LEN.pack(len(head)), head, ints, floats))


def encode_group(group: Group) -> bytes:
    """The group as a record (uncompressed); its length is what replay capacity counts.

    A group msgpack cannot hold (an integer past 64 bits in ``metadata``) is written as the
    JSON record of the previous format instead, which every reader accepts."""
    try:
        return _record(group)
    except (OverflowError, TypeError):
        return group.model_dump_json().encode()


# -- decoding ------------------------------------------------------------------------------
def _dtype(code: Any) -> np.dtype:
    if code not in _DTYPES:
        raise ValueError(f"replay record holds an array of type {code!r}, which this build "
                         "does not write: a newer writer or a corrupt record")
    return _DTYPES[code]


def _values(code: Any, data: memoryview) -> np.ndarray:
    """A column's values: a read-only view of the record (a copy where the machine's byte
    order differs)."""
    dtype = _dtype(code)
    if len(data) % dtype.itemsize:
        raise ValueError(f"corrupt replay record: {len(data)} bytes of {dtype.name} values")
    values = np.frombuffer(data, dtype)
    values.flags.writeable = False  # a bytearray the store read into stays the group's alone
    return values


class _ColumnReader:
    """Hands out a format-2 record's column values to its numeric fields, in tree order."""

    def __init__(self, ints: np.ndarray, floats: np.ndarray) -> None:
        self.ints, self.floats = ints, floats
        self.next_int = self.next_float = 0  # attributes, not dicts: ~400 takes a group

    def take(self, f: _Field, held: int | list[Any]) -> NumArray:
        if type(held) is not int:
            return f.array.of(held)  # a field written as a plain list
        if f.kind == "ints":
            start = self.next_int
            self.next_int = end = start + held
            return f.array(self.ints[start:end])
        start = self.next_float
        self.next_float = end = start + held
        return f.array(self.floats[start:end])

    def check_used_up(self) -> None:
        """Every value handed out, none missing: anything else is a corrupt record."""
        for kind, used, column in (("ints", self.next_int, self.ints),
                                   ("floats", self.next_float, self.floats)):
            if used != len(column):
                raise ValueError(f"corrupt replay record: its fields take {used} "
                                 f"{kind} but the record holds {len(column)}")


if typing.TYPE_CHECKING:  # a reader of a record's numeric fields; format 1's is replay.legacy's
    from replay.legacy import InlineReader

    Reader = _ColumnReader | InlineReader


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
                tree[f.name] = reader.take(f, value)
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
    _set_fields_set(model, set(values))
    _set_extra(model, None)
    _set_private(model, None)
    return model


# BaseModel's slots, set through their descriptors: object.__setattr__ looks each name up again
_set_fields_set, _set_extra, _set_private = (
    vars(BaseModel)[name].__set__ for name in ("__pydantic_fields_set__", "__pydantic_extra__",
                                               "__pydantic_private__"))


def _unpack_tree(data: memoryview) -> Any:
    return msgpack.unpackb(data, strict_map_key=False)  # metadata dicts may have int keys


def _decode_binary(record: bytes | bytearray) -> Group:
    version = record[len(MAGIC)]
    view = memoryview(record)
    if version == _V1:
        from replay.legacy import read_format_1  # loaded only by a store holding old records

        reader, tree = read_format_1(view)
    elif version == FORMAT_VERSION:
        reader, tree = _split_columns(view)
    else:
        raise ValueError(f"replay record format {version} is newer than this build reads "
                         f"({FORMAT_VERSION}): upgrade the reader")
    # A record of an older trajectory schema: its bookkeeping moves out of metadata first
    # (rollout/trajectory.py), as validation does for JSON; _build does not validate.
    tree["trajectories"] = [upgrade_record(t) for t in tree.get("trajectories", ())]
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
    floats_at = ints_at + n_ints * _dtype(int_code).itemsize
    end = floats_at + n_floats * _dtype(float_code).itemsize
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

    A group allocates ~1,200 maps and models and ~400 array views, none of them in a reference
    cycle; left on, the collector runs every 700 such allocations and walks them again at each
    older generation: eight groups at a time decoded in ~1.3 ms a group paused against ~1.9
    left on (msgpack's own documentation gives the same advice)."""
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
