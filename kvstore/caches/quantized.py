"""``kv:quant:{bits}:{group}``: MLX affine rows (mlx-lm ``QuantizedKVCache``)."""

from __future__ import annotations

from typing import Any

from kvstore.caches.base import Batchable, GrowingKVCache
from kvstore.caches.packed import PackedRows, packed_width
from kvstore.caches.packed import fitting_groups as _fitting_groups
from kvstore.family import Family, ParamSpec, QuantizedAttention

__all__ = [
    "AFFINE_PARAMS",
    "AFFINE_ATTENTION",
    "QUANT_FAMILY",
    "AffineRows",
    "QuantizedKVCache",
    "packed_width",
    "fitting_groups",
]

#: The affine parameters, in signature order: bits, then group size.
AFFINE_PARAMS = (ParamSpec("bits", (2, 3, 4, 5, 6, 8)), ParamSpec("group_size", (32, 64, 128)))
#: Affine rows are read by ``mx.quantized_matmul`` with the signature's bits and group.
AFFINE_ATTENTION = QuantizedAttention("affine", bits="bits", group_size="group_size")

QUANT_FAMILY = Family(
    kind="kv:quant",
    description="MLX affine rows (mx.quantize), growing",
    params=AFFINE_PARAMS,
    attention=AFFINE_ATTENTION,
    lossy=True,
    storage_policy=True,
    factory=lambda sig, window, keep: QuantizedKVCache(sig.param("group_size"), sig.param("bits")),
)


def fitting_groups(head_dim: int) -> list[int]:
    """The affine group sizes that divide ``head_dim``."""
    return _fitting_groups(QUANT_FAMILY, head_dim)


class AffineRows(PackedRows):
    """Row encoding shared by the growing and the windowed affine caches.

    Exposes ``bits`` and ``group_size`` on purpose: mlx-lm routes on them.
    """

    bits: int
    group_size: int
    family = QUANT_FAMILY

    def _init_affine(self, group_size: int, bits: int) -> None:
        self.family.check((bits, group_size))  # ValueError naming the allowed values
        self.group_size = group_size
        self.bits = bits

    def signature_params(self) -> tuple[int, ...]:
        return (self.bits, self.group_size)

    def signature(self) -> str:
        return f"{self.family.kind}:{self.bits}:{self.group_size}"


class QuantizedKVCache(Batchable, AffineRows, GrowingKVCache):
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
