"""Growing row-batched caches: mlx-lm's ``BatchKVCache`` over row trees (raw and affine rows)."""

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
from kvstore.caches.mask import create_causal_mask
from kvstore.caches.plain import PLAIN_FAMILY, KVCache
from kvstore.caches.quantized import QUANT_FAMILY, AffineRows, QuantizedKVCache

__all__ = ["BatchGrowing", "BatchKVCache", "BatchQuantizedKVCache"]


class BatchGrowing(BatchRows):
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
                self.keys = cat([self.keys, fresh_k], axis=2)
                self.values = cat([self.values, fresh_v], axis=2)
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
            self._pad_left(left_padding)
        if right_padding is not None and max(right_padding) > 0:
            self._right_padding = mx.array(list(right_padding))

    def finalize(self) -> None:
        if self._right_padding is not None:
            pad = self._right_padding
            self.keys = dynamic_roll(self.keys, pad)
            self.values = dynamic_roll(self.values, pad)
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
        shift = min(ints(self.left_padding))
        if shift > 0:
            if self.keys is not None:
                self.keys, self.values = tree_map(
                    lambda a: a[..., shift:, :], (self.keys, self.values)
                )
            self._idx -= shift
            self.left_padding = self.left_padding - shift

    def extract(self, idx: int) -> Any:
        """Row ``idx`` as a single-sequence cache of the rows' family (its own arrays)."""
        cache = self.new_single()
        mx.eval(self.left_padding)
        padding = ints(self.left_padding)[idx]
        cache.keys, cache.values = tree_map(
            lambda a: mx.contiguous(a[idx : idx + 1, :, padding : self._idx]),
            (self.keys, self.values),
        )
        cache.offset = tree_length(cache.keys)
        return cache

    @classmethod
    def merge(cls, caches: Sequence[Any]) -> BatchGrowing:
        """One batch of ``caches`` (single caches of one family), left-padded to the longest."""
        lengths = [int(c.offset) for c in caches]
        longest = max(lengths)
        batch = cls.empty_batch(caches[0], [longest - n for n in lengths])
        assert isinstance(batch, BatchGrowing)
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


class BatchKVCache(BatchGrowing):
    """Rows of raw keys/values (``batch:kv:plain``); mlx-lm's ``BatchKVCache`` over trees."""

    single = KVCache
    rows_family = PLAIN_FAMILY


class BatchQuantizedKVCache(BatchPacked, AffineRows, BatchGrowing):
    """Rows of MLX affine keys/values (``batch:kv:quant:{bits}:{group}``); mlx-lm has none."""

    rows_family = QUANT_FAMILY

    def __init__(self, left_padding: Sequence[int], group_size: int = 64, bits: int = 8) -> None:
        BatchGrowing.__init__(self, left_padding)
        self._init_affine(group_size, bits)

    def new_single(self) -> QuantizedKVCache:
        return QuantizedKVCache(group_size=self.group_size, bits=self.bits)

    @classmethod
    def empty_batch(cls, template: Any, left_padding: list[int]) -> BatchQuantizedKVCache:
        return cls(left_padding, group_size=template.group_size, bits=template.bits)
