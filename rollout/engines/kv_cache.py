"""A KV cache for the HF engine whose layers grow in place instead of by concatenation.

transformers' ``DynamicLayer`` appends a decoding step's keys and values with ``torch.cat``,
which copies the whole cache at every token: the cost of a step grows with the batch's width
(its longest row, left padding included) although the step adds one column. On the demo's
model (4 layers of 128 wide) that copy was 61% of a decoding step's CPU time at 29 rows x 300
columns (torch profiler), and continuous batching makes batches exactly that: many rows,
padded to the longest. ``GrowingLayer`` keeps each tensor in a buffer with room to spare and
writes new columns into it; what the model and the engine see is a view of the filled part,
so every reader (attention, ``batch_select_indices``, the engine's own row surgery) works as
on a dynamic layer. A buffer grows by half its size (at least ``_MIN_ROOM`` columns) when full,
so the copies left are amortised: a few per row instead of one per token.

Writes only ever go past the filled part, so a view handed out earlier never changes. A
tensor assigned to ``keys``/``values`` from outside becomes the buffer as it is, full; the next
step moves it to a roomier one. The engine's row surgery goes through ``select_rows`` and
``append_rows`` instead, which copy each buffer once and keep room in it: done with
transformers' calls and ``torch.cat``, a row leaving cost two copies of the whole cache (the
selection, then a roomier buffer at the next step) and a row joining four.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers.cache_utils import DynamicCache, DynamicLayer

_MIN_ROOM = 64
"""Columns of room a growing buffer gets at least: one row's worth of a typical turn, so a
fresh batch decodes without moving its cache again."""


def _capacity(columns: int) -> int:
    """Columns of a new buffer that must hold ``columns``: half again, at least ``_MIN_ROOM`` more."""
    return columns + max(_MIN_ROOM, columns // 2)


def _append(buf: torch.Tensor | None, used: int, new: torch.Tensor) -> tuple[torch.Tensor, int]:
    """``new``'s columns written after the first ``used`` of ``buf``: the buffer (the same one
    when it had room) and how many columns it now fills."""
    need = used + new.shape[-2]
    if buf is None or buf.dim() != 4 or need > buf.shape[-2] or buf.shape[:2] != new.shape[:2]:
        grown = new.new_empty((*new.shape[:2], _capacity(need), new.shape[-1]))
        if used:
            grown[:, :, :used] = buf[:, :, :used]
        buf = grown
    buf[:, :, used:need] = new
    return buf, need


def _filled(buf: torch.Tensor | None, used: int) -> torch.Tensor | None:
    # Before the first update DynamicLayer holds None or an empty 1-D tensor: handed back as is
    return buf if buf is None or buf.dim() != 4 else buf[:, :, :used]


def _length(tensor: torch.Tensor | None) -> int:
    return tensor.shape[-2] if tensor is not None and tensor.dim() == 4 else 0


class GrowingLayer(DynamicLayer):
    """A dynamic layer (``[batch, heads, kv, head_dim]``) that appends into spare room."""

    def __init__(self, **kwargs: Any) -> None:
        self._key_buf: torch.Tensor | None = None
        self._value_buf: torch.Tensor | None = None
        self._key_len = self._value_len = 0
        super().__init__(**kwargs)

    @property  # type: ignore[override]
    def keys(self) -> torch.Tensor | None:
        return _filled(self._key_buf, self._key_len)

    @keys.setter
    def keys(self, tensor: torch.Tensor | None) -> None:
        self._key_buf, self._key_len = tensor, _length(tensor)

    @property  # type: ignore[override]
    def values(self) -> torch.Tensor | None:
        return _filled(self._value_buf, self._value_len)

    @values.setter
    def values(self, tensor: torch.Tensor | None) -> None:
        self._value_buf, self._value_len = tensor, _length(tensor)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self._key_buf, self._key_len = _append(self._key_buf, self._key_len, key_states)
        self._value_buf, self._value_len = _append(self._value_buf, self._value_len, value_states)
        return self.keys, self.values  # type: ignore[return-value]

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        """Rows ``indices`` (repeats allowed), the spare room kept: one copy."""
        if self._key_buf is not None and self._key_buf.dim() == 4:
            self._key_buf, self._value_buf = self._key_buf[indices], self._value_buf[indices]

    def fill(self, keys: torch.Tensor, values: torch.Tensor, used: int) -> None:
        """Take ``keys`` and ``values`` as the buffers, their first ``used`` columns filled."""
        self._key_buf, self._value_buf, self._key_len, self._value_len = keys, values, used, used

    def drop_left(self, columns: int) -> None:
        """Forget the first ``columns`` columns (padding no row needs any more): a view, no
        copy, the room on the right kept."""
        self._key_buf, self._value_buf = self._key_buf[:, :, columns:], self._value_buf[:, :, columns:]
        self._key_len -= columns
        self._value_len -= columns


def select_rows(cache: DynamicCache, indices: torch.Tensor, drop_left: int = 0) -> None:
    """Keep rows ``indices`` of every layer (repeats allowed) and drop its first ``drop_left``
    columns."""
    for layer in cache.layers:
        layer.batch_select_indices(indices)
        if not drop_left:
            continue
        if isinstance(layer, GrowingLayer):
            layer.drop_left(drop_left)
        else:
            layer.keys, layer.values = layer.keys[:, :, drop_left:], layer.values[:, :, drop_left:]


def append_rows(cache: DynamicCache, other: DynamicCache) -> None:
    """``other``'s rows below ``cache``'s, the narrower of the two left-padded with zero
    columns (masked by the caller) to the wider's width: one copy, into a roomy buffer."""
    for mine, theirs in zip(cache.layers, other.layers):
        width = max(mine.keys.shape[-2], theirs.keys.shape[-2])
        columns = _capacity(width) if isinstance(mine, GrowingLayer) else width
        keys = _stacked(mine.keys, theirs.keys, width, columns)
        values = _stacked(mine.values, theirs.values, width, columns)
        if isinstance(mine, GrowingLayer):
            mine.fill(keys, values, width)
        else:
            mine.keys, mine.values = keys, values


def _stacked(top: torch.Tensor, bottom: torch.Tensor, width: int, columns: int) -> torch.Tensor:
    out = top.new_empty((top.shape[0] + bottom.shape[0], top.shape[1], columns, top.shape[-1]))
    for first, part in ((0, top), (top.shape[0], bottom)):
        rows, pad = slice(first, first + part.shape[0]), width - part.shape[-2]
        out[rows, :, :pad] = 0  # masked, but never garbage: a masked NaN still poisons attention
        out[rows, :, pad:width] = part
    return out


def growing_cache(config: Any) -> DynamicCache:
    """An empty cache for a model of ``config``: its plain dynamic layers growing in place
    (sliding-window and other special layers stay as transformers makes them)."""
    cache = DynamicCache(config=config)
    cache.layers = [GrowingLayer() if type(layer) is DynamicLayer else layer for layer in cache.layers]
    return cache
