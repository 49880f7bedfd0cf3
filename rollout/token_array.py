"""Numeric fields of the trajectory schema: read-only numpy arrays that read like lists.

A group in replay holds ~78k token ids and log-probs. As Python lists each number is an object
that every hop builds again: Ray pickles them one by one, the replay codec packs and unpacks
them (~30 ns a number each way, more than Redis's whole share of a put and claim), and the
learner copies them into tensors. As arrays they cross each hop as one buffer: the replay codec
hands out views of the record it read (no copy), pickling sends the buffer, and the learner
concatenates them without touching a number in Python.

They still read like the lists they replace, so code written for lists stays right: ``len``,
indexing (a Python number), slicing, iterating (Python numbers), ``==`` against any sequence,
and ``+`` concatenating into a list (never numpy's elementwise addition). They never change in
place: build a new list and assign it (the models validate assignments back into arrays).
Pydantic validates lists, tuples and arrays into them and writes them as lists (JSON and
``model_dump``), so files and APIs see what they saw before.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any, ClassVar, SupportsIndex, overload

import numpy as np
from pydantic import GetCoreSchemaHandler
from pydantic_core import core_schema


class NumArray(Sequence):
    """A read-only 1-D array of numbers with list semantics (see the module docstring)."""

    __slots__ = ("array",)
    dtype: ClassVar[np.dtype]
    kinds: ClassVar[str]
    """numpy dtype kinds accepted on validation (``iu``: integers; ``iuf``: numbers)."""
    noun: ClassVar[str]
    json_item: ClassVar[core_schema.CoreSchema]

    def __init__(self, array: np.ndarray) -> None:
        """Wrap ``array`` (1-D, read-only) as it is: no check, no copy. ``of`` validates."""
        self.array = array

    @classmethod
    def of(cls, values: Any) -> "NumArray":
        """``values`` (a list, tuple, array or NumArray) as this class, checked and read-only;
        a ValueError names what is wrong."""
        if isinstance(values, cls):
            return values
        if isinstance(values, NumArray):
            values = values.array
        if isinstance(values, (str, bytes, dict)) or not isinstance(values, (Sequence, np.ndarray)):
            raise ValueError(f"expected a list of {cls.noun}, got {type(values).__name__}")
        array = np.array(values)  # a copy: a caller's array must not be frozen or aliased
        if array.size == 0:
            array = np.empty(0, cls.dtype)
        elif array.ndim != 1 or array.dtype.kind not in cls.kinds:
            raise ValueError(f"expected a flat list of {cls.noun}, got {cls._what(values, array)}")
        elif not np.can_cast(array.dtype, cls.dtype, "safe"):
            raise ValueError(f"expected {cls.noun} that fit {cls.dtype.name}, got {array.dtype.name}")
        return cls.frozen(array)

    @classmethod
    def frozen(cls, array: np.ndarray) -> "NumArray":
        """``array`` (1-D, of this class's dtype or narrower, owned by the caller) made
        read-only and wrapped without a copy."""
        array = array.astype(cls.dtype, copy=False)
        array.flags.writeable = False
        return cls(array)

    @classmethod
    def _what(cls, values: Any, array: np.ndarray) -> str:
        """What ``values`` held instead, for an error message."""
        if array.ndim != 1:
            return "nested lists"
        if all(type(v) is int for v in values):  # numpy fell back to float or object
            return f"integers past {cls.dtype.name}"
        return f"{array.dtype.name} values"

    def tolist(self) -> list[Any]:
        return self.array.tolist()

    def __len__(self) -> int:
        return len(self.array)

    @overload
    def __getitem__(self, index: SupportsIndex) -> Any: ...
    @overload
    def __getitem__(self, index: slice) -> "NumArray": ...
    def __getitem__(self, index: SupportsIndex | slice) -> Any:
        if isinstance(index, slice):
            return type(self)(self.array[index])
        return self.array[index].item()

    def __iter__(self) -> Iterator[Any]:
        return iter(self.array.tolist())

    def __add__(self, other: Any) -> list[Any]:
        if not isinstance(other, (list, tuple, NumArray)):
            return NotImplemented
        return self.tolist() + (other.tolist() if isinstance(other, NumArray) else list(other))

    def __radd__(self, other: Any) -> list[Any]:
        if not isinstance(other, (list, tuple)):
            return NotImplemented
        return list(other) + self.tolist()

    def __eq__(self, other: object) -> bool:
        if isinstance(other, NumArray):
            other = other.array
        elif not isinstance(other, (list, tuple, np.ndarray)):
            return NotImplemented
        return len(self.array) == len(other) and bool(np.array_equal(self.array, other))

    __hash__ = None  # type: ignore[assignment]  # equal to lists, which are unhashable

    def __repr__(self) -> str:
        return repr(self.tolist())

    def __array__(self, dtype: Any = None, copy: bool | None = None) -> np.ndarray:
        if copy:
            return np.array(self.array, dtype=dtype)
        return self.array if dtype is None else self.array.astype(dtype, copy=False)

    def __reduce__(self) -> tuple[Any, ...]:
        # The bytes whole, not number by number; and not the ndarray itself, whose generic
        # reduce costs more than a field's few hundred numbers (bench/codec_floor.py).
        return _unpickle, (type(self), self.array.dtype.str, self.array.tobytes())

    def __copy__(self) -> "NumArray":
        return self  # read-only: a copy is the same thing

    def __deepcopy__(self, memo: dict[int, Any]) -> "NumArray":
        return self

    @classmethod
    def __get_pydantic_core_schema__(cls, source: Any, handler: GetCoreSchemaHandler
                                     ) -> core_schema.CoreSchema:
        validate = core_schema.no_info_plain_validator_function(cls.of)
        return core_schema.json_or_python_schema(
            json_schema=core_schema.chain_schema([core_schema.list_schema(cls.json_item), validate]),
            python_schema=validate,
            serialization=core_schema.plain_serializer_function_ser_schema(cls.tolist),
        )


def _unpickle(cls: type[NumArray], dtype: str, data: bytes) -> NumArray:
    return cls(np.frombuffer(data, dtype))  # read-only: a view of immutable bytes


class IntArray(NumArray):
    """Token ids (int64 here; the replay codec stores them as int32 when they fit)."""

    __slots__ = ()
    dtype = np.dtype(np.int64)
    kinds = "iu"
    noun = "integers (token ids)"
    json_item = core_schema.int_schema()


class FloatArray(NumArray):
    """Log-probabilities and other reals, float64 (exactly the Python floats they came from)."""

    __slots__ = ()
    dtype = np.dtype(np.float64)
    kinds = "iuf"
    noun = "numbers"
    json_item = core_schema.float_schema()


NO_INTS, NO_FLOATS = IntArray.frozen(np.empty(0, np.int64)), FloatArray.frozen(np.empty(0))
"""Empty defaults (shared safely: nothing changes them in place)."""
