"""Row-batched caches: mlx-lm's batch protocol for our families, written once over row trees.

mlx-lm's ``BatchGenerator`` batches sequences by merging their caches
(``caches[0].merge(caches)``) into one cache of ``B`` left-padded rows, then
calls ``update_and_fetch``, ``make_mask``, ``prepare``/``finalize`` (right padding
during a prefill step), ``filter`` (rows that finished), ``extend`` (rows that
joined) and ``extract(row)`` (one row back as a single-sequence cache, e.g. to
keep or store it). mlx-lm implements that for raw rows only (``BatchKVCache``,
``BatchRotatingKVCache``); quantized caches cannot batch there, and its server
turns batching off under ``--kv-bits``.

Here the same arithmetic (step by step mlx-lm's, so a batch row attends to
exactly what it does in mlx-lm) runs over row *trees* (:mod:`kvstore.caches.base`):
a bare array for raw rows, ``(packed, scales, biases)`` for affine rows. So
each of our growing and windowed families batches, raw and affine:

===========================================  ======================================
batch class                                  signature
===========================================  ======================================
:class:`BatchKVCache`                        ``batch:kv:plain``
:class:`BatchQuantizedKVCache`               ``batch:kv:quant:{bits}:{group}``
:class:`BatchRotatingKVCache`                ``batch:kv:rotating-plain``
:class:`BatchRotatingQuantizedKVCache`       ``batch:kv:rotating-quant:{bits}:{group}``
===========================================  ======================================

A batch cache reports ``batch:`` plus its rows' family (the ``batch`` wrapper
family, :data:`BATCH_FAMILY`, registered with the built-ins: its state is no
single sequence's keys and values, so every predicate fails closed on it, and a
batch of a family no batch class serves does not exist); ``extract`` gives back
a cache of that family (which the store persists as any other), and ``merge``
of single caches (:func:`merge_caches`, which our single caches' ``merge``
calls) admits restored caches into a running batch. Windows batch with
``keep == 0`` (mlx-lm's batch ring has no sink tokens); TurboQuant caches do
not batch yet (they have no ``merge``, so mlx-lm serves them one at a time).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, cast

import mlx.core as mx
from mlx.utils import tree_map

from kvstore.caches.base import (
    BaseKVCache,
    Tree,
    batch_class_for,
    merge_caches,
    register_batch_class,
    row_leaves,
    tree_length,
    zeros_like_rows,
)
from kvstore.caches.mask import create_causal_mask
from kvstore.caches.packed import PackedRows, quantize_rows
from kvstore.caches.plain import PLAIN_FAMILY, KVCache
from kvstore.caches.quantized import QUANT_FAMILY, AffineRows, QuantizedKVCache
from kvstore.caches.rotating import (
    ROTATING_PLAIN_FAMILY,
    ROTATING_QUANT_FAMILY,
    RotatingKVCache,
    RotatingQuantizedKVCache,
)
from kvstore.errors import CapabilityError
from kvstore.family import Family, Quantization
from kvstore.signature import parse_signature

#: The ``batch`` wrapper: ``batch:<the rows' signature>``. Its state is several
#: sequences' rows, not one's keys and values, so predicates fail closed on it.
BATCH_FAMILY = Family(
    kind="batch",
    description="rows of several sequences in one cache (mlx-lm's batch protocol)",
    wraps=True,
    state="batch",
)

__all__ = [
    "BATCH_FAMILY",
    "BatchKVCache",
    "BatchQuantizedKVCache",
    "BatchRotatingKVCache",
    "BatchRotatingQuantizedKVCache",
    "merge_caches",
    "batch_class_for",
]


def _dynamic_roll(tree: Tree, shifts: mx.array) -> Tree:
    """Roll each row of every leaf right by its own shift along tokens (mlx-lm's)."""

    def roll(x: mx.array) -> mx.array:
        n = x.shape[2]
        idx = (mx.arange(n)[None, None, :, None] - shifts[:, None, None, None]) % n
        return mx.take_along_axis(x, mx.broadcast_to(idx, x.shape), axis=2)

    return tree_map(roll, tree)


def _ints(a: mx.array) -> list[int]:
    """A 1-D integer array's values."""
    return [int(x) for x in cast(list[Any], a.tolist())]


def _empty_rows(like: Tree, batch: int) -> Tree:
    """Rows of no tokens for ``batch`` rows, shaped like ``like``'s leaves."""
    return tree_map(lambda a: mx.zeros((batch, a.shape[1], 0, a.shape[3]), a.dtype), like)


def _pad_rows(tree: Tree, left: int, right: int) -> Tree:
    return tree_map(lambda a: mx.pad(a, [(0, 0), (0, 0), (left, right), (0, 0)]), tree)


def _cat(trees: Sequence[Tree], axis: int) -> Tree:
    return tree_map(lambda *leaves: mx.concatenate(list(leaves), axis=axis), *trees)


class _BatchRows(BaseKVCache):
    """What every batch cache shares: per-row ``offset`` and ``left_padding`` arrays."""

    left_padding: mx.array
    offset: mx.array  # type: ignore[assignment]  # per row, unlike a single cache's int
    _idx: int
    single: type  # the single-sequence class of the rows' family
    rows_family: Family  # the family of the rows (what extract gives back)

    def signature(self) -> str:
        return f"{BATCH_FAMILY.kind}:{self.inner_signature()}"

    def inner_signature(self) -> str:
        return self.rows_family.kind

    def new_single(self) -> Any:
        """An empty single-sequence cache of the rows' family (same parameters)."""
        return self.single()

    @classmethod
    def empty_batch(cls, template: Any, left_padding: list[int]) -> _BatchRows:
        """An empty batch cache for rows of ``template``'s family."""
        return cls(left_padding)  # type: ignore[call-arg]  # each family's own __init__

    def _init_rows(self, left_padding: Sequence[int]) -> None:
        self.keys = None
        self.values = None
        self.left_padding = mx.array(list(left_padding))
        self.offset = mx.array([-p for p in left_padding])
        self._idx = 0

    def _fill(self, pieces: Sequence[tuple[Tree | None, Tree | None, int]], length: int) -> None:
        """Rows ``pieces`` (keys, values, tokens) right-justified in ``length`` tokens."""
        ref = next((k, v) for k, v, n in pieces if k is not None and n > 0)
        batch = len(pieces)
        keys = tree_map(
            lambda a: mx.zeros((batch, a.shape[1], length, a.shape[3]), a.dtype), ref[0]
        )
        values = tree_map(
            lambda a: mx.zeros((batch, a.shape[1], length, a.shape[3]), a.dtype), ref[1]
        )
        for i, (k, v, n) in enumerate(pieces):
            if k is None or n == 0:
                continue
            p = length - n
            for buf, rows in zip(row_leaves((keys, values)), row_leaves((k, v))):
                buf[i : i + 1, :, p : p + n] = rows
        self.keys, self.values = keys, values

    @property
    def nbytes(self) -> int:
        if self.keys is None:
            return 0
        return sum(leaf.nbytes for leaf in row_leaves((self.keys, self.values)))

    def empty(self) -> bool:
        return self.keys is None


class _BatchGrowing(_BatchRows):
    """mlx-lm's ``BatchKVCache`` over row trees: rows grow in steps of 256."""

    def __init__(self, left_padding: Sequence[int]) -> None:
        self._init_rows(left_padding)
        self._right_padding: mx.array | None = None

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[Tree, Tree]:
        new_keys, new_values = self._encode_pair(keys, values)
        prev, steps = self._idx, keys.shape[2]
        if self.keys is None or prev + steps > tree_length(self.keys):
            grow = (self.step + steps - 1) // self.step * self.step
            fresh_k, fresh_v = zeros_like_rows(new_keys, grow), zeros_like_rows(new_values, grow)
            if self.keys is None:
                self.keys, self.values = fresh_k, fresh_v
            else:
                if prev % self.step != 0:
                    self.keys, self.values = tree_map(
                        lambda a: a[..., :prev, :], (self.keys, self.values)
                    )
                self.keys = _cat([self.keys, fresh_k], axis=2)
                self.values = _cat([self.values, fresh_v], axis=2)
        self.offset = self.offset + steps
        self._idx += steps
        for buf, new in zip(
            row_leaves((self.keys, self.values)), row_leaves((new_keys, new_values))
        ):
            buf[..., prev : self._idx, :] = new
        return self._present(*self.keys_and_values())

    def keys_and_values(self) -> tuple[Tree, Tree]:
        return tree_map(lambda a: a[..., : self._idx, :], (self.keys, self.values))

    def prepare(
        self,
        *,
        left_padding: Sequence[int] | None = None,
        lengths: Sequence[int] | None = None,
        right_padding: Sequence[int] | None = None,
    ) -> None:
        if left_padding is not None:
            if self.keys is not None:
                raise ValueError("[batch cache] Left padding can only be added to an empty batch.")
            pad = mx.array(list(left_padding))
            self.left_padding = self.left_padding + pad
            self.offset = self.offset - pad
        if right_padding is not None and max(right_padding) > 0:
            self._right_padding = mx.array(list(right_padding))

    def finalize(self) -> None:
        if self._right_padding is not None:
            pad = self._right_padding
            self.keys = _dynamic_roll(self.keys, pad)
            self.values = _dynamic_roll(self.values, pad)
            self.offset = self.offset - pad
            self.left_padding = self.left_padding + pad
            self._right_padding = None

    @property
    def state(self) -> tuple[Any, ...]:
        return self.keys, self.values, self.offset, self.left_padding, self._idx

    @state.setter
    def state(self, v: tuple[Any, ...]) -> None:
        self.keys, self.values, self.offset, self.left_padding, self._idx = v

    def is_trimmable(self) -> bool:
        return True

    def trim(self, n: int) -> int:
        n = min(self._idx, n)
        self._idx -= n
        self.offset = self.offset - n
        return n

    def size(self) -> int:
        return self._idx

    def make_mask(
        self, N: int, return_array: bool = False, window_size: int | None = None, **kwargs: Any
    ) -> mx.array:
        return create_causal_mask(
            N, offset=self._idx, window_size=window_size, left_padding=self.left_padding
        )

    def filter(self, batch_indices: Sequence[int]) -> None:
        """Keep only the rows ``batch_indices`` (in place), dropping shared left padding."""
        if self.keys is not None:
            self.keys, self.values = tree_map(lambda a: a[batch_indices], (self.keys, self.values))
        self.offset = self.offset[batch_indices]
        self.left_padding = self.left_padding[batch_indices]
        shift = min(_ints(self.left_padding))
        if shift > 0:
            if self.keys is not None:
                self.keys, self.values = tree_map(
                    lambda a: a[..., shift:, :], (self.keys, self.values)
                )
            self._idx -= shift
            self.left_padding = self.left_padding - shift

    def extend(self, other: _BatchGrowing) -> None:
        """Append ``other``'s rows (in place), both right-justified at the same index."""
        _check_same_family(self, other)
        if self.keys is None and other.keys is None:
            self.left_padding = mx.concatenate([self.left_padding, other.left_padding])
            self.offset = mx.concatenate([self.offset, other.offset])
            return
        top = max(self._idx, other._idx)
        size = max(tree_length(c.keys) for c in (self, other) if c.keys is not None)
        ref = self if self.keys is not None else other

        def pad(c: _BatchGrowing) -> tuple[Tree, Tree, mx.array, mx.array]:
            k, v = c.keys, c.values
            if k is None:
                rows = int(c.offset.shape[0])
                k, v = _empty_rows(ref.keys, rows), _empty_rows(ref.values, rows)
            left = top - c._idx
            right = size - tree_length(k) - left
            if right < 0:
                k, v = tree_map(lambda a: a[..., :right, :], (k, v))
                right = 0
            if left or right:
                k, v = _pad_rows(k, left, right), _pad_rows(v, left, right)
            return k, v, c.offset, c.left_padding + left

        a, b = pad(self), pad(other)
        self.keys, self.values = _cat([a[0], b[0]], 0), _cat([a[1], b[1]], 0)
        self.offset = mx.concatenate([a[2], b[2]])
        self.left_padding = mx.concatenate([a[3], b[3]])
        self._idx = top

    def extract(self, idx: int) -> Any:
        """Row ``idx`` as a single-sequence cache of the rows' family (its own arrays)."""
        cache = self.new_single()
        mx.eval(self.left_padding)
        padding = _ints(self.left_padding)[idx]
        cache.keys, cache.values = tree_map(
            lambda a: mx.contiguous(a[idx : idx + 1, :, padding : self._idx]),
            (self.keys, self.values),
        )
        cache.offset = tree_length(cache.keys)
        return cache

    @classmethod
    def merge(cls, caches: Sequence[Any]) -> _BatchGrowing:
        """One batch of ``caches`` (single caches of one family), left-padded to the longest."""
        lengths = [int(c.offset) for c in caches]
        longest = max(lengths)
        batch = cls.empty_batch(caches[0], [longest - n for n in lengths])
        assert isinstance(batch, _BatchGrowing)
        if longest == 0:
            return batch
        pieces = [
            (*tree_map(lambda a, n=n: a[..., :n, :], (c.keys, c.values)), n)
            if c.keys is not None
            else (None, None, 0)
            for c, n in zip(caches, lengths)
        ]
        batch._fill(pieces, longest)
        batch.offset = batch.offset + longest
        batch._idx = longest
        return batch


class _BatchPacked(PackedRows):
    """Packed rows in a batch: encoded as the rows' family, reported as ``batch:`` it."""

    def signature(self) -> str:
        return f"{BATCH_FAMILY.kind}:{PackedRows.signature(self)}"

    def inner_signature(self) -> str:
        return PackedRows.signature(self)

    def quantization(self) -> Quantization:
        q = self.family.quantization(parse_signature(self.inner_signature()))
        assert q is not None
        return q

    def _encode(self, x: mx.array) -> tuple[mx.array, ...]:
        return quantize_rows(x, parse_signature(self.inner_signature()))


class BatchKVCache(_BatchGrowing):
    """Rows of raw keys/values (``batch:kv:plain``); mlx-lm's ``BatchKVCache`` over trees."""

    single = KVCache
    rows_family = PLAIN_FAMILY


class BatchQuantizedKVCache(_BatchPacked, AffineRows, _BatchGrowing):
    """Rows of MLX affine keys/values (``batch:kv:quant:{bits}:{group}``); mlx-lm has none."""

    rows_family = QUANT_FAMILY

    def __init__(self, left_padding: Sequence[int], group_size: int = 64, bits: int = 8) -> None:
        _BatchGrowing.__init__(self, left_padding)
        self._init_affine(group_size, bits)

    def new_single(self) -> QuantizedKVCache:
        return QuantizedKVCache(group_size=self.group_size, bits=self.bits)

    @classmethod
    def empty_batch(cls, template: Any, left_padding: list[int]) -> BatchQuantizedKVCache:
        return cls(left_padding, group_size=template.group_size, bits=template.bits)


class _BatchRing(_BatchRows):
    """mlx-lm's ``BatchRotatingKVCache`` over row trees: a window of ``max_size`` rows."""

    keep = 0

    def __init__(self, max_size: int, left_padding: Sequence[int]) -> None:
        self._init_rows(left_padding)
        self.max_size = max_size
        self._offset = 0
        self.rotated = False
        self._lengths: mx.array | None = None

    def _temporal(self) -> None:
        if self.rotated:
            self.keys, self.values = tree_map(
                lambda a: mx.roll(a, -self._idx, 2), (self.keys, self.values)
            )
            self._idx = tree_length(self.keys)
            self.rotated = False

    def _settled(self) -> None:
        # Make sure left_padding and offset are evaluated with the rows (mlx-lm's mx.depends).
        self.keys = tree_map(lambda a: mx.depends(a, (self.left_padding, self.offset)), self.keys)

    def _update_concat(self, keys: Tree, values: Tree, steps: int) -> tuple[Tree, Tree]:
        if self.keys is None:
            self.keys, self.values = keys, values
        else:
            self._temporal()
            if tree_length(self.keys) > self._idx:
                self.keys, self.values = tree_map(
                    lambda a: a[..., : self._idx, :], (self.keys, self.values)
                )
            if self._lengths is not None:  # right-padded rows must not evict valid ones
                roll = mx.maximum(0, self.offset - self._lengths)
                self.keys, self.values = (
                    _dynamic_roll(self.keys, roll),
                    _dynamic_roll(self.values, roll),
                )
                self.left_padding = self.left_padding + roll
                self.offset = self.offset - roll
            trim = self._idx - self.max_size + 1  # max_size + S - 1 rows: a full window each
            if trim > 0:
                self.left_padding = self.left_padding - trim
                self.keys, self.values = tree_map(
                    lambda a: a[..., trim:, :], (self.keys, self.values)
                )
            self.keys = _cat([self.keys, keys], axis=2)
            self.values = _cat([self.values, values], axis=2)
        self.offset = self.offset + steps
        self._offset += steps
        self._idx = tree_length(self.keys)
        self._settled()
        return self.keys, self.values

    def _update_in_place(self, keys: Tree, values: Tree, steps: int) -> tuple[Tree, Tree]:
        if self._lengths is not None:
            raise RuntimeError("[batch cache] finalize() must come before decoding.")
        prev = self._offset
        if self.keys is None or (
            prev >= tree_length(self.keys) and tree_length(self.keys) < self.max_size
        ):
            size = min(self.step, self.max_size - prev)
            fresh_k, fresh_v = zeros_like_rows(keys, size), zeros_like_rows(values, size)
            if self.keys is None:
                self.keys, self.values = fresh_k, fresh_v
            else:
                self.keys = _cat([self.keys, fresh_k], axis=2)
                self.values = _cat([self.values, fresh_v], axis=2)
            self._idx = prev
        trim = tree_length(self.keys) - self.max_size
        if trim > 0:
            self.keys, self.values = tree_map(lambda a: a[..., trim:, :], (self.keys, self.values))
            self._idx = self.max_size
            self.left_padding = self.left_padding - trim
        if self._idx == self.max_size:
            self.rotated = True
            self._idx = 0
        if self.rotated:
            self.left_padding = self.left_padding - steps
        for buf, new in zip(row_leaves((self.keys, self.values)), row_leaves((keys, values))):
            buf[..., self._idx : self._idx + steps, :] = new
        self._offset += steps
        self.offset = self.offset + steps
        self._idx += steps
        self._settled()
        return self.keys_and_values()

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[Tree, Tree]:
        new_keys, new_values = self._encode_pair(keys, values)
        steps = keys.shape[2]
        if steps == 1:
            stored = self._update_in_place(new_keys, new_values, steps)
        else:
            stored = self._update_concat(new_keys, new_values, steps)
        return self._present(*stored)

    def keys_and_values(self) -> tuple[Tree, Tree]:
        if self._offset < tree_length(self.keys):
            return tree_map(lambda a: a[..., : self._offset, :], (self.keys, self.values))
        return self.keys, self.values

    def prepare(
        self,
        *,
        left_padding: Sequence[int] | None = None,
        lengths: Sequence[int] | None = None,
        right_padding: Sequence[int] | None = None,
    ) -> None:
        if left_padding is not None:
            if self.keys is not None:
                raise ValueError("[batch cache] Left padding can only be added to an empty batch.")
            pad = mx.array(list(left_padding))
            self.left_padding = self.left_padding + pad
            self.offset = self.offset - pad
        if right_padding is not None and max(right_padding) > 0:
            assert lengths is not None
            self._lengths = mx.array(list(lengths)) + self.offset

    def finalize(self) -> None:
        if self._lengths is not None:
            roll = mx.maximum(0, self.offset - self._lengths)
            self.keys, self.values = (
                _dynamic_roll(self.keys, roll),
                _dynamic_roll(self.values, roll),
            )
            self.left_padding = self.left_padding + roll
            self.offset = self.offset - roll
            self._lengths = None

    @property
    def state(self) -> tuple[Any, ...]:
        return (
            self.keys,
            self.values,
            self.offset,
            self.left_padding,
            self.max_size,
            self._offset,
            self._idx,
            self.rotated,
        )

    @state.setter
    def state(self, v: tuple[Any, ...]) -> None:
        (
            self.keys,
            self.values,
            self.offset,
            self.left_padding,
            self.max_size,
            self._offset,
            self._idx,
            self.rotated,
        ) = v

    def is_trimmable(self) -> bool:
        return self._offset < self.max_size

    def trim(self, n: int) -> int:
        n = min(self._offset, n)
        self._offset -= n
        self._idx -= n
        self.offset = self.offset - n
        return n

    def size(self) -> int:
        return min(self._offset, self.max_size)

    def make_mask(
        self, N: int, window_size: int | None = None, return_array: bool = False, **kwargs: Any
    ) -> mx.array:
        left_padding = self.left_padding
        window_size = window_size or self.max_size
        offset = min(self.max_size - 1, self._offset)
        rinds = mx.arange(offset + N)
        linds = mx.arange(offset, offset + N) if offset else rinds
        linds = linds[:, None]
        rinds = rinds[None]
        mask = linds >= rinds
        mask &= linds < rinds + window_size
        if (trim := self._idx - self.max_size + int(N > 1)) > 0:
            left_padding = left_padding - trim
        rotated = N == 1 and (self.rotated or self._idx >= self.max_size)
        if rotated:
            left_padding = left_padding - 1
        mask = mask & (rinds >= mx.expand_dims(left_padding, (1, 2, 3)))
        if rotated:
            idx = 0 if self._idx >= self.max_size else self._idx
            mask = mx.roll(mask, idx + 1, -1)
        return mask

    def filter(self, batch_indices: Sequence[int]) -> None:
        if self.keys is not None:
            self.keys, self.values = tree_map(lambda a: a[batch_indices], (self.keys, self.values))
        self.offset = self.offset[batch_indices]
        self.left_padding = self.left_padding[batch_indices]

    def extend(self, other: _BatchRing) -> None:
        _check_same_family(self, other)
        if self.keys is None and other.keys is None:
            self.left_padding = mx.concatenate([self.left_padding, other.left_padding])
            self.offset = mx.concatenate([self.offset, other.offset])
            return
        if self.rotated != other.rotated or self._idx != other._idx:
            self._temporal()
            other._temporal()
        top = max(self._idx, other._idx)
        size = max(tree_length(c.keys) for c in (self, other) if c.keys is not None)
        ref = self if self.keys is not None else other

        def pad(c: _BatchRing) -> tuple[Tree, Tree, mx.array, mx.array]:
            left = top - c._idx
            k, v = c.keys, c.values
            if k is None:
                rows = int(c.offset.shape[0])
                k, v = _empty_rows(ref.keys, rows), _empty_rows(ref.values, rows)
            right = size - tree_length(k) - left
            if right < 0:
                k, v = tree_map(lambda a: a[..., :right, :], (k, v))
                right = 0
            if left or right:
                k, v = _pad_rows(k, left, right), _pad_rows(v, left, right)
            return k, v, c.offset, c.left_padding + left

        a, b = pad(self), pad(other)
        self.keys, self.values = _cat([a[0], b[0]], 0), _cat([a[1], b[1]], 0)
        self.offset = mx.concatenate([a[2], b[2]])
        self.left_padding = mx.concatenate([a[3], b[3]])
        self._idx = top
        self._offset = max(self._offset, other._offset)

    def extract(self, idx: int) -> Any:
        """Row ``idx`` as a single ring of the rows' family (its own arrays)."""
        mx.eval(self.left_padding, self.offset)
        cache = self.new_single()
        padding = max(0, _ints(self.left_padding)[idx])
        offset = _ints(self.offset)[idx]
        keys, values = tree_map(lambda a: a[idx : idx + 1], (self.keys, self.values))
        end = self._idx
        if self.rotated:
            keys, values = tree_map(lambda a: mx.roll(a, -self._idx, 2), (keys, values))
            end = self.max_size
        cache.keys, cache.values = tree_map(
            lambda a: mx.contiguous(a[:, :, padding:end]), (keys, values)
        )
        cache.offset = offset
        cache._idx = tree_length(cache.keys)
        return cache

    @classmethod
    def merge(cls, caches: Sequence[Any]) -> _BatchRing:
        sizes = {(int(c.max_size), int(c.keep)) for c in caches}
        if len(sizes) != 1 or next(iter(sizes))[1] != 0:
            raise CapabilityError(
                f"[batch cache] Windows batch only with one max_size and keep 0 (mlx-lm's batch "
                f"ring has no sink tokens); received (max_size, keep) {sorted(sizes)}.",
                found=sorted(sizes),
            )
        offsets = [int(c.offset) for c in caches]
        lengths = [c.size() for c in caches]
        longest = max(lengths)
        batch = cls.empty_batch(caches[0], [longest - n for n in lengths])
        assert isinstance(batch, _BatchRing)
        if longest == 0:
            return batch
        pieces = [
            (
                *tree_map(
                    lambda a, n=n: a[..., -n:, :],
                    (c._temporal_order(c.keys), c._temporal_order(c.values)),
                ),
                n,
            )
            if c.keys is not None and n
            else (None, None, 0)
            for c, n in zip(caches, lengths)
        ]
        batch._fill(pieces, longest)
        batch.offset = mx.array(offsets)
        batch._idx = longest
        batch._offset = longest
        return batch


class BatchRotatingKVCache(_BatchRing):
    """Windows of raw rows (``batch:kv:rotating-plain``); mlx-lm's ``BatchRotatingKVCache``."""

    rows_family = ROTATING_PLAIN_FAMILY

    def new_single(self) -> RotatingKVCache:
        return RotatingKVCache(self.max_size)

    @classmethod
    def empty_batch(cls, template: Any, left_padding: list[int]) -> BatchRotatingKVCache:
        return cls(int(template.max_size), left_padding)


class BatchRotatingQuantizedKVCache(_BatchPacked, AffineRows, _BatchRing):
    """Windows of affine rows (``batch:kv:rotating-quant:{bits}:{group}``); new."""

    family = ROTATING_QUANT_FAMILY
    rows_family = ROTATING_QUANT_FAMILY

    def __init__(
        self, max_size: int, left_padding: Sequence[int], group_size: int = 64, bits: int = 8
    ) -> None:
        _BatchRing.__init__(self, max_size, left_padding)
        self._init_affine(group_size, bits)

    def new_single(self) -> RotatingQuantizedKVCache:
        return RotatingQuantizedKVCache(self.max_size, 0, self.group_size, self.bits)

    @classmethod
    def empty_batch(cls, template: Any, left_padding: list[int]) -> BatchRotatingQuantizedKVCache:
        return cls(
            int(template.max_size), left_padding, group_size=template.group_size, bits=template.bits
        )


for _cls in (
    BatchKVCache,
    BatchQuantizedKVCache,
    BatchRotatingKVCache,
    BatchRotatingQuantizedKVCache,
):
    register_batch_class(_cls)


def _check_same_family(a: _BatchRows, b: _BatchRows) -> None:
    if type(a) is not type(b) or a.signature() != b.signature():
        raise CapabilityError(
            f"[batch cache] Cannot extend a {a.signature()} batch with a {b.signature()} one.",
            found=b.signature(),
        )
