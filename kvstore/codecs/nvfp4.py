"""Codecs of ``kv:nvfp4`` and ``kv:rotating-nvfp4``: ``keys.q``/``keys.scales`` (and
``values.*``), stored as they are (:mod:`kvstore.codecs.microscaling`)."""

from __future__ import annotations

from kvstore.caches.nvfp4 import NVFP4_FAMILY, ROTATING_NVFP4_FAMILY
from kvstore.codecs.microscaling import MicroscalingKVCodec, RotatingMicroscalingKVCodec

__all__ = ["NVFP4KVCodec", "RotatingNVFP4KVCodec"]


class NVFP4KVCodec(MicroscalingKVCodec):
    """``kv:nvfp4``: growing nvfp4 rows."""

    family = NVFP4_FAMILY


class RotatingNVFP4KVCodec(RotatingMicroscalingKVCodec):
    """``kv:rotating-nvfp4``: a window of nvfp4 rows."""

    family = ROTATING_NVFP4_FAMILY
