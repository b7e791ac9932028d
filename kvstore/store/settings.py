"""Store settings, their parsers, and the meta record that persists them.

A store's settings live in one record, ``kvstore/v1/__meta__`` (msgpack,
little-endian by construction). Precedence on open: defaults < stored <
explicit. Two kinds of setting:

=====================  ==========  ========================================
setting                default     changes after creation
=====================  ==========  ========================================
block_size             256         never: a different value is an error
storage_policy         "lossless"  never: a different value is an error
max_bytes              None        yes: an explicit value replaces the stored
namespace_max_bytes    None        yes: an explicit value replaces the stored
namespace_budgets      {}          with ``store.set_budget(..., namespace=)``
checkpoint_stride      8           yes: an explicit value replaces the stored
=====================  ==========  ========================================

``checkpoint_stride`` (issue 16): a save of a hybrid model's caches keeps its
recurrent layers' checkpoint every this many blocks, besides the ones its
rules always keep (the last block boundary of the prompt before its last
token, the end of the saved sequence and its last block boundary, the point
where a prompt leaves a stored prefix); 0 keeps only those. It is written to
the meta record only when not the default, so a store that never changed it
stays readable by kvstore versions that do not know it.

``storage_policy`` is ``"lossless"`` (each layer in its own family's
encoding) or the signature plain layers are stored as, of a family that
declares ``storage_policy=True`` (``"kv:quant:8:64"``, ``"kv:quant:4:64"``,
``"kv:turboquant:3:3"``, ``"kv:mxfp4"``...), or one of those per layer: a
:class:`~kvstore.layout.LayerLayout` (given as one, as its dict form, or as its
text form, which is what the meta record keeps:
``"default=kv:quant:8:64;sliding=kv:quant:4:64;0=lossless"``). A uniform
layout is kept as its one value, so stores written before per-layer policies
read and compare as they did.

.. versionchanged:: 0.2 ``storage_policy`` may be a per-layer layout (issue 17).
"""

from __future__ import annotations

import math
import re
import struct
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, replace
from typing import Any

import msgpack
import xxhash

from kvstore import __version__
from kvstore.abc.store import StoreSettings
from kvstore.errors import CorruptEntryError, FormatVersionError, StoreConfigError
from kvstore.family import families
from kvstore.knobs import choice_from_env
from kvstore.layout import LayerLayout, is_layout_text, parse_layout
from kvstore.signature import parse_signature

__all__ = [
    "META_FORMAT",
    "StoreSettings",
    "FIXED_SETTINGS",
    "MUTABLE_SETTINGS",
    "SETTING_PARSERS",
    "DEFAULT_FILE_VALUES",
    "INLINE_META_FORMAT",
    "parse_block_size",
    "parse_values",
    "parse_storage_policy",
    "parse_byte_size",
    "parse_optional_byte_size",
    "parse_bool",
    "parse_int",
    "parse_fraction",
    "parse_seconds",
    "resolve_settings",
    "encode_meta",
    "decode_meta",
    "damaged_meta",
]

#: Version of the meta record (the ``kvstore/v1`` layout it describes is unchanged):
#: the newest this kvstore reads and writes.
#:
#: .. versionchanged:: 0.1 meta format 2 frames the record with a checksum (issue 18);
#:    format 1 (a bare msgpack map) is still read.
#: .. versionchanged:: 0.1 meta format 3 is a store whose large values may be in a
#:    value file (``values="file"``), which a reader of format 2 cannot find: such a
#:    reader refuses the store as newer. A store with ``values="inline"`` is still
#:    written as format 2, so older kvstores open it.
META_FORMAT = 3
#: The format of a store that keeps every value inline.
INLINE_META_FORMAT = 2


FIXED_SETTINGS = ("block_size", "storage_policy", "values")

#: ``values`` of a new store whose backend can keep a value file (LMDB):
#: ``KVSTORE_LMDB_VALUES`` (``file`` or ``inline``), else ``file``: a durable save writes
#: each large value once, in place of deleted ones (README "Durability").
DEFAULT_FILE_VALUES = choice_from_env("KVSTORE_LMDB_VALUES", ("file", "inline"), "file")
MUTABLE_SETTINGS = ("max_bytes", "namespace_max_bytes", "checkpoint_stride")


def _config_error(name: str, rule: str, value: object) -> StoreConfigError:
    return StoreConfigError(
        f"[open_store] {name} must be {rule}; received {value!r}.", setting=name, found=value
    )


def parse_int(value: object, name: str = "value", lo: int = 0, hi: int | None = None) -> int:
    if isinstance(value, str) and re.fullmatch(r"\d+", value.strip()):
        value = int(value)
    if (
        isinstance(value, bool)
        or not isinstance(value, int)
        or value < lo
        or (hi is not None and value > hi)
    ):
        rule = f"an integer in [{lo}, {hi}]" if hi is not None else f"an integer >= {lo}"
        raise _config_error(name, rule, value)
    return value


def parse_block_size(value: object) -> int:
    """Tokens per block: 1 to 65535 (256 by default)."""
    return parse_int(value, "block_size", 1, 65535)


def parse_storage_policy(value: object) -> str:
    """``"lossless"``, a storage-policy signature, or a per-layer layout of them (a
    :class:`~kvstore.layout.LayerLayout`, its dict or its text form): the canonical text."""
    if isinstance(value, (LayerLayout, Mapping)) or is_layout_text(value):
        try:
            layout = parse_layout(value, _policy_value, "open_store")  # type: ignore[arg-type]
        except (ValueError, TypeError) as exc:
            if isinstance(exc, StoreConfigError):
                raise
            raise _config_error(
                "storage_policy",
                f"a per-layer layout such as 'default=kv:quant:8:64;sliding=lossless' ({exc})",
                value,
            ) from exc
        uniform = layout.uniform()
        return uniform if uniform is not None else layout.text()
    return _policy_value(value)


def _policy_value(value: object) -> str:
    if value == "lossless":
        return "lossless"
    try:
        sig = parse_signature(value)
    except (ValueError, TypeError) as exc:
        raise _config_error(
            "storage_policy", "'lossless' or a lossy signature such as 'kv:quant:8:64'", value
        ) from exc
    if not sig.family.storage_policy:
        kinds = [f.kind for f in families() if f.storage_policy]
        raise _config_error(
            "storage_policy", f"'lossless' or a signature of kind {' or '.join(kinds)}", value
        )
    return str(sig)


_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def parse_byte_size(value: object, name: str = "size") -> int:
    """Bytes as an int or a string: ``"1048576"``, ``"512MiB"``, ``"10G"``, ``"2GB"``.

    ``K/M/G/T`` and ``KiB/MiB/...`` are powers of 1024; ``KB/MB/...`` powers of 1000.
    """
    if isinstance(value, str):
        m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(i?b?)\s*", value.lower())
        if m:
            number, unit, suffix = m.groups()
            base = 1000 ** "_kmgt".index(unit) if suffix == "b" and unit else _UNITS[unit]
            value = int(float(number) * base)
    return parse_int(value, name, 1)


def parse_optional_byte_size(name: str) -> Callable[[object], int | None]:
    def parse(value: object) -> int | None:
        if value is None or (isinstance(value, str) and value.lower() in ("", "none")):
            return None
        return parse_byte_size(value, name)

    return parse


def parse_bool(value: object, name: str = "flag") -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.lower() in (
        "1",
        "true",
        "yes",
        "on",
        "0",
        "false",
        "no",
        "off",
    ):
        return value.lower() in ("1", "true", "yes", "on")
    raise _config_error(name, "a boolean (true/false)", value)


def parse_fraction(value: object, name: str = "fraction") -> float:
    try:
        f = float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        f = math.nan
    if not 0.0 < f <= 1.0:
        raise _config_error(name, "a number in (0, 1]", value)
    return f


def parse_seconds(value: object, name: str = "seconds") -> float:
    try:
        f = float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        f = math.nan
    if not f >= 0.0:
        raise _config_error(name, "a number of seconds >= 0", value)
    return f


def parse_values(value: object) -> str:
    """Where a store writes its large values: ``"inline"`` or ``"file"``."""
    if value not in ("inline", "file"):
        raise _config_error("values", "'inline' or 'file'", value)
    return str(value)


SETTING_PARSERS: dict[str, Callable[[object], Any]] = {
    "block_size": parse_block_size,
    "storage_policy": parse_storage_policy,
    "max_bytes": parse_optional_byte_size("max_bytes"),
    "namespace_max_bytes": parse_optional_byte_size("namespace_max_bytes"),
    "checkpoint_stride": lambda v: parse_int(v, "checkpoint_stride", 0, 1 << 20),
    "values": parse_values,
}


def resolve_settings(
    stored: StoreSettings | None,
    explicit: Mapping[str, object],
    created: Mapping[str, object] | None = None,
) -> tuple[StoreSettings, bool]:
    """Settings after ``defaults < stored < explicit``, and whether the meta record changes;
    a store created now takes ``created`` over the defaults (what its backend makes best).

    Raises:
        StoreConfigError: an explicit fixed setting differs from the stored one; the
            message names the setting, the stored and the requested value.
    """
    parsed = {name: SETTING_PARSERS[name](value) for name, value in explicit.items()}
    if stored is None:
        return replace(StoreSettings(), **{**(created or {}), **parsed}), True
    for name in FIXED_SETTINGS:
        if name in parsed and parsed[name] != getattr(stored, name):
            raise StoreConfigError(
                f"[open_store] {name} was fixed when the store was created: stored "
                f"{getattr(stored, name)!r}, requested {parsed[name]!r}. Omit {name} to use "
                f"the stored value, or open a new store.",
                setting=name,
                stored=getattr(stored, name),
                requested=parsed[name],
            )
    changed = {k: v for k, v in parsed.items() if k in MUTABLE_SETTINGS and v != getattr(stored, k)}
    return replace(stored, **changed), bool(changed)


# Meta record format 2 (framed like a record, kvstore.codecs.record): the checksum
# covers the version, so a flipped bit is damage, never "newer". Format 1 was the
# bare msgpack map that is now the body; it is still read.
_META_MAGIC = b"KVSM"
_META_PREFIX = struct.Struct("<4sHHIQ")
_META_FIXED = 12  # magic, version, flags, body length: what the checksum covers with the body
_META_BODY_BYTES = 1 << 20


def encode_meta(settings: StoreSettings, created: float | None = None) -> bytes:
    """The meta record of ``settings`` (format 2: framed and checksummed)."""
    body = asdict(settings)
    body["namespace_budgets"] = dict(settings.namespace_budgets)
    if settings.checkpoint_stride == StoreSettings.checkpoint_stride:
        del body["checkpoint_stride"]  # older readers refuse fields they do not know
    version = META_FORMAT
    if settings.values == "inline":
        del body["values"]
        version = INLINE_META_FORMAT  # what older kvstores read
    packed = msgpack.packb(
        {
            "format": version,
            "writer": f"kvstore {__version__}",
            "created": time.time() if created is None else created,
            "settings": body,
        }
    )
    fixed = _META_PREFIX.pack(_META_MAGIC, version, 0, len(packed), 0)[:_META_FIXED]
    checksum = xxhash.xxh3_64_intdigest(fixed + packed)
    return _META_PREFIX.pack(_META_MAGIC, version, 0, len(packed), checksum) + packed


_META_FIELDS = {"format", "writer", "created", "settings"}


def damaged_meta(url: str, problem: str) -> CorruptEntryError:
    """The error for a damaged settings record: it names the one command that repairs it."""
    return CorruptEntryError(
        f"[open_store] The settings record of {url} (kvstore/v1/__meta__) is damaged: "
        f"{problem}. Run 'kvstore verify {url} --fix' to repair it.",
        url=url,
        problem=problem,
    )


def decode_meta(raw: bytes | memoryview, url: str) -> tuple[StoreSettings, float]:
    """The settings and creation time in a meta record (format 2, or format 1's bare map).

    Raises:
        FormatVersionError: an intact record written by a newer kvstore.
        CorruptEntryError: a damaged record (checksum, framing, fields or values);
            the message says to run ``kvstore verify --fix``.
    """
    data = bytes(raw)
    if data[:4] == _META_MAGIC:
        meta = _framed_body(data, url)
    else:
        # Format 1 had no checksum: whatever does not parse as exactly its fields is
        # damage (every later writer frames its record).
        meta = _unpack(data, url)
        if meta.get("format") != 1:
            raise damaged_meta(url, f"an unframed record of format {meta.get('format')!r}")
    unknown = set(meta) - _META_FIELDS
    settings = meta.get("settings")
    if not isinstance(settings, dict):
        raise damaged_meta(url, "no settings map")
    unknown |= set(settings) - set(StoreSettings.__dataclass_fields__)
    if unknown:
        names = ", ".join(sorted(map(str, unknown)))[:200]
        raise damaged_meta(url, f"fields this kvstore never wrote ({names})")
    try:
        parsed = StoreSettings(**settings)
        for name, parse in SETTING_PARSERS.items():
            parse(getattr(parsed, name))
        budgets = parsed.namespace_budgets
        if not isinstance(budgets, dict) or not all(
            isinstance(k, str) and parse_byte_size(v, "namespace budget")
            for k, v in budgets.items()
        ):
            raise TypeError(f"namespace_budgets {str(budgets)[:80]}")
        created = float(meta.get("created", 0.0))
    except (TypeError, ValueError, StoreConfigError) as exc:
        raise damaged_meta(url, f"invalid settings ({exc})") from exc
    return parsed, created


def _framed_body(data: bytes, url: str) -> dict[str, Any]:
    if len(data) < _META_PREFIX.size:
        raise damaged_meta(url, f"{len(data)} bytes, shorter than its header")
    _, version, flags, length, checksum = _META_PREFIX.unpack_from(data)
    if len(data) != _META_PREFIX.size + length:
        raise damaged_meta(url, f"{len(data)} bytes where its header says {length + 20}")
    computed = xxhash.xxh3_64_intdigest(
        data[:_META_FIXED] + data[_META_PREFIX.size : _META_PREFIX.size + length]
    )
    if computed != checksum:
        raise damaged_meta(
            url, f"checksum mismatch (stored {checksum:#018x}, computed {computed:#018x})"
        )
    if version > META_FORMAT:
        raise FormatVersionError(
            f"[open_store] {url} is store format {version}, newer than this reader "
            f"(reads 1-{META_FORMAT}). Upgrade kvstore.",
            found=version,
            supported=tuple(range(1, META_FORMAT + 1)),
        )
    if version < INLINE_META_FORMAT or flags or length > _META_BODY_BYTES:
        raise damaged_meta(url, f"format {version}, flags {flags:#x}")
    meta = _unpack(data[_META_PREFIX.size :], url)
    if meta.get("format") != version:
        raise damaged_meta(url, f"body format {meta.get('format')!r} in a format {version} frame")
    return meta


def _unpack(data: bytes, url: str) -> dict[str, Any]:
    try:
        meta = msgpack.unpackb(data, max_str_len=1 << 16, max_map_len=1 << 12, max_ext_len=0)
    except Exception as exc:  # noqa: BLE001 - any decoding failure is damage here
        raise damaged_meta(url, f"not msgpack ({type(exc).__name__})") from exc
    if not isinstance(meta, dict):
        raise damaged_meta(url, f"a {type(meta).__name__}, not a map")
    return meta
