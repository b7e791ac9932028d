"""Where each logical key lives in Redis, and the manifest that names a record's chunks.

Logical keys are the store's (``kvstore/v1/...``, :mod:`kvstore.store.keys`).
Two kinds of physical key:

* **metadata**, in one cluster slot: ``<prefix>{kvstore/v1}:m:<logical key>``
  holds the value of every non-record key (index entries, last uses,
  totals, the meta record) and, for a record key, its *manifest*;
  ``<prefix>{kvstore/v1}:keys`` is a sorted set of every logical key (the
  ordered index ``scan`` reads with ``ZRANGEBYLEX``). The ``{kvstore/v1}``
  hash tag puts them all in one slot, so one ``MULTI`` commits them together.
* **payload chunks**, spread over every slot: a record's bytes split into
  pieces of at most ``chunk_size`` under ``<prefix><record key>/c/<nonce>/<i>``
  (no hash tag, so each hashes to its own slot). The nonce is new for every
  write, so a chunk is never shared or overwritten: deleting one record's
  chunks can never touch another writer's.

A manifest is ``<4s magic "KVRM"><u8 version=1><3x pad><u64 total bytes>
<u32 chunks><16s nonce>``, little-endian.
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass

from kvstore.errors import CorruptEntryError, FormatVersionError
from kvstore.store.keys import SCHEMA, split_record_key

__all__ = ["Layout", "Manifest", "TAG"]

#: The hash tag of every metadata key (one slot per store, see the module docstring).
TAG = b"{" + SCHEMA.rstrip(b"/") + b"}"
_MANIFEST = struct.Struct("<4sB3xQI16s")
_MAGIC = b"KVRM"
_VERSION = 1


@dataclass(frozen=True)
class Manifest:
    """A record stored as ``chunks`` pieces under keys made with ``nonce``."""

    total: int
    chunks: int
    nonce: bytes

    @classmethod
    def new(cls, total: int, chunk_size: int) -> Manifest:
        return cls(total, -(-total // chunk_size), os.urandom(8).hex().encode("ascii"))

    def encode(self) -> bytes:
        return _MANIFEST.pack(_MAGIC, _VERSION, self.total, self.chunks, self.nonce)

    @classmethod
    def decode(cls, raw: bytes, key: bytes) -> Manifest:
        """Raises CorruptEntryError / FormatVersionError for what is not a manifest we read."""
        if len(raw) != _MANIFEST.size or raw[:4] != _MAGIC:
            raise CorruptEntryError(
                f"[read] The manifest of {key!r} is not one ({len(raw)} bytes); run "
                f"verify(repair=True) to drop the block.",
                key=key,
            )
        _, version, total, chunks, nonce = _MANIFEST.unpack(raw)
        if version != _VERSION:
            raise FormatVersionError(
                f"[read] Manifest version {version} of {key!r} is newer than this reader "
                f"(reads {_VERSION}). Upgrade kvstore.",
                found=version,
                supported=(_VERSION,),
            )
        return cls(total, chunks, nonce)


class Layout:
    """Physical key names of one store (``key_prefix`` lets several share a database)."""

    def __init__(self, prefix: str = "") -> None:
        self.prefix = prefix.encode("ascii")
        self._meta = self.prefix + TAG + b":m:"
        #: The sorted set of every logical key.
        self.index = self.prefix + TAG + b":keys"

    def meta(self, key: bytes) -> bytes:
        """The physical key of a metadata value, or of a record's manifest."""
        return self._meta + key

    @staticmethod
    def is_record(key: bytes) -> bool:
        """Record values are chunked payloads; every other value is stored whole."""
        return key.startswith(SCHEMA) and split_record_key(key) is not None

    def chunk(self, key: bytes, manifest: Manifest, i: int) -> bytes:
        return b"%s%s/c/%s/%d" % (self.prefix, key, manifest.nonce, i)

    def chunks(self, key: bytes, manifest: Manifest) -> list[bytes]:
        return [self.chunk(key, manifest, i) for i in range(manifest.chunks)]
