"""``kv:quant:{bits}:{group}``: MLX affine rows (mlx-lm ``QuantizedKVCache``)."""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from kvstore.caches.base import GrowingKVCache
from kvstore.errors import CapabilityError
from kvstore.signature import KINDS, make_signature

__all__ = ["AffineRows", "QuantizedKVCache", "packed_width", "fitting_groups"]


def packed_width(head_dim: int, bits: int) -> int:
    """uint32 words per packed row: ceil(D*bits/32) (mlx-lm's D//(32//bits) is
    wrong for 3, 5 and 6 bits)."""
    return (head_dim * bits + 31) // 32


def fitting_groups(head_dim: int) -> list[int]:
    """The affine group sizes that divide ``head_dim``."""
    groups = next(spec.allowed for spec in KINDS["kv:quant"] if spec.name == "group_size")
    return [g for g in groups if head_dim % g == 0]


class AffineRows:
    """Row encoding shared by the growing and the windowed affine caches.

    Exposes ``bits`` and ``group_size`` on purpose: mlx-lm routes on them.
    """

    bits: int
    group_size: int
    kind: str = "kv:quant"

    def _init_affine(self, group_size: int, bits: int) -> None:
        make_signature(self.kind, bits, group_size)  # ValueError naming the allowed values
        self.group_size = group_size
        self.bits = bits

    def signature(self) -> str:
        return f"{self.kind}:{self.bits}:{self.group_size}"

    def _encode(self, x: mx.array) -> tuple[mx.array, mx.array, mx.array]:
        head_dim = x.shape[-1]
        if head_dim % self.group_size:
            fits = fitting_groups(head_dim)
            fix = (
                f"use group size {' or '.join(map(str, fits))}"
                if fits
                else "no affine group fits; use kv:plain or kv:turboquant"
            )
            raise CapabilityError(
                f"[{self.signature()}] group_size {self.group_size} does not divide "
                f"head_dim {head_dim}; {fix}.",
                head_dim=head_dim,
                group_size=self.group_size,
                fitting_groups=fits,
            )
        q = mx.quantize(x, group_size=self.group_size, bits=self.bits)
        return q[0], q[1], q[2]


class QuantizedKVCache(AffineRows, GrowingKVCache):
    """Affine-quantized rows (``mx.quantize`` along head_dim), growing in steps of 256.

    Same name and ``state`` layout as mlx-lm's ``QuantizedKVCache``, but works
    for 2, 3, 4, 5, 6 and 8 bits (packed width ceil(D*bits/32)).
    """

    def __init__(self, group_size: int = 64, bits: int = 8) -> None:
        GrowingKVCache.__init__(self)
        self._init_affine(group_size, bits)

    @property
    def state(self) -> tuple[Any, Any, int, int, int]:
        return self.keys, self.values, self.offset, self.group_size, self.bits

    @state.setter
    def state(self, v: tuple[Any, Any, int, int, int]) -> None:
        self.keys, self.values, self.offset, group_size, bits = v
        self._init_affine(int(group_size), int(bits))

    @classmethod
    def merge(cls, caches: Any) -> Any:
        """One row-batched cache of ``caches`` (mlx-lm's batch protocol; see
        :mod:`kvstore.caches.batch`)."""
        from kvstore.caches.batch import merge_caches

        return merge_caches(caches)
