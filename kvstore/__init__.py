"""mlx-kvstore: persistent, deduplicated, checksummed KV-cache storage for MLX models."""

from kvstore.errors import (
    CapabilityError,
    CorruptEntryError,
    FormatVersionError,
    KVStoreError,
    ModelLoadError,
    ReadOnlyStoreError,
    StoreConfigError,
    StoreError,
    StoreFullError,
    StoreUnavailableError,
    UnknownSignatureError,
)
from kvstore.signature import Signature, format_signature, parse_signature

__version__ = "0.1.0"

__all__ = [
    "__version__",
    "Signature",
    "parse_signature",
    "format_signature",
    "KVStoreError",
    "UnknownSignatureError",
    "FormatVersionError",
    "CorruptEntryError",
    "CapabilityError",
    "ModelLoadError",
    "StoreError",
    "StoreUnavailableError",
    "StoreFullError",
    "ReadOnlyStoreError",
    "StoreConfigError",
]
