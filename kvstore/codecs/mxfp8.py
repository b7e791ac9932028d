"""Codecs of ``kv:mxfp8`` and ``kv:rotating-mxfp8``: ``keys.q``/``keys.scales`` (and
``values.*``), stored as they are (:mod:`kvstore.codecs.microscaling`)."""

from __future__ import annotations

from kvstore.caches.mxfp8 import MXFP8_FAMILY, ROTATING_MXFP8_FAMILY
from kvstore.codecs.microscaling import MicroscalingKVCodec, RotatingMicroscalingKVCodec

__all__ = ["MXFP8KVCodec", "RotatingMXFP8KVCodec"]


class MXFP8KVCodec(MicroscalingKVCodec):
    """``kv:mxfp8``: growing mxfp8 rows."""

    family = MXFP8_FAMILY


class RotatingMXFP8KVCodec(RotatingMicroscalingKVCodec):
    """``kv:rotating-mxfp8``: a window of mxfp8 rows."""

    family = ROTATING_MXFP8_FAMILY
