"""What the codecs of the MLX microscaling families share (``mxfp8``, ``mxfp4``, ``nvfp4``).

Snapshot tensors: ``keys.q`` (packed uint32 words ``[B, H, T, D*bits/32]``),
``keys.scales`` (uint8 ``[B, H, T, D/group]``), the same for ``values``,
stored as the cache holds them (restore is bit-exact); ``meta["dtype"]`` is
the model's float dtype (the scales do not carry it). Each family's codec
module (:mod:`kvstore.codecs.mxfp8`, ...) names its two families over the two
bases here; the caches are built by the families' own factories.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kvstore.codecs.growing import GrowingKVCodec
from kvstore.codecs.ring import RingKVCodec
from kvstore.codecs.rows import MicroscalingRowCodec
from kvstore.signature import parse_signature

__all__ = ["MicroscalingKVCodec", "RotatingMicroscalingKVCodec"]


class MicroscalingKVCodec(MicroscalingRowCodec, GrowingKVCodec):
    """Growing microscaling rows; a family module sets ``family``."""

    def make_cache(self, meta: Mapping[str, Any]) -> Any:
        cache = self.family.make(parse_signature(self.signature))
        cache.dtype_name = str(meta["dtype"])
        return cache


class RotatingMicroscalingKVCodec(MicroscalingRowCodec, RingKVCodec):
    """Microscaling rows in a sliding window; a family module sets ``family``."""

    def make_cache(self, meta: Mapping[str, Any]) -> Any:
        sig = parse_signature(self.signature)
        cache = self.family.make(sig, window=int(meta["max_size"]), keep=int(meta["keep"]))
        cache.dtype_name = str(meta["dtype"])
        return cache
