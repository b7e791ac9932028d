"""The cache families the fidelity study compares, and K/V through a cache."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import mlx.core as mx

from kvstore.abc.cache import quantized_attention_params, signature_string, uses_quantized_attention
from kvstore.caches import KVCache, QuantizedKVCache, TurboQuantKVCache
from kvstore.turboquant.quantizer import TurboQuantizer

__all__ = ["ATTRIBUTED", "Family", "FAMILIES", "OneSidedKVCache", "through_cache"]


@dataclass(frozen=True)
class Family:
    """One row of the table: an affine or TurboQuant configuration."""

    name: str
    kbits: int
    vbits: int
    group: int = 0  # affine only
    center: bool = False  # TurboQuant key mean-centering (spec option)
    # TurboQuant spec options measured against their defaults (tools/quality/options.py)
    value_scale_mode: str = "ls"
    rounds: int = 1
    scale_dtype: str = "float16"

    @property
    def is_affine(self) -> bool:
        return self.group > 0

    def make(self, head_dim: int) -> Any:
        """A fresh cache; affine groups shrink to head_dim where they do not fit (MiniLM, D=32)."""
        if self.is_affine:
            return QuantizedKVCache(group_size=min(self.group, head_dim), bits=self.kbits)
        cls = TurboQuantKVCache if self.scale_dtype == "float16" else Float32ScalesKVCache
        return cls(
            self.kbits,
            self.vbits,
            center=self.center,
            value_scale_mode=self.value_scale_mode,  # type: ignore[arg-type]
            rounds=self.rounds,
        )

    def signature(self, head_dim: int) -> str:
        options = [
            "+center" if self.center else "",
            f"V {self.value_scale_mode}" if self.value_scale_mode != "ls" else "",
            f"{self.rounds} rounds" if self.rounds != 1 else "",
            "fp32 scales" if self.scale_dtype != "float16" else "",
        ]
        return " ".join([signature_string(self.make(head_dim)), *filter(None, options)])


class Float32ScalesKVCache(TurboQuantKVCache):
    """A TurboQuant cache storing every scale as float32 (spec ``scale_dtype``), to
    measure what float16 scales cost; the codecs do not persist this option."""

    def quantizers(self, head_dim: int) -> tuple[TurboQuantizer, TurboQuantizer]:
        kq, vq = super().quantizers(head_dim)
        return _float32_scales(kq), _float32_scales(vq)


@functools.cache
def _float32_scales(q: TurboQuantizer) -> TurboQuantizer:
    return TurboQuantizer(
        q.bits,
        q.dim,
        q.kind,
        q.seed,
        scale_mode=q.scale_mode,
        rotation=q.rotation,
        scale_dtype="float32",
    )


FAMILIES: tuple[Family, ...] = (
    Family("quant 8/64", 8, 8, group=64),
    Family("quant 4/64", 4, 4, group=64),
    Family("quant 3/64", 3, 3, group=64),
    Family("quant 2/64", 2, 2, group=64),
    Family("turboquant 4/4", 4, 4),
    Family("turboquant 4/3", 4, 3),
    Family("turboquant 3/3", 3, 3),
    Family("turboquant 2/2", 2, 2),
    Family("turboquant 4/4 +center", 4, 4, center=True),
    Family("turboquant 3/3 +center", 3, 3, center=True),
    Family("turboquant 2/2 +center", 2, 2, center=True),
)


def through_cache(cache: Any, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
    """Keys and values ``[B, H, T, D]`` as attention sees them after ``cache`` stored
    them: TurboQuant caches return decoded rows, affine ones packed rows to dequantize."""
    k, v = cache.update_and_fetch(keys, values)
    if uses_quantized_attention(cache):
        q = quantized_attention_params(cache)
        k = mx.dequantize(*k, group_size=q.group_size, bits=q.bits, mode=q.mode)
        v = mx.dequantize(*v, group_size=q.group_size, bits=q.bits, mode=q.mode)
    return k.astype(mx.float32), v.astype(mx.float32)


#: Families whose error the study splits into its key and value parts.
ATTRIBUTED: tuple[str, ...] = ("quant 4/64", "quant 3/64", "turboquant 4/4", "turboquant 3/3")


class OneSidedKVCache(KVCache):
    """A plain cache whose keys (``side="k"``) or values (``"v"``) go through a
    family's encoding and back, the other side kept exact: which side the error
    of a family comes from."""

    def __init__(self, family: Family, side: str) -> None:
        super().__init__()
        self.family, self.side = family, side

    def _encode_pair(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        kh, vh = through_cache(self.family.make(keys.shape[-1]), keys, values)
        if self.side == "k":
            return kh.astype(keys.dtype), values
        return keys, vh.astype(values.dtype)
