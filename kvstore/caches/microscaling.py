"""What the MLX microscaling families share: rows as ``mx.quantize(x, mode=...)`` packs them.

``mxfp8`` (8-bit e4m3 values), ``mxfp4`` (4-bit e2m1 values), each with one
e8m0 scale per 32 values, and ``nvfp4`` (e2m1 values, one e4m3 scale per 16):
a row tree is ``(q uint32 [B, H, T, D*bits/32], scales uint8 [B, H, T, D/group])``,
no biases. Attention reads the rows with ``mx.quantized_matmul(..., mode=)``
(the family's :class:`~kvstore.family.QuantizedAttention`). Each family is one
small module (:mod:`kvstore.caches.mxfp8`, ``mxfp4``, ``nvfp4``) declaring its
two families -- growing and sliding-window -- over the two bases here.

The caches deliberately have no ``bits``/``group_size`` attributes: mlx-lm
routes on those into *affine* attention. The scales say nothing of the
model's dtype, so a cache learns it from its first rows (``dtype_name``) and
its snapshots record it.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from kvstore.caches.base import GrowingKVCache, Tree
from kvstore.caches.packed import PackedRows
from kvstore.caches.rotating import RingKVCache

__all__ = ["MicroscalingRows", "MicroscalingKVCache", "RotatingMicroscalingKVCache"]


class MicroscalingRows(PackedRows):
    """Row encoding shared by a microscaling family's growing and windowed caches."""

    #: The float dtype of the rows the model feeds (``"bfloat16"``), once seen.
    dtype_name: str | None = None

    def _encode(self, x: mx.array) -> tuple[mx.array, ...]:
        if self.dtype_name is None:
            self.dtype_name = str(x.dtype).removeprefix("mlx.core.")
        return super()._encode(x)


class MicroscalingKVCache(MicroscalingRows, GrowingKVCache):
    """Microscaling rows growing in steps of 256 (a family module sets ``family``).

    Args:
        dtype: the model's float dtype, when known before the first rows (a restore).
    """

    def __init__(self, dtype: str | None = None) -> None:
        GrowingKVCache.__init__(self)
        self.dtype_name = dtype

    @property
    def state(self) -> tuple[Tree, Tree, int, str | None]:
        return self.keys, self.values, self.offset, self.dtype_name

    @state.setter
    def state(self, v: tuple[Any, Any, int, str | None]) -> None:
        self.keys, self.values, self.offset, self.dtype_name = v


class RotatingMicroscalingKVCache(MicroscalingRows, RingKVCache):
    """Microscaling rows in a sliding window with ``keep`` sink tokens."""

    def __init__(self, max_size: int, keep: int = 0, dtype: str | None = None) -> None:
        RingKVCache.__init__(self, max_size, keep)
        self.dtype_name = dtype

    @property
    def state(self) -> tuple[Any, ...]:
        return (
            self.keys,
            self.values,
            self.offset,
            self.keep,
            self.max_size,
            self._idx,
            self.dtype_name,
        )

    @state.setter
    def state(self, v: tuple[Any, ...]) -> None:
        (
            self.keys,
            self.values,
            self.offset,
            self.keep,
            self.max_size,
            self._idx,
            self.dtype_name,
        ) = v
