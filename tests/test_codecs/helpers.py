"""Cache families, histories and hand-made records shared by the codec tests."""

from __future__ import annotations

import struct
from collections.abc import Callable
from typing import Any

import msgpack
import xxhash

from kvstore.caches import KVCache, QuantizedKVCache, RotatingKVCache, RotatingQuantizedKVCache
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
}

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


def small_record(**shape: Any) -> bytes:
    """A tiny two-layer record (plain + 4-bit affine) for exhaustive corruption tests."""
    shape = {"heads": 1, "head_dim": 32, **shape}
    plain, quant = KVCache(), QuantizedKVCache(32, 4)
    for cache in (plain, quant):
        fill_cache(cache, [3], **shape)
    return encode_record([*snapshot_held(plain), None, *snapshot_held(quant)], meta={"t": [1, 2]})
