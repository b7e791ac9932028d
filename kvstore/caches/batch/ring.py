"""Windowed row-batched caches: mlx-lm's ``BatchRotatingKVCache`` over row trees."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import mlx.core as mx
from mlx.utils import tree_map

from kvstore.caches.base import Tree, row_leaves, tree_length, zeros_like_rows
from kvstore.caches.batch.rows import (
    BatchPacked,
    BatchRows,
    cat,
    dynamic_roll,
    ints,
)
from kvstore.caches.quantized import AffineRows
from kvstore.caches.rotating import (
    ROTATING_PLAIN_FAMILY,
    ROTATING_QUANT_FAMILY,
    RotatingKVCache,
    RotatingQuantizedKVCache,
)
from kvstore.errors import CapabilityError

__all__ = ["BatchRing", "BatchRotatingKVCache", "BatchRotatingQuantizedKVCache"]


class BatchRing(BatchRows):
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
                    dynamic_roll(self.keys, roll),
                    dynamic_roll(self.values, roll),
                )
                self.left_padding = self.left_padding + roll
                self.offset = self.offset - roll
            trim = self._idx - self.max_size + 1  # max_size + S - 1 rows: a full window each
            if trim > 0:
                self.left_padding = self.left_padding - trim
                self.keys, self.values = tree_map(
                    lambda a: a[..., trim:, :], (self.keys, self.values)
                )
            self.keys = cat([self.keys, keys], axis=2)
            self.values = cat([self.values, values], axis=2)
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
                self.keys = cat([self.keys, fresh_k], axis=2)
                self.values = cat([self.values, fresh_v], axis=2)
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
            self._pad_left(left_padding)
        if right_padding is not None and max(right_padding) > 0:
            assert lengths is not None
            self._lengths = mx.array(list(lengths)) + self.offset

    def finalize(self) -> None:
        if self._lengths is not None:
            roll = mx.maximum(0, self.offset - self._lengths)
            self.keys, self.values = (
                dynamic_roll(self.keys, roll),
                dynamic_roll(self.values, roll),
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

    def _align_with(self, other: BatchRows) -> None:
        # Both rings in temporal order at the same index, so their rows pad alike.
        assert isinstance(other, BatchRing)
        if self.rotated != other.rotated or self._idx != other._idx:
            self._temporal()
            other._temporal()

    def extend(self, other: BatchRows) -> None:
        super().extend(other)
        assert isinstance(other, BatchRing)
        self._offset = max(self._offset, other._offset)

    def extract(self, idx: int) -> Any:
        """Row ``idx`` as a single ring of the rows' family (its own arrays)."""
        mx.eval(self.left_padding, self.offset)
        cache = self.new_single()
        padding = max(0, ints(self.left_padding)[idx])
        offset = ints(self.offset)[idx]
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
    def merge(cls, caches: Sequence[Any]) -> BatchRing:
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
        assert isinstance(batch, BatchRing)
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


class BatchRotatingKVCache(BatchRing):
    """Windows of raw rows (``batch:kv:rotating-plain``); mlx-lm's ``BatchRotatingKVCache``."""

    rows_family = ROTATING_PLAIN_FAMILY

    def new_single(self) -> RotatingKVCache:
        return RotatingKVCache(self.max_size)

    @classmethod
    def empty_batch(cls, template: Any, left_padding: list[int]) -> BatchRotatingKVCache:
        return cls(int(template.max_size), left_padding)


class BatchRotatingQuantizedKVCache(BatchPacked, AffineRows, BatchRing):
    """Windows of affine rows (``batch:kv:rotating-quant:{bits}:{group}``); new."""

    family = ROTATING_QUANT_FAMILY
    rows_family = ROTATING_QUANT_FAMILY

    def __init__(
        self, max_size: int, left_padding: Sequence[int], group_size: int = 64, bits: int = 8
    ) -> None:
        BatchRing.__init__(self, max_size, left_padding)
        self._init_affine(group_size, bits)

    def new_single(self) -> RotatingQuantizedKVCache:
        return RotatingQuantizedKVCache(self.max_size, 0, self.group_size, self.bits)

    @classmethod
    def empty_batch(cls, template: Any, left_padding: list[int]) -> BatchRotatingQuantizedKVCache:
        return cls(
            int(template.max_size), left_padding, group_size=template.group_size, bits=template.bits
        )
