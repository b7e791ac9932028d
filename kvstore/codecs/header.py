"""The self-describing header shared by records and ``.safetensors`` snapshot files.

Both carry the same description of their layers, one entry per layer (or
``None`` for a layer absent from this value)::

    {"signature": "kv:quant:4:64", "codec": "QuantizedKVCodec", "codec_version": 1,
     "start": 0, "stop": 256, "meta": {...},
     "tensors": [{"name": "keys.q", "dtype": "uint32", "shape": [1, 8, 256, 16],
                  "offset": 0, "nbytes": 131072}, ...]}

(``offset``/``nbytes`` only in records: ``.safetensors`` locates tensors itself.)

Parsing is defensive: whatever the bytes, it ends in a value or in a
``CorruptEntryError``/``FormatVersionError`` -- never another exception.
Size, nesting depth and container lengths are bounded before anything is
interpreted. A field this reader does not know is a ``FormatVersionError``
(a newer writer made it required), unless it is a map marked
``"must_understand": false``, which is skipped (zarr v3's rule).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

from kvstore.abc.codec import KVCodec, Snapshot
from kvstore.codecs.arrays import DTYPES, dtype_name
from kvstore.errors import CorruptEntryError, FormatVersionError, UnknownSignatureError

__all__ = [
    "FORMAT_VERSION",
    "SUPPORTED_VERSIONS",
    "Bounds",
    "BOUNDS",
    "TensorEntry",
    "LayerEntry",
    "MAX_INT",
    "MAX_STR_CHARS",
    "LAYER_FIELDS",
    "TENSOR_FIELDS",
    "LOCATED_TENSOR_FIELDS",
    "check_bounds",
    "is_bounded",
    "check_format",
    "parse_fields",
    "header_fields",
    "checked_header",
    "parse_layers",
    "check_codec_versions",
    "layer_entry",
    "writer",
]

#: The record/file format this module writes.
FORMAT_VERSION = 1
#: The formats this module reads.
SUPPORTED_VERSIONS: tuple[int, ...] = (1,)

#: The largest int a header field may hold (positions, sizes, offsets).
MAX_INT = (1 << 63) - 1
#: The longest name, signature or writer a header field may hold.
MAX_STR_CHARS = 256


@dataclass(frozen=True)
class Bounds:
    """Limits a header must stay within before it is interpreted."""

    header_bytes: int = 4 << 20
    depth: int = 32
    array_len: int = 1 << 17
    map_len: int = 1 << 12
    str_len: int = 1 << 16
    bin_len: int = 1 << 20
    layers: int = 1 << 12
    tensors_per_layer: int = 64
    rank: int = 8


BOUNDS = Bounds()


# The entries set their fields with one dict update: the generated frozen __init__
# calls object.__setattr__ per field, three times the cost, and a header parse builds
# an entry per layer and per tensor. Nothing else differs (no defaults but these, no
# __post_init__, no slots): fields, eq, hash, repr and immutability are the dataclass's.


@dataclass(frozen=True, init=False)
class TensorEntry:
    """One tensor of a layer: where its bytes are and how to view them."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int = 0
    nbytes: int = 0

    def __init__(
        self, name: str, dtype: str, shape: tuple[int, ...], offset: int = 0, nbytes: int = 0
    ) -> None:
        self.__dict__.update(name=name, dtype=dtype, shape=shape, offset=offset, nbytes=nbytes)


@dataclass(frozen=True, init=False)
class LayerEntry:
    """One layer's snapshot, described."""

    signature: str
    codec: str
    codec_version: int
    start: int
    stop: int
    meta: Mapping[str, Any]
    tensors: tuple[TensorEntry, ...]

    def __init__(
        self,
        signature: str,
        codec: str,
        codec_version: int,
        start: int,
        stop: int,
        meta: Mapping[str, Any],
        tensors: tuple[TensorEntry, ...],
    ) -> None:
        self.__dict__.update(
            signature=signature,
            codec=codec,
            codec_version=codec_version,
            start=start,
            stop=stop,
            meta=meta,
            tensors=tensors,
        )


def writer() -> str:
    from kvstore import __version__

    return f"kvstore {__version__}"


def corrupt(op: str, message: str, **attrs: Any) -> CorruptEntryError:
    return CorruptEntryError(f"[{op}] {message}", **attrs)


def check_format(op: str, version: Any) -> None:
    """Raise ``FormatVersionError`` unless this reader reads format ``version``."""
    if version not in SUPPORTED_VERSIONS:
        reads = ", ".join(map(str, SUPPORTED_VERSIONS))
        newer = isinstance(version, int) and version > max(SUPPORTED_VERSIONS)
        fix = (
            "Upgrade kvstore, or treat the entry as a miss."
            if newer
            else "Run 'kvstore migrate' with a release that reads it."
        )
        raise FormatVersionError(
            f"[{op}] Format {version!r} is {'newer than' if newer else 'not read by'} this "
            f"reader (reads {reads}). {fix}",
            found=version,
            supported=SUPPORTED_VERSIONS,
        )


def check_bounds(op: str, value: Any, bounds: Bounds = BOUNDS) -> None:
    """Walk ``value`` (iteratively, a level at a time) and raise ``CorruptEntryError``
    past any bound.

    Also rejects anything but the msgpack/JSON data model (dict with str
    keys, list, str, bytes, int, float, bool, None).
    """
    # Exact types, not isinstance: decoders produce exactly these, and type()
    # dispatch keeps this walk cheap on every record read.
    level, depth = [value], 1
    while level:
        if depth > bounds.depth:
            raise corrupt(op, f"Header nesting is deeper than {bounds.depth} levels.")
        deeper: list[Any] = []
        for item in level:
            kind = type(item)
            if kind is dict:
                if len(item) > bounds.map_len:
                    raise corrupt(
                        op, f"A header map has {len(item)} entries (at most {bounds.map_len})."
                    )
                for key in item:
                    if type(key) is not str or len(key) > bounds.str_len:
                        raise corrupt(
                            op, f"A header map key is not a short str: {str(key)[:40]!r}."
                        )
                deeper.extend(item.values())
            elif kind is list:
                if len(item) > bounds.array_len:
                    raise corrupt(
                        op, f"A header array has {len(item)} items (at most {bounds.array_len})."
                    )
                deeper.extend(item)
            elif kind is str:
                if len(item) > bounds.str_len:
                    raise corrupt(
                        op, f"A header string has {len(item)} chars (at most {bounds.str_len})."
                    )
            elif kind is bytes:
                if len(item) > bounds.bin_len:
                    raise corrupt(
                        op,
                        f"A header byte string has {len(item)} bytes (at most {bounds.bin_len}).",
                    )
            elif kind not in _SCALARS:
                raise corrupt(op, f"A header value of type {kind.__name__} is not data.")
        level, depth = deeper, depth + 1


_SCALARS = (int, float, bool, type(None))


def is_bounded(value: Any, depth: int, bounds: Bounds = BOUNDS) -> bool:
    """True when ``value``, sitting ``depth`` levels down a header (1: the header
    itself), breaks none of :func:`check_bounds`' rules."""
    kind = type(value)
    if kind is dict:
        if len(value) > bounds.map_len:
            return False
        for key in value:
            if type(key) is not str or len(key) > bounds.str_len:
                return False
        items: Any = value.values()
    elif kind is list:
        if len(value) > bounds.array_len:
            return False
        items = value
    elif depth > bounds.depth:
        return False
    elif kind is str:
        return len(value) <= bounds.str_len
    elif kind is bytes:
        return len(value) <= bounds.bin_len
    else:
        return kind in _SCALARS
    if depth >= bounds.depth:  # its items would sit too deep
        return depth == bounds.depth and not value
    for item in items:  # scalars inline: a call each would be most of the walk
        kind = type(item)
        if kind is str:
            if len(item) > bounds.str_len:
                return False
        elif kind is int or kind is float or kind is bool or item is None:
            continue
        elif not is_bounded(item, depth + 1, bounds):
            return False
    return True


# -- field validation ------------------------------------------------------------------

Check = Callable[[Any], bool]


def is_int(value: Any) -> bool:
    return type(value) is int and 0 <= value <= MAX_INT


def is_str(value: Any) -> bool:
    return isinstance(value, str) and 0 < len(value) <= MAX_STR_CHARS


def is_map(value: Any) -> bool:
    return isinstance(value, dict)


def parse_fields(op: str, obj: Any, where: str, fields: Mapping[str, Check]) -> dict[str, Any]:
    """The fields of map ``obj``, each present and passing its check.

    Raises:
        CorruptEntryError: not a map, a field missing, or one failing its check.
        FormatVersionError: a field this reader does not know (unless it is a
            map marked ``"must_understand": false``).
    """
    if type(obj) is dict and obj.keys() == fields.keys():  # the usual case: exactly the fields
        for key, check in fields.items():
            if not check(obj[key]):
                raise corrupt(op, f"{where}.{key} is invalid: {str(obj[key])[:80]!r}.")
        return obj
    if not isinstance(obj, dict):
        raise corrupt(op, f"{where} must be a map; found {type(obj).__name__}.")
    for key, value in obj.items():
        if key in fields:
            continue
        if isinstance(value, dict) and value.get("must_understand") is False:
            continue
        raise FormatVersionError(
            f"[{op}] {where} has field '{key}', which this reader (format "
            f"{FORMAT_VERSION}) does not understand. It was written by a newer kvstore; "
            f"upgrade, or treat the entry as a miss.",
            found=key,
            supported=SUPPORTED_VERSIONS,
        )
    out = {}
    for key, check in fields.items():
        if key not in obj:
            raise corrupt(op, f"{where} lacks the required field '{key}'.")
        if not check(obj[key]):
            raise corrupt(op, f"{where}.{key} is invalid: {str(obj[key])[:80]!r}.")
        out[key] = obj[key]
    return out


def _is_dtype(value: Any) -> bool:
    return type(value) is str and value in DTYPES


def _is_shape(value: Any) -> bool:
    return type(value) is list and 0 < len(value) <= BOUNDS.rank and all(map(is_int, value))


TENSOR_FIELDS: dict[str, Check] = {"name": is_str, "dtype": _is_dtype, "shape": _is_shape}
LOCATED_TENSOR_FIELDS: dict[str, Check] = {**TENSOR_FIELDS, "offset": is_int, "nbytes": is_int}
LAYER_FIELDS: dict[str, Check] = {
    "signature": is_str,
    "codec": is_str,
    "codec_version": is_int,
    "start": is_int,
    "stop": is_int,
    "meta": is_map,
    "tensors": lambda v: type(v) is list and len(v) <= BOUNDS.tensors_per_layer,
}


def _parse_tensor(op: str, obj: Any, where: Callable[[], str], located: bool) -> TensorEntry:
    try:
        f = parse_fields(op, obj, "", LOCATED_TENSOR_FIELDS if located else TENSOR_FIELDS)
    except (CorruptEntryError, FormatVersionError):
        # Parse again for the message: where it is costs a format on every tensor.
        parse_fields(op, obj, where(), LOCATED_TENSOR_FIELDS if located else TENSOR_FIELDS)
        raise
    shape = tuple(f["shape"])
    size = DTYPES[f["dtype"]].itemsize
    for dim in shape:
        size *= dim
    if located and size != f["nbytes"]:
        raise corrupt(
            op,
            f"{where()} has {f['nbytes']} bytes; shape {list(shape)} of {f['dtype']} needs {size}.",
        )
    return TensorEntry(f["name"], f["dtype"], shape, f.get("offset", 0), f.get("nbytes", size))


def _tensor_where(layer: str, index: int) -> str:
    return f"{layer}.tensors[{index}]"


def parse_layers(op: str, obj: Any, located: bool) -> tuple[LayerEntry | None, ...]:
    """The ``layers`` array of a header. ``located``: tensors carry offset/nbytes."""
    if not isinstance(obj, list) or len(obj) > BOUNDS.layers:
        raise corrupt(op, f"layers must be an array of at most {BOUNDS.layers} entries.")
    layers: list[LayerEntry | None] = []
    for i, item in enumerate(obj):
        if item is None:
            layers.append(None)
            continue
        where = f"layers[{i}]"
        f = parse_fields(op, item, where, LAYER_FIELDS)
        if f["start"] > f["stop"]:
            raise corrupt(op, f"{where} covers [{f['start']}, {f['stop']}): start after stop.")
        tensors = tuple(
            _parse_tensor(op, t, partial(_tensor_where, where, j), located)
            for j, t in enumerate(f["tensors"])
        )
        if len({t.name for t in tensors}) != len(tensors):
            raise corrupt(op, f"{where} names a tensor twice.")
        layers.append(
            LayerEntry(
                f["signature"],
                f["codec"],
                f["codec_version"],
                f["start"],
                f["stop"],
                f["meta"],
                tensors,
            )
        )
    return tuple(layers)


def header_fields(extra: Mapping[str, Check] | None) -> dict[str, Check]:
    """The fields of a header and their checks: the common ones and a container's ``extra``."""
    return {
        "format": lambda v: type(v) is int,
        "writer": is_str,
        "layers": lambda v: isinstance(v, list),
        "meta": is_map,
        **(extra or {}),
    }


def checked_header(
    op: str, obj: Any, fields: Mapping[str, Check], located: bool
) -> tuple[dict[str, Any], tuple[LayerEntry | None, ...]]:
    """The header's fields and layers, each rule checked in turn: the error names the
    first one broken (:func:`kvstore.codecs.header_parse.usual_header` is the fast way to
    the same answer).

    Raises:
        CorruptEntryError: a bound, a field or a layer's rule broken.
        FormatVersionError: a format, or a field, this reader does not read.
    """
    check_bounds(op, obj)
    if isinstance(obj, dict) and "format" in obj:
        check_format(op, obj["format"])
    f = parse_fields(op, obj, "header", fields)
    return f, parse_layers(op, f["layers"], located=located)


def layer_entry(snapshot: Snapshot, tensors: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The header entry describing ``snapshot`` with the given tensor manifest.

    Raises:
        UnknownSignatureError: no codec serves the snapshot's kind.
    """
    from kvstore.codecs.registry import get_codec

    codec = get_codec(snapshot.signature)
    return {
        "signature": snapshot.signature,
        "codec": type(codec).__name__,
        "codec_version": codec.version,
        "start": int(snapshot.start),
        "stop": int(snapshot.stop),
        "meta": dict(snapshot.meta),
        "tensors": list(tensors),
    }


def tensor_manifest(snapshot: Snapshot) -> list[dict[str, Any]]:
    """``name``/``dtype``/``shape`` of each tensor of ``snapshot``, in order."""
    return [
        {"name": name, "dtype": dtype_name(array), "shape": [int(d) for d in array.shape]}
        for name, array in snapshot.tensors.items()
    ]


def check_codec_versions(op: str, layers: Sequence[LayerEntry | None]) -> None:
    """Raise ``FormatVersionError`` for a layer whose codec (when installed)
    does not read the version it was written with."""
    from kvstore.codecs.registry import find_codec_class, kind_of

    # A header's layers mostly share one signature: it is looked up once.
    classes: dict[str, type[KVCodec] | None] = {}
    for i, layer in enumerate(layers):
        if layer is None:
            continue
        if layer.signature in classes:
            cls = classes[layer.signature]
        else:
            try:
                cls = find_codec_class(kind_of(layer.signature))
            except UnknownSignatureError:  # a kind not installed here: its records still decode
                cls = None
            except (ValueError, TypeError) as exc:
                raise corrupt(
                    op, f"layers[{i}].signature {layer.signature!r} is malformed: {exc}"
                ) from exc
            classes[layer.signature] = cls
        if cls is not None and layer.codec_version not in cls.reads:
            raise FormatVersionError(
                f"[{op}] layers[{i}] ({layer.signature}) was written by {layer.codec} "
                f"version {layer.codec_version}; {cls.__name__} here reads versions "
                f"{', '.join(map(str, sorted(cls.reads)))}. Upgrade kvstore or the "
                f"codec's package.",
                found=layer.codec_version,
                supported=tuple(sorted(cls.reads)),
            )
