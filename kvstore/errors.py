"""The whole exception tree of kvstore.

Every error raised on purpose by kvstore derives from :class:`KVStoreError`;
each subclass also inherits the built-in exception a caller would already
catch, so ``except ValueError`` keeps working around our calls::

    KVStoreError(Exception)
    ├── UnknownSignatureError(LookupError)   no codec/family for a signature kind
    ├── FormatVersionError(ValueError)        record/format newer (or older) than this reader
    ├── CorruptEntryError(ValueError)         bad magic, bounds, checksum, truncation
    ├── CapabilityError(TypeError)            a cache/store cannot do what was asked
    ├── EncodingError(ValueError)             values a lossy encoder refuses (NaN/Inf, wrong shape)
    ├── ModelLoadError(ValueError)            a model directory that cannot be loaded as it is
    └── StoreError
        ├── StoreUnavailableError(ConnectionError)   backend unreachable or timed out
        ├── StoreFullError                           map, disk or quota exhausted
        ├── ReadOnlyStoreError                       write on a store opened read-only
        └── StoreConfigError(ValueError)             bad URL, conflicting settings, not a store

Which errors a caller may treat as a cache miss (recompute and carry on):
``CorruptEntryError`` (the entry is dropped and counted, never served),
``StoreUnavailableError`` (the backend is down; reconnects later) and
``FormatVersionError`` raised while *reading* an entry written by a newer
kvstore. Everything else is a programming or configuration error and should
propagate. A store whose own bookkeeping is damaged (its settings record, its
LMDB file) raises ``CorruptEntryError`` or ``StoreError`` when opened or used,
with a message that names the repair: ``kvstore verify URL --fix``.

Messages follow one shape: ``[operation] rule; what was received; the fix``.
The values involved are also attributes of the exception (``exc.found``,
``exc.supported``, ...), so callers never parse messages.
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "KVStoreError",
    "UnknownSignatureError",
    "FormatVersionError",
    "CorruptEntryError",
    "CapabilityError",
    "EncodingError",
    "ModelLoadError",
    "StoreError",
    "StoreUnavailableError",
    "StoreFullError",
    "ReadOnlyStoreError",
    "StoreConfigError",
]


class KVStoreError(Exception):
    """Root of every error kvstore raises on purpose.

    Keyword arguments become attributes, so ``KVStoreError(msg, found=3)``
    has ``exc.found == 3``.
    """

    def __init__(self, message: str, **attrs: Any) -> None:
        super().__init__(message)
        self.message = message
        for name, value in attrs.items():
            setattr(self, name, value)

    def __str__(self) -> str:
        return self.message


class UnknownSignatureError(KVStoreError, LookupError):
    """A signature kind that no family or codec is registered for."""

    # LookupError (not KeyError): str(KeyError(msg)) would quote the message.


class FormatVersionError(KVStoreError, ValueError):
    """Stored data in a format version this reader does not read."""


class CorruptEntryError(KVStoreError, ValueError):
    """Stored bytes that fail validation: magic, bounds, checksum, truncation."""


class CapabilityError(KVStoreError, TypeError):
    """An object cannot do what was asked (unknown cache family, missing feature)."""


class EncodingError(KVStoreError, ValueError):
    """Tensors a lossy encoder cannot encode or decode (NaN/Inf, wrong shape)."""


class ModelLoadError(KVStoreError, ValueError):
    """A model directory without a readable config or weights, or whose weights do
    not fit the architecture its config describes."""


class StoreError(KVStoreError):
    """Base of errors raised by a prefix store or its backend."""


class StoreUnavailableError(StoreError, ConnectionError):
    """The backend could not be reached within its timeout; treat as a miss."""


class StoreFullError(StoreError):
    """The store's map, disk or byte quota is exhausted; nothing was written."""


class ReadOnlyStoreError(StoreError):
    """A write was attempted on a store opened read-only."""


class StoreConfigError(StoreError, ValueError):
    """A bad store URL, conflicting settings, or a path that is not a store."""
