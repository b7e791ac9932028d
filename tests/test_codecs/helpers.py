"""Cache families, histories and hand-made records shared by the codec tests."""

from __future__ import annotations

import struct
from collections.abc import Callable
from typing import Any

import msgpack
import xxhash

from kvstore.abc.cache import family_of, signature_of
from kvstore.caches import (
    KVCache,
    MXFP8KVCache,
    NVFP4KVCache,
    QuantizedKVCache,
    RotatingKVCache,
    RotatingMXFP4KVCache,
    RotatingNVFP4KVCache,
    RotatingQuantizedKVCache,
    RotatingTurboQuantKVCache,
    TurboQuantKVCache,
)
from kvstore.codecs import encode_record, snapshot_held
from kvstore.testing.codec import fill_cache

#: One cache per family and notable parameter set (window 32 so short histories wrap).
FAMILIES: dict[str, Callable[[], Any]] = {
    "plain": KVCache,
    "quant-4-64": lambda: QuantizedKVCache(64, 4),
    "quant-8-32": lambda: QuantizedKVCache(32, 8),
    "quant-3-64": lambda: QuantizedKVCache(64, 3),
    "rotating-keep0": lambda: RotatingKVCache(32),
    "rotating-keep4": lambda: RotatingKVCache(32, keep=4),
    "rotating-quant-4-64-keep4": lambda: RotatingQuantizedKVCache(32, 4, group_size=64, bits=4),
    "rotating-quant-5-32-keep0": lambda: RotatingQuantizedKVCache(32, 0, group_size=32, bits=5),
    "tq-4-3": lambda: TurboQuantKVCache(4, 3),
    "tq-2-2-seed5-centred": lambda: TurboQuantKVCache(2, 2, seed=5, center=True),
    "rotating-tq-3-3-keep4": lambda: RotatingTurboQuantKVCache(32, 4, kbits=3, vbits=3),
    "rotating-tq-4-2-keep0-2rounds": lambda: RotatingTurboQuantKVCache(
        32, 0, kbits=4, vbits=2, rounds=2
    ),
    "mxfp8": MXFP8KVCache,
    "rotating-mxfp4-keep4": lambda: RotatingMXFP4KVCache(32, keep=4),
    "nvfp4": NVFP4KVCache,
    "rotating-nvfp4-keep0": lambda: RotatingNVFP4KVCache(32),
}

#: Head dims the round trips cover: 96 is not a power of two (TurboQuant's dense rotation).
HEAD_DIMS = (64, 128, 256, 96)


def head_dim_fits(family: str, head_dim: int) -> bool:
    """False where the family cannot encode rows of ``head_dim`` (a quantization
    group that does not divide it)."""
    cache = FAMILIES[family]()
    quantization = family_of(cache).quantization(signature_of(cache))
    return quantization is None or head_dim % quantization.group_size == 0


#: Update sizes: a prefill, then decode steps or chunks.
HISTORIES: dict[str, list[int]] = {
    "short": [10, 1],
    # past one 256-row growth step
    "grown": [300, 1, 1],
    # prefill past the window, then single tokens: the ring wraps and rotates
    "wrapped": [40] + [1] * 12,
    # a chunk after a wrap: the ring holds window + chunk - 1 rows
    "chunk-after-wrap": [40, 1, 1, 7],
}

_PREFIX = struct.Struct("<4sHHIQ")


def craft_record(
    header: Any,
    payload: bytes = b"",
    *,
    version: int = 1,
    flags: int = 0,
    magic: bytes = b"KVST",
    raw_header: bytes | None = None,
) -> bytes:
    """A record around any header object, with *correct* checksums, so that
    what a test exercises is the parser's bounds and schema, not the checksum."""
    packed = raw_header if raw_header is not None else msgpack.packb(header, use_bin_type=True)
    fixed = _PREFIX.pack(magic, version, flags, len(packed), 0)[:12]
    header_sum = xxhash.xxh3_64_intdigest(fixed + packed)
    head = _PREFIX.pack(magic, version, flags, len(packed), header_sum) + packed
    return head + bytes(-len(head) % 64) + payload


def header_of(record: bytes) -> dict[str, Any]:
    """The msgpack header of a record, as a dict (no checks)."""
    length = _PREFIX.unpack_from(record)[3]
    return msgpack.unpackb(record[_PREFIX.size : _PREFIX.size + length])


def payload_of(record: bytes) -> bytes:
    length = _PREFIX.unpack_from(record)[3]
    start = -(-(_PREFIX.size + length) // 64) * 64
    return record[start:]


#: The layer of :func:`small_record` holding TurboQuant rows.
SMALL_RECORD_TQ_LAYER = 3


def small_record(**shape: Any) -> bytes:
    """A tiny record (plain, absent, 4-bit affine, TurboQuant 2/3 with centred keys)
    for exhaustive corruption tests."""
    shape = {"heads": 1, "head_dim": 32, **shape}
    plain, quant = KVCache(), QuantizedKVCache(32, 4)
    tq = TurboQuantKVCache(2, 3, center=True)
    for cache in (plain, quant, tq):
        fill_cache(cache, [3], **shape)
    layers = [*snapshot_held(plain), None, *snapshot_held(quant), *snapshot_held(tq)]
    return encode_record(layers, meta={"t": [1, 2]})
