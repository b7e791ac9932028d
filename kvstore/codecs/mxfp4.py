"""Codecs of ``kv:mxfp4`` and ``kv:rotating-mxfp4``: ``keys.q``/``keys.scales`` (and
``values.*``), stored as they are (:mod:`kvstore.codecs.microscaling`)."""

from __future__ import annotations

from kvstore.caches.mxfp4 import MXFP4_FAMILY, ROTATING_MXFP4_FAMILY
from kvstore.codecs.microscaling import MicroscalingKVCodec, RotatingMicroscalingKVCodec

__all__ = ["MXFP4KVCodec", "RotatingMXFP4KVCodec"]


class MXFP4KVCodec(MicroscalingKVCodec):
    """``kv:mxfp4``: growing mxfp4 rows."""

    family = MXFP4_FAMILY


class RotatingMXFP4KVCodec(RotatingMicroscalingKVCodec):
    """``kv:rotating-mxfp4``: a window of mxfp4 rows."""

    family = ROTATING_MXFP4_FAMILY
